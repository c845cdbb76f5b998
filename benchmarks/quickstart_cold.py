"""The quickstart's `step_1`, cold (#61's goal: 15 s): `raytrain quickstart` as README command 1 runs it, each time
on a local cluster of its own, with no fork server alive and a new storage path (so a new MLflow store and a new
token store), its start-up line read. Given a second checkout (`--against DIR`, for example a `git clone` of an
earlier commit), the two codes take turns (A B, B A, ...) and the ratio of their medians is printed, so that drift
on the machine falls on both.

    PYTHONPATH=. .venv/bin/python -m benchmarks.quickstart_cold [--reps 6] [--against /tmp/basecode] [--cpu]

`--cpu` adds one more cold quickstart of this checkout, with each process's CPU-seconds (job_cpu.measured's
sampler) by program: the driver, the fork servers, Ray's own processes, the launchers Ray starts for each worker.
Run it alone on the machine: a cold start is CPU-bound on 2 cores. The demo assets are made once, untimed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import harness as h

REPO = Path(__file__).resolve().parents[1]


def one(code: Path, folder: Path, storage: Path) -> dict[str, float]:
    """One cold quickstart with the package of `code`; its start-up line's phases (seconds after `raytrain run`)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run(
        [sys.executable, "-m", "raytrain", "quickstart", "--set", "training.max_steps=3"]
        + ["--set", f"checkpoint.storage_path={storage}"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return h.startup_phases(out.splitlines())


def cpu(folder: Path) -> None:
    from .job_cpu import measured

    got: dict = {}
    wall, busy, kinds, count = measured(lambda: got.update(one(REPO, folder, folder / "runs-cpu")))
    print(
        f"[quickstart-cold] CPU-seconds of one more run (step_1 {got['step_1']} s): wall {wall:.1f} s, machine busy "
        f"{busy:.1f} CPU-s, per process {sum(kinds.values()):.1f}:"
    )
    for kind, used in kinds.most_common():
        if used >= 0.1:
            print(f"[quickstart-cold]   {used:6.2f}  {kind} ({count[kind]} process(es))")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--against", type=Path, help="a second checkout, timed in turns with this one")
    p.add_argument("--cpu", action="store_true", help="then one more run, with each process's CPU-seconds")
    a = p.parse_args()
    arms = {"this": REPO, **({"against": a.against.resolve()} if a.against else {})}
    with tempfile.TemporaryDirectory(prefix="raytrain-quickstart-cold-") as tmp:
        folder = Path(tmp)
        subprocess.run([sys.executable, "-m", "raytrain.demo_assets", ".raytrain/quickstart"], cwd=folder, check=True)
        seen: dict[str, list[dict]] = {arm: [] for arm in arms}
        for i, arm in enumerate(h.alternate(a.reps, list(arms))):
            phases = one(arms[arm], folder, folder / f"runs-{i}")
            seen[arm].append(phases)
            print(f"[quickstart-cold] {arm} ({arms[arm]}): " + " -> ".join(f"{k} {v}" for k, v in phases.items()))
        if a.cpu:
            cpu(folder)
    for arm, runs in seen.items():
        names = list(runs[0])
        print(
            f"[quickstart-cold] {arm}: medians of {len(runs)}: "
            + ", ".join(f"{k} {h.median([r[k] for r in runs]):.1f}" for k in names)
            + f"; step_1 {sorted(r['step_1'] for r in runs)}"
        )
    if a.against:
        h.ratio_line(
            "quickstart step_1 cold",
            "this",
            [r["step_1"] for r in seen["this"]],
            "against",
            [r["step_1"] for r in seen["against"]],
            fmt=".3f",
        )


if __name__ == "__main__":
    main()
