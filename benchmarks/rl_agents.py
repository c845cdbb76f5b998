"""RL1's multi-turn figure: a GRPO step's time split into generation, tools, rewards and the update, for
episodes with a tool (jobs/grpo-tools.yaml: the demo agent and its calculator, vLLM engines beside 2 CPU
workers) beside single-turn GRPO on the same engine (jobs/grpo-vllm.yaml).

    python -m benchmarks.rl_agents [--steps 8] [--model FOLDER] [--log FILE]

--model: the agent jobs/grpo-tools-sft.yaml exported (its final_model); without it the SFT job runs first,
as shipped, on the quickstart's assets (built under benchmarks/.cache/agents). Each job runs as shipped but for
its step count, one after the other on one local Ray instance; the figures are MLflow's per-step `step_time_s`,
`time/rollout_s`, `vllm/sync_s`, `time/generation_s`, `time/tools_s` and `time/reward_s` (rank 0's), medians
over the steps after the first 2 (the engines' start is the first step's). The update is the step less its
rollout. The two jobs keep their own shapes (single-turn: 16 tokens a completion; the agent: 48 over all its
turns), so the mean completion length and generation_tokens_per_s are printed beside the seconds."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "agents"
WARMUP = 2
KEYS = ("step_time_s", "time/rollout_s", "vllm/sync_s", "time/generation_s", "time/tools_s", "time/reward_s")
SHAPE = ("completions/mean_length", "generation_tokens_per_s", "tools/call_frequency", "tools/turns_per_episode")


def job(file: str, assets: Path, storage: Path, steps: int | None, **over) -> object:
    """jobs/<file> as shipped, on the benchmark's storage and experiment; `steps` (None: the shipped
    max_steps) and `over` (deep-merged sections) change it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import deep_merge

    from raytrain.job.spec import JobSpec

    raw = yaml.safe_load((ROOT / "jobs" / file).read_text())
    base = {
        "checkpoint": {"storage_path": str(storage), "every_n_steps": 1000},
        "tracking": {"experiment": "rl-agents"},
    } | ({"training": {"max_steps": steps}} if steps is not None else {})
    return JobSpec.model_validate(deep_merge(deep_merge(raw, base), over))


def split(spec, run_id: str) -> dict:
    from mlflow.tracking import MlflowClient

    from raytrain.tracking.mlflow_run import tracking_uri

    client = MlflowClient(tracking_uri(spec))
    out = {}
    for key in KEYS + SHAPE:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        out[key] = statistics.median(v for s, v in history if s > WARMUP) if len(history) > WARMUP else None
    if out["step_time_s"] is not None and out["time/rollout_s"] is not None:
        out["update_s"] = out["step_time_s"] - out["time/rollout_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default=None)
    p.add_argument("--log", default=None)
    args = p.parse_args()
    import ray

    from raytrain.demo_assets import make_all
    from raytrain.driver import launcher

    assets = make_all(CACHE / "assets")
    storage = CACHE / f"runs-{int(time.time())}"
    ray.init(address="local", num_cpus=6, include_dashboard=False)
    model = args.model
    if model is None:
        sft = job("grpo-tools-sft.yaml", assets, storage, None, model={"path": str(assets / "model-tools")},
                  data={"path": str(assets / "tool-sft.jsonl")})  # fmt: skip
        launcher.run(sft)
        model = f"{sft.run_dir}/final_model"
    figures = {}
    for name, spec in (
        (
            "single-turn",
            job(
                "grpo-vllm.yaml",
                assets,
                storage,
                args.steps,
                model={"path": str(assets / "model-hd64")},
                data={"path": str(assets / "prompts.jsonl")},
            ),
        ),  # fmt: skip
        (
            "multi-turn, a tool",
            job(
                "grpo-tools.yaml",
                assets,
                storage,
                args.steps,
                model={"path": model},
                data={"path": str(assets / "arithmetic.jsonl")},
            ),
        ),  # fmt: skip
    ):
        result = launcher.run(spec)
        figures[name] = split(spec, result.run_id)
    lines = [f"RL1 multi-turn, {args.steps} steps, medians after step {WARMUP} (s):"]
    for name, f in figures.items():
        lines.append(f"  {name:20s} " + "  ".join(f"{k} {v:.3f}" for k, v in f.items() if v is not None))
    one, many = figures["single-turn"], figures["multi-turn, a tool"]
    for key in ("step_time_s", "time/generation_s", "update_s"):
        if one.get(key) and many.get(key):
            lines.append(f"  multi-turn / single-turn {key}: {many[key] / one[key]:.2f}")
    text = "\n".join(lines)
    print(text)
    if args.log:
        Path(args.log).write_text(text + "\n" + json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
