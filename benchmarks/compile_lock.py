"""C1: what a node's CPU ranks pay to compile, with inductor's compiles one at a time on the node
(`private_apis.one_inductor_compile_at_a_time`, what `training.compile` does on CPU workers) and without (each
rank lowers the same graphs and builds the same C++ kernels). One compiled case of test_combinations' covering set
(4 gloo ranks, the product's strategy and step, 2 steps and a resumed third, beside its reference case), each arm
from an empty inductor cache; arms alternate. Printed: wall seconds, and the machine's busy CPU-seconds over the
arm (/proc/stat), which is what the test suite's other lane gets back on 2 cores.

    PYTHONPATH=.:tests .venv/bin/python -m benchmarks.compile_lock [--reps 1]

Run it alone on the machine: the machine's total counts every process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.job_cpu import busy_s

ARM_ENV = "BENCH_COMPILE_ARM"  # "each": every rank compiles itself (the lock's function replaced in each rank)


def _case(root: str) -> None:
    """One arm, in a process of its own (its ranks are spawned from it)."""
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "gpu")]
    import combinations as C
    import families
    import local_run
    import torch
    from test_combinations import reward_model

    from raytrain.demo_assets import make_all

    tmp = Path(root)
    assets = make_all(tmp / "assets") if not (tmp / "assets").exists() else tmp / "assets"
    models = {f: str(families.build(f, assets, tmp / f.replace(" ", "-"))) for f in families.FAMILIES}
    models.update(text=str(assets / "text.jsonl"), pairs=str(assets / "pairs.jsonl"))
    models.update({"prompts": str(assets / "prompts.jsonl"), "reward model": str(reward_model(assets, tmp / "rm"))})
    configs = {name: json.loads(Path(models[name], "config.json").read_text()) for name in families.FAMILIES}

    def refused(case):
        return C.refusal(case, models, configs)

    cases, _ = C.covering(C.options(), refused)
    case = next(c for c in C.with_varlen(C.with_families(cases, refused)) if c["compile"])
    runs = [C.key(case)]
    local_run.spawn(C.run_cases, C.WORLD, torch.device("cpu"), runs, models, str(tmp / f"runs-{time.time()}"), runs)


if os.environ.get(ARM_ENV) == "each":  # in the arm's process and in each rank it spawns (they import this module)
    from raytrain import private_apis

    private_apis.one_inductor_compile_at_a_time = lambda: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--case-root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case_root:
        _case(args.case_root)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    got = {"one at a time": [], "each": []}
    try:
        for rep in range(args.reps):
            for arm in ("each", "one at a time") if rep % 2 else ("one at a time", "each"):
                cache = root / "inductor"
                shutil.rmtree(cache, ignore_errors=True)
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), ARM_ENV: arm}
                t, b = time.time(), busy_s()
                cmd = [sys.executable, "-m", "benchmarks.compile_lock", "--case-root", str(root)]
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                got[arm].append((time.time() - t, busy_s() - b))
                print(f"[compile-lock] {arm}: wall {got[arm][-1][0]:.1f} s, machine busy {got[arm][-1][1]:.0f} CPU-s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (one_w, one_c), (each_w, each_c) = (sorted(got[a])[len(got[a]) // 2] for a in ("one at a time", "each"))
    print(
        f"C1 one compiled case on 4 CPU ranks, cold inductor cache: one compile at a time / each rank compiling: "
        f"wall {one_w:.1f} / {each_w:.1f} s = {one_w / each_w:.3f}, CPU-s {one_c:.0f} / {each_c:.0f} = "
        f"{one_c / each_c:.3f} (n={args.reps}, load average {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    main()
