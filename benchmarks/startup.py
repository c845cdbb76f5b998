"""Where a job's start goes (#61): the quickstart's job, cold, on a local cluster this process starts, as
`raytrain run` starts one; printed as raytrain's own start-up line (the driver's and rank 0's phases),
then every actor the job started with the second it came up (Ray's GCS actor table), and the import
time of what a worker imports before its first step (in a fresh interpreter, alone on the machine).

    PYTHONPATH=. .venv/bin/python -m benchmarks.startup [--reps 2]

The figures are seconds after `raytrain run`'s start (the line) or after Ray was up (the actors)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_job(folder: Path) -> None:
    import ray

    from raytrain import private_apis
    from raytrain.cli import main
    from raytrain.demo_assets import make_all

    assets = make_all(REPO / ".raytrain" / "quickstart")
    began = time.time()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    up = time.time()
    code = main(
        ["run", str(REPO / "jobs" / "quickstart.yaml"), "--set", f"model.path={assets / 'model'}"]
        + ["--set", f"data.path={assets / 'text.jsonl'}", "--set", f"checkpoint.storage_path={folder}"]
        + ["--set", "training.max_steps=3", "--set", "checkpoint.every_n_steps=3"]
    )
    print(f"[startup] ray.init {up - began:.2f} s; the job {time.time() - up:.2f} s (exit {code})", flush=True)
    for start, name in sorted((s - up, n) for n, s in private_apis.actor_start_times().items()):
        print(f"[startup]   {start:6.2f} s  {name}", flush=True)
    ray.shutdown()


def imports() -> None:
    from raytrain.train.worker_launch import STEP_IMPORTS

    code = "import time, importlib\n" + "".join(
        f"t = time.time(); importlib.import_module({m!r}); print({m!r}, round(time.time() - t, 2))\n"
        for m in STEP_IMPORTS
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    print("[startup] a worker's imports, one after the other (s): " + "; ".join(out.split("\n")[:-1]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()
    import tempfile

    imports()
    for _ in range(a.reps):
        with tempfile.TemporaryDirectory(prefix="raytrain-startup-") as tmp:
            subprocess.run([sys.executable, "-m", "benchmarks.startup", "--one", tmp], cwd=REPO, check=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one_job(Path(sys.argv[2]))
    else:
        main()
