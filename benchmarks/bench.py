"""One command per benchmark:

    python -m benchmarks.bench p1 --quick        # P1 on this 2-core CPU machine
    python -m benchmarks.bench all --quick       # P1..P8 one after the other
    python -m benchmarks.bench p1 --gpu --model /models/llama-3.1-8b --data /data/train.jsonl --workers 8

Settings: --quick (a ~3M-parameter Llama on 2 gloo ranks), --smoke (the smallest, for CI),
--gpu (8 GPUs, NCCL, bf16 compute; size flags below). Each benchmark alternates its arms
(A B, B A, ...) for --reps repetitions and prints the medians, the ratio and the command.
A summary line per benchmark ends the output; --json writes the figures too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import compare, datastore, lifecycle, memory, prepare_speed
from . import harness as h

BENCHMARKS = {
    "p1": compare.p1,
    "p2": compare.p2,
    "p3": lifecycle.p3,
    "p4": lifecycle.p4,
    "p5": lifecycle.p5,
    "p6": lifecycle.p6,
    "p7": compare.p7,
    "p8": compare.p8,
    "p9": compare.p9,
    "p10": compare.p10,
    "p11": compare.p11,
    "d": datastore.d,
    "s5": prepare_speed.s5,
    "m": memory.m,
    "m5": memory.m1u_m5,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    p.add_argument("which", nargs="+", choices=[*BENCHMARKS, "all"])
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_const", dest="setting", const="quick", help="this 2-core CPU box (default)"
    )
    size.add_argument("--smoke", action="store_const", dest="setting", const="smoke", help="smallest: the CI smoke run")
    size.add_argument("--gpu", action="store_const", dest="setting", const="gpu", help="GPUs, NCCL, bf16")
    p.add_argument("--model", help="a Hugging Face model folder (default: a generated Llama of --hidden/--layers)")
    p.add_argument("--data", help="a jsonl with a `text` column (default: generated toy text)")
    for flag in ("hidden", "layers", "seq-len", "global-batch", "micro-batch", "steps", "warmup", "reps", "workers"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--json", help="also write the figures to this file")
    p.set_defaults(setting="quick")
    return p.parse_args(argv)


def setting(args: argparse.Namespace) -> h.Setting:
    s = h.SETTINGS[args.setting]
    return h.with_overrides(
        s,
        model_path=args.model,
        data_path=args.data,
        hidden=args.hidden,
        layers=args.layers,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
        reps=args.reps,
        workers=args.workers,
    )


def summary(name: str, result: dict) -> str:
    keys = [k for k in result if k.startswith("ratio") or k in ("share", "not_measured")]
    return f"SUMMARY {name}: " + ", ".join(
        f"{k} {result[k]:.3f}" if isinstance(result[k], float) else f"{k} {result[k]}" for k in keys
    )


def reason(exc: Exception) -> str:
    """One line for the summary: the last line of the failure that names an error."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else lines[0])[:300]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    s = setting(args)
    which = list(BENCHMARKS) if "all" in args.which else args.which
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    results, lines = {}, []
    for name in which:
        started = time.time()
        try:
            results[name] = BENCHMARKS[name](s)
        except Exception as exc:  # one benchmark failing must not hide the others' figures
            results[name] = {"not_measured": reason(exc)}
            print(f"{name.upper()}: failed: {str(exc)[-3000:]}", file=sys.stderr, flush=True)
        load = os.getloadavg()
        results[name]["load_average_end"] = load
        lines.append(
            summary(name, results[name]) + f" ({time.time() - started:.0f} s; load average at the end "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f})"
        )
        print(flush=True)
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"setting": s.__dict__, "command": sys.argv, "load_average": os.getloadavg(), "results": results},
                f,
                indent=2,
                default=str,
            )
    return 0 if all("not_measured" not in r or name == "p8" for name, r in results.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
