"""Every shipped job trains, in miniature (litgpt tests every shipped config: a shipped job that cannot run is a defect;
the 64k job's sp + activation checkpointing crashed at its first backward).

Each YAML in jobs/ keeps every option it sets (strategy, fine-tuning, objective, precision, sequence parallelism,
activation checkpointing, packing, attention, async checkpoints, offload, evaluation) and changes only what this machine
cannot hold: the model becomes a tiny one of the same architecture (the published config scaled down: 2 layers, the same
head ratio), the data the demo rows in the job's format (GRPO: the demo prompts, 4 completions of at most 16 tokens),
the workers 4 CPU ranks (whole sequence-parallel groups), rows and batches shorter, and 2 steps with a checkpoint.
flash_attention_2 is transformers' integration with flash-attn's kernels in plain torch (tests/varlen.py). The miniature
validates as `raytrain validate` checks it, trains on 4 gloo ranks through the worker's path without Ray
(tests/gpu/local_run.py: prepare, strategy, `loop.fit`, commit), and its checkpoint restores. One spawned group of 4
ranks trains every miniature in turn, as test_combinations' group runs its cases: torch and the product are imported
once, not once a job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import KNOWN_CONFIGS, REPO

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import local_run  # noqa: E402

pytestmark = pytest.mark.slow
# The jobs that run here as shipped are tests whole (a miniature would be them again, smaller).
WHOLE = {
    "quickstart.yaml": "test_spine.py runs `raytrain quickstart`",
    "grpo-demo.yaml": "test_rl.py runs it",
    "grpo-vllm.yaml": "test_vllm.py runs it",
    "grpo-tools-sft.yaml": "test_rl_agents.py runs it (its SFT fixture)",
    "grpo-tools.yaml": "test_rl_agents.py runs it",
}
JOBS = sorted(p for p in (REPO / "jobs").glob("*.yaml") if p.name not in WHOLE)
WORLD = 4


def tiny_model(hub_id: str, assets: Path, out: Path, tokenizer: str = "model") -> Path:
    """The hub model's architecture at toy size: its config.json with 2 layers, head_dim 16, the same
    query-to-KV-head ratio (at most 4), a demo tokenizer's vocabulary (`tokenizer`: the agent's,
    whose chat template renders tools, for a job with tools); saved in the job's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    published = dict(KNOWN_CONFIGS[hub_id])
    ratio = min(4, published["num_attention_heads"] // published["num_key_value_heads"])
    heads, kv = 2 * ratio, 2
    vocab = json.loads((assets / tokenizer / "config.json").read_text())["vocab_size"]
    small = {
        **published,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": 16 * heads,
        "intermediate_size": 56 * heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        **({"head_dim": 16} if "head_dim" in published else {}),
    }
    small.pop("architectures", None)
    config = AutoConfig.for_model(small.pop("model_type"), **small)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(out))
    for f in (assets / tokenizer).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def demo_data(assets: Path, fmt: str, preference: bool, tmp: Path, kto: bool = False) -> Path:
    """The demo rows in a job's format: text and TRL's pairs as they are; chat rows as ShareGPT or
    alpaca rows, pairs as TRL's conversational shape (what `format: chat` preference rows are), KTO
    rows as LLaMA-Factory's kto_en_demo.json (messages and a label)."""
    out = tmp / f"{fmt}{'-kto' if kto else '-pairs' if preference else ''}.jsonl"
    if kto:
        if fmt != "chat":
            return assets / "kto.jsonl"
        rows = [json.loads(line) for line in (assets / "kto.jsonl").read_text().splitlines()]
        rows = [
            {
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ],
                "label": r["label"],
            }
            for r in rows
        ]
    elif preference:
        if fmt != "chat":
            return assets / "pairs.jsonl"
        rows = [json.loads(line) for line in (assets / "pairs.jsonl").read_text().splitlines()]
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    elif fmt in ("text", "chat"):
        return assets / f"{fmt}.jsonl"
    else:
        chats = [json.loads(line)["messages"] for line in (assets / "chat.jsonl").read_text().splitlines()]
        if fmt == "sharegpt":
            names = {"user": "human", "assistant": "gpt", "system": "system"}
            rows = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]} for c in chats]
        else:  # alpaca
            rows = [
                {
                    "instruction": next(m["content"] for m in c if m["role"] == "user"),
                    "input": "",
                    "output": next(m["content"] for m in c if m["role"] == "assistant"),
                }
                for c in chats
            ]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def miniature(job: Path, assets: Path, tmp: Path) -> dict:
    raw = yaml.safe_load(job.read_text())
    hub_id = raw["model"]["path"]
    d, t, s = raw["data"], raw.setdefault("training", {}), raw.setdefault("scaling", {})
    tools = bool((t.get("grpo") or {}).get("tools") or (t.get("grpo") or {}).get("environment"))
    tokenizer = "model-tools" if tools else "model"  # a tokenizer whose template renders tools (the demo's)
    raw["model"]["path"] = str(
        tiny_model(hub_id, assets, tmp / "model", tokenizer) if hub_id in KNOWN_CONFIGS else assets / tokenizer
    )
    preference, kto = t.get("objective", "sft") != "sft", t.get("objective") == "kto"
    for source in d.get("sources") or [d]:
        fmt = source.get("format") or d.get("format", "text")
        prompts = assets / ("arithmetic.jsonl" if tools else "prompts.jsonl")  # tools: conversational prompts
        source["path"] = str(prompts if fmt == "prompt" else demo_data(assets, fmt, preference, tmp, kto))
    if (d.get("eval") or {}).get("path"):
        d["eval"]["path"] = str(demo_data(assets, d.get("format", "text"), preference, tmp, kto))
    if d.get("eval"):
        d["eval"]["every_n_steps"] = 2
    group = s.get("sequence_parallel", 1) * s.get("tensor_parallel", 1)
    d["seq_len"] = min(d.get("seq_len", 512), 128) // group * group
    if "grpo" in t:  # GRPO: completions that fit the shorter rows, beside the demo prompts (a tool call: 48)
        t["grpo"].update(
            max_completion_length=min(t["grpo"]["max_completion_length"], 48 if tools else 16),
            num_generations=min(t["grpo"]["num_generations"], 4),
        )
        if t["grpo"].get("engine") == "vllm":  # the miniature trains through the worker's path without an engine
            t["grpo"] = {k: v for k, v in t["grpo"].items() if not k.startswith("vllm_")} | {"engine": "hf"}
    dp = WORLD // group
    t.update(global_batch_size=dp * t.get("micro_batch_size", 4) * 2, max_steps=2)  # 2 micro-batches a rank
    for key in ("num_workers", "min_workers", "max_workers", "cpus_per_worker", "accelerator_memory_gb", "use_gpu"):
        s.pop(key, None)
    s.update(num_workers=WORLD, workers_per_node=WORLD if s.get("workers_per_node", 1) > 1 else 1)
    raw["checkpoint"] = {**raw.get("checkpoint", {}), "storage_path": str(tmp / "runs"), "every_n_steps": 2}
    raw["tracking"] = {"experiment": "tests"}
    return raw


def train_and_restore(rank: int, world: int, device, jobs: dict[str, tuple[str, dict]]) -> dict:
    """On every rank (spawned once for all the jobs: torch and the product imported once): each job
    in turn trains 2 steps with a checkpoint, then a fresh strategy restores it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import varlen

    from raytrain.job.spec import JobSpec
    from raytrain.strategies import build_strategy

    varlen.install()
    out = {}
    for name, (spec_json, prepared) in jobs.items():
        spec = JobSpec.model_validate_json(spec_json)
        try:
            local_run.torch_linear()  # zero3's F.linear is not the next job's
            strategy = build_strategy(spec, device)
            trained = local_run.train(spec, strategy, prepared)
            local_run.release(strategy)
            again = build_strategy(spec, device)
            state = local_run.restore(again)
            local_run.release(again)
        except Exception as exc:  # name the job: the spawned traceback alone does not
            raise RuntimeError(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
        out[name] = {
            "losses": trained.losses,
            "restored_step": state.step,
            "metrics": {k: v for k, v in trained.steps.get(2, {}).items() if isinstance(v, float)},
        }
    return out


@pytest.fixture(scope="module")
def miniatures(assets, tmp_path_factory) -> dict:
    """Each shipped job in miniature, validated as `raytrain validate` checks it, its stores prepared;
    then all trained and restored by one spawned group of WORLD ranks."""
    from raytrain.job.spec import JobSpec
    from raytrain.validate import preflight

    specs, jobs = {}, {}
    for job in JOBS:
        tmp = tmp_path_factory.mktemp(job.stem)
        raw = miniature(job, assets, tmp)
        small = tmp / job.name
        small.write_text(yaml.safe_dump(raw))
        report = preflight.check(str(small), probes=True)
        specs[job.name] = (JobSpec.model_validate(raw), [str(p) for p in report.errors])
        if not report.errors:
            jobs[job.name] = (specs[job.name][0].model_dump_json(), local_run.prepare_data(specs[job.name][0]))
    return {"specs": specs, "results": local_run.spawn(train_and_restore, WORLD, torch.device("cpu"), jobs)}


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_a_shipped_job_trains_in_miniature_with_its_own_options(job, miniatures):
    spec, errors = miniatures["specs"][job.name]
    assert not errors, errors
    out = miniatures["results"][job.name]
    losses = out["losses"]
    print(f"\n[miniature] {job.name}: losses {losses}, restored at step {out['restored_step']}")
    assert sorted(map(int, losses)) == [1, 2]
    if spec.rl:  # GRPO's loss is a surrogate around 0 (advantages have zero mean): its rewards were measured
        assert all(abs(v) < 50 for v in losses.values()) and 0 <= out["metrics"]["reward"] <= 1, out
    else:
        assert all(0 < v < 50 for v in losses.values()), losses
    assert out["restored_step"] == 2
    if spec.data.eval:
        assert "eval_loss" in out["metrics"]
