"""GPU throughput and memory of raytrain's strategies, without Ray: `python -m benchmarks.gpu`.

A ~1.1B-parameter Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocabulary 32000;
random weights stored as bf16 safetensors in a temporary folder) at seq_len 4096, trained through
the product's own path (`build_strategy`, `loop.fit` on rows `open_data` reads from a prepared
token store; tests/gpu/local_run.py is what stands in for Ray) under each strategy: fsdp2 LoRA and
full, ddp LoRA, zero3 LoRA and full (when DeepSpeed imports); and TRL's SFTTrainer on the same
model and documents, LoRA and full (benchmarks/gpu_trl.py; when TRL imports). Each case runs in a
fresh process; after the warm-up steps it times the measured steps and prints:

- tokens/s (global) and MFU: raytrain.telemetry's flops_per_token over the device's bf16 peak
  from telemetry's table;
- torch.cuda.max_memory_allocated over the whole case (build and steps) and what
  `raytrain validate` estimates for the job (raytrain.memory.estimate; its ~1 GiB runtime term
  is the CUDA context and NCCL, which max_memory_allocated does not count), and their ratio;
- each raytrain case's tokens/s over TRL's with the same fine-tuning (LoRA or full).

    python -m benchmarks.gpu                      # on a GPU machine (tests/gpu/run.sh runs it)
    python -m benchmarks.gpu --cases fsdp2-full --steps 20 --json out.json
    python -m benchmarks.gpu --cpu --tiny         # a tiny model, 2 measured steps on CPU: the code path only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
CASES = ("fsdp2-lora", "trl-lora", "fsdp2-full", "trl-full", "ddp-lora", "zero3-lora", "zero3-full")
ONE_B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 32000,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 192,
    "vocab_size": 384,
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo, fp32): checks the code path, no figures")
    p.add_argument("--tiny", action="store_true", help="a 2-layer hidden-64 Llama, seq_len 128, 2 measured steps")
    p.add_argument("--gpus", type=int, default=1, help="ranks, one process per GPU (default 1)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per step (default 8; --tiny 4)")
    p.add_argument("--micro-batch", type=int, help="sequences per forward (default 1; --tiny 2)")
    p.add_argument("--warmup", type=int, help="steps left out of the timing (default 3; --tiny 1)")
    p.add_argument("--steps", type=int, help="measured steps (default 10; --tiny 2)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--compile",
        default="auto",
        choices=("auto", "true", "false"),
        help="training.compile (default auto, the product's: compiled blocks on GPUs under fsdp2 and ddp)",
    )
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=("eager", "sdpa", "flash_attention_2"),
        help="model.attn_implementation (default sdpa, the product's)",
    )
    p.add_argument(
        "--detect-anomaly",
        action="store_true",
        help="torch.autograd's anomaly mode: stop at the first backward op that returns NaN, naming its forward",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch's profiler over two steps after the warm-up: each case's 20 busiest ops (those steps are slower)",
    )
    p.add_argument("--workdir", help="keep the generated model, data and token store here (default: a temp folder)")
    p.add_argument("--json", help="write every case's figures to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one case in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    tiny = a.tiny
    a.seq_len = a.seq_len or (128 if tiny else 4096)
    a.global_batch = a.global_batch or (4 if tiny else 8)
    a.micro_batch = a.micro_batch or (2 if tiny else 1)
    a.warmup = 1 if a.warmup is None and tiny else (3 if a.warmup is None else a.warmup)
    a.steps = a.steps or (2 if tiny else 10)
    if a.warmup < 1:
        p.error("--warmup must be at least 1: the first step's end starts the timed window")
    unknown = [c for c in a.cases.split(",") if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}: use {', '.join(CASES)}")
    return a


# ------------------------------------------------------------------ assets
def make_assets(a: argparse.Namespace, work: Path, device) -> tuple[Path, Path]:
    """(model folder, data file): random weights in bf16 safetensors with the demo tokenizer, and
    enough demo text for several global batches of seq_len tokens."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raytrain.demo_assets import make_tokenizer, text_rows, write_jsonl

    dims = TINY if a.tiny else ONE_B
    model = work / ("model-tiny" if a.tiny else "model-1b")
    if not (model / "config.json").exists():
        tmp = model.with_name(model.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tok = make_tokenizer(tmp)
        # No pad_token_id: with one, the embedding's padding row is initialized to zeros, and a packed
        # row that starts with a lone end-of-text token (a document's last token carried over) holds
        # an all-zero hidden state through every layer; RMSNorm's backward at zero is 1/sqrt(eps),
        # ~100x a layer here, so its gradient overflowed by layer 8 of 16 and every case went NaN
        # at the step that met such a row (found with --detect-anomaly on an H200). A trained model
        # has no all-zero row for a token its data holds.
        config = LlamaConfig(
            **{**dims, "vocab_size": max(dims["vocab_size"], len(tok))},
            max_position_embeddings=max(2 * a.seq_len, 2048),
            tie_word_embeddings=False,
            eos_token_id=0,
            pad_token_id=None,
            bos_token_id=None,
        )
        started = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(tmp))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the cases' processes get the whole GPU
        tmp.rename(model)
        from raytrain.validate.memory import size as memory_size

        print(
            f"[bench] generated {model.name}: "
            f"{memory_size(sum(f.stat().st_size for f in model.glob('*.safetensors')))} "
            f"of bf16 safetensors in {time.perf_counter() - started:.0f}s",
            flush=True,
        )
    # ~21 tokens a document: enough rows that a global batch is never the same rows twice in a run.
    docs = max(4000, (a.warmup + a.steps) * a.global_batch * a.seq_len * a.gpus // 20)
    data = work / f"text-{docs}.jsonl"
    if not data.exists():
        write_jsonl(data, text_rows(docs))
    return model, data


def job(a: argparse.Namespace, case: str, model: Path, data: Path, work: Path):
    from raytrain.job.spec import JobSpec

    strategy, finetune = case.split("-")
    gpu = not a.cpu
    return JobSpec.model_validate(
        {
            "name": f"bench-{case}",
            "model": {"path": str(model), "dtype": "bfloat16", "attn_implementation": a.attention},
            "data": {"path": str(data), "seq_len": a.seq_len},
            "training": {
                "strategy": strategy,
                "finetune": finetune,
                "global_batch_size": a.global_batch,
                "micro_batch_size": a.micro_batch,
                "max_steps": a.warmup + a.steps,
                "seed": 0,
                "precision": "bf16" if gpu else "fp32",
                "lora": {"rank": a.lora_rank, "alpha": 2 * a.lora_rank},
                "activation_checkpointing": a.activation_checkpointing,
                "compile": {"auto": "auto", "true": strategy != "zero3", "false": False}[a.compile],
            },
            "optimizer": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
            "scaling": {"num_workers": a.gpus, "use_gpu": gpu},
            "checkpoint": {"storage_path": str(work / "runs"), "every_n_steps": 10**6, "export_final": False},
            "tracking": {"experiment": "bench-gpu"},
        }
    )


# ------------------------------------------------------------------ one case (a child process)
def run_case(
    rank: int,
    world: int,
    device,
    spec_json: str,
    prepared: dict,
    warmup: int,
    model: str,
    detect_anomaly: bool = False,
    profile: bool = False,
) -> dict:
    """On every rank: build the strategy, train warm-up + measured steps; rank 0's figures."""
    import local_run as lr
    import torch

    from raytrain.job.spec import JobSpec
    from raytrain.model.facts import read_facts
    from raytrain.strategies import build_strategy
    from raytrain.train import telemetry
    from raytrain.validate import memory

    spec = JobSpec.model_validate_json(spec_json)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if detect_anomaly:  # slower; for finding where a non-finite gradient comes from, not for figures
        torch.autograd.set_detect_anomaly(True)
    started = time.perf_counter()
    strategy = build_strategy(spec, device)
    build_s = time.perf_counter() - started
    ends: list[float] = []

    # --profile: the two steps after the warm-up under torch's profiler, its busiest ops in the output
    # (what a step's time is made of, e.g. where zero3 LoRA's goes); those steps are slower.
    profiler = (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
            schedule=torch.profiler.schedule(wait=max(warmup - 1, 0), warmup=1, active=2, repeat=1),
        )
        if profile
        else None
    )

    def on_step(state, batch) -> None:  # the loop already synced (its loss all-reduce); to be sure
        if cuda:
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
        if profiler is not None:
            profiler.step()

    with profiler if profiler is not None else contextlib.nullcontext():
        trained = lr.train(spec, strategy, prepared, checkpoints=False, on_step=on_step)
    flops = telemetry.StepFlops(strategy.model, spec, device)
    steps = len(ends) - warmup
    seconds = ends[-1] - ends[warmup - 1]
    tokens_per_s = steps * spec.training.global_batch_size * spec.sequences_per_row * spec.data.seq_len / seconds
    peak = flops.peak
    estimate = memory.estimate(spec, read_facts(Path(model)), world)
    out = {
        "case": f"{spec.training.strategy}-{spec.training.finetune}",
        "world": world,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "build_s": build_s,
        "first_step_s": ends[0] - started - build_s,
        "measured_steps": steps,
        "step_s": seconds / steps,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops.per_token["flops_per_token"],
        "tflops_per_s_per_device": tokens_per_s * flops.per_token["flops_per_token"] / world / 1e12,
        "mfu": tokens_per_s * flops.per_token["flops_per_token"] / (peak * world) if peak else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "peak_rss_gib": telemetry.peak_memory_gb(torch.device("cpu")),
        "estimate_gib": estimate.total / 2**30,
        "estimate": estimate.arithmetic(),
        "losses": trained.losses,
        "kernels": strategy.kernel_line(),
    }
    if profiler is not None:
        out["profile"] = profiler.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=20
        )
    if out["peak_allocated_gib"] is not None:
        out["measured_over_estimate"] = out["peak_allocated_gib"] / out["estimate_gib"]
    lr.release(strategy)
    return out


def child(a: argparse.Namespace) -> None:
    import local_run as lr
    import torch

    work = Path(a.workdir)
    meta = json.loads((work / "bench.json").read_text())
    if a.child.startswith("trl-"):
        from . import gpu_trl

        Path(a.out).write_text(json.dumps(gpu_trl.run(a, a.child, Path(meta["model"]), Path(meta["data"]), work)))
        return
    spec = job(a, a.child, Path(meta["model"]), Path(meta["data"]), work)
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    args = (spec.model_dump_json(), meta["prepared"], a.warmup, meta["model"], a.detect_anomaly, a.profile)
    if a.gpus == 1:
        with lr.process_group(device) as d:
            result = run_case(0, 1, d, *args)
    else:
        result = lr.spawn(run_case, a.gpus, device, *args)
    Path(a.out).write_text(json.dumps(result))


# ------------------------------------------------------------------ the bench process
def fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def size(gib: float | None) -> str:
    from raytrain.validate.memory import size as memory_size

    return "n/a" if gib is None else memory_size(gib * 2**30)


def table(results: list[dict]) -> str:
    trl = {
        r["case"].split("-")[1]: r["tokens_per_s"] for r in results if r["case"].startswith("trl-") and "error" not in r
    }
    head = (
        f"{'case':<11} {'tokens/s':>10} {'MFU':>6} {'step s':>7} {'peak alloc':>11} {'estimate':>11} {'alloc/est':>9} "
        f"{'reserved':>11} {'÷ TRL':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:<11} {r['error']}")
            continue
        theirs = trl.get(r["case"].split("-")[1]) if not r["case"].startswith("trl-") else None
        lines.append(
            f"{r['case']:<11} {r['tokens_per_s']:>10,.0f} {fmt(r['mfu'], '.1%'):>6} {r['step_s']:>7.3f} "
            f"{size(r['peak_allocated_gib']):>11} {size(r['estimate_gib']):>11} "
            f"{fmt(r.get('measured_over_estimate'), '.2f'):>9} {size(r['peak_reserved_gib']):>11} "
            f"{fmt(r['tokens_per_s'] / theirs if theirs else None, '.2f', '-'):>6}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse(argv)
    # Token stores are signed (signing.py): a key for this run only, never ~/.raytrain.
    os.environ.setdefault("RAYTRAIN_CHECKPOINT_KEY", secrets.token_hex(32))
    if a.child:
        child(a)
        return 0
    import torch

    if not a.cpu and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; --cpu --tiny runs the code path on CPU", file=sys.stderr)
        return 2
    if not a.cpu and torch.cuda.device_count() < a.gpus:
        print(f"benchmarks.gpu: --gpus {a.gpus} but {torch.cuda.device_count()} GPU(s) here", file=sys.stderr)
        return 2
    import local_run as lr

    cases = a.cases.split(",")
    skipped = {}
    for prefix, module in (("zero3", "deepspeed"), ("trl", "trl")):  # tests/gpu/wheels.sh carries both
        if any(c.startswith(prefix) for c in cases):
            try:
                __import__(module)
            except Exception as exc:  # not installed, or broken
                skipped.update(
                    {
                        c: f"skipped: {module} does not import ({type(exc).__name__}: {exc})"
                        for c in cases
                        if c.startswith(prefix)
                    }
                )
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="raytrain-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if a.cpu else "cuda"
    print(
        f"[bench] {'tiny' if a.tiny else '1B'} Llama, seq_len {a.seq_len}, global batch {a.global_batch} x micro "
        f"{a.micro_batch}, {a.gpus} rank(s) on {'CPU' if a.cpu else torch.cuda.get_device_name(0)}, "
        f"{a.warmup} warm-up + {a.steps} measured steps; work folder {work}",
        flush=True,
    )
    try:
        model, data = make_assets(a, work, device)
        ours = next((c for c in cases if not c.startswith("trl-")), CASES[0])
        prepared = lr.prepare_data(job(a, ours, model, data, work))  # one store: the same data for every case
        (work / "bench.json").write_text(json.dumps({"model": str(model), "data": str(data), "prepared": prepared}))
        results = []
        for case in cases:
            if case in skipped:
                results.append({"case": case, "error": skipped[case]})
                print(f"[bench] {case}: {skipped[case]}", flush=True)
                continue
            out = work / f"result-{case}.json"
            out.unlink(missing_ok=True)
            command = [
                sys.executable,
                "-m",
                "benchmarks.gpu",
                "--child",
                case,
                "--workdir",
                str(work),
                "--out",
                str(out),
                *child_flags(a),
            ]
            print(f"[bench] {case} ...", flush=True)
            proc = subprocess.run(command, cwd=REPO)
            if proc.returncode != 0 or not out.exists():
                results.append({"case": case, "error": f"failed (exit {proc.returncode}; its output is above)"})
                continue
            r = json.loads(out.read_text())
            results.append(r)
            if "profile" in r:
                print(f"[bench] {case}: the busiest ops of two steps\n{r['profile']}", flush=True)
            print(
                f"[bench] {case} ({r['kernels']}): {r['tokens_per_s']:,.0f} tokens/s, MFU {fmt(r['mfu'], '.1%')}, "
                f"first step {r['first_step_s']:.1f} s, peak allocated {size(r['peak_allocated_gib'])} vs estimate "
                f"{size(r['estimate_gib'])}: {r['estimate']}",
                flush=True,
            )
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    print(
        "MFU: raytrain.telemetry flops_per_token (6N + attention; LoRA 4N_frozen + 6N_trainable) over the bf16 peak "
        "in telemetry.PEAK_BF16_FLOPS. estimate: raytrain.memory.estimate, what `raytrain validate` prints "
        "(its runtime term, ~1 GiB of CUDA context and NCCL, is not in max_memory_allocated). ÷ TRL: tokens/s over "
        "TRL SFTTrainer's with the same fine-tuning (benchmarks/gpu_trl.py: packed, padding-free, its tokens counted)."
    )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 1 if any("error" in r and not r["error"].startswith("skipped") for r in results) else 0


def child_flags(a: argparse.Namespace) -> list[str]:
    """The settings a case's process needs, as flags (the defaults already resolved)."""
    flags = [
        "--gpus",
        a.gpus,
        "--seq-len",
        a.seq_len,
        "--global-batch",
        a.global_batch,
        "--micro-batch",
        a.micro_batch,
        "--warmup",
        a.warmup,
        "--steps",
        a.steps,
        "--lora-rank",
        a.lora_rank,
        "--attention",
        a.attention,
        "--compile",
        a.compile,
    ]
    flags += [
        f"--{name.replace('_', '-')}"
        for name in ("cpu", "tiny", "activation_checkpointing", "detect_anomaly", "profile")
        if getattr(a, name)
    ]
    return [str(f) for f in flags]


if __name__ == "__main__":
    sys.exit(main())
