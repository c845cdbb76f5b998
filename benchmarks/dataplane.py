"""S3 (issue #24): a rank's peak host memory for the data plane at 10x the rows and 10x the
steps / at 1x.                                                                 goal <= 1.2

    python -m benchmarks.dataplane                 (--before REV: the old order.py, default 7253d34)

The data plane is what every rank derives from the whole store and the whole run before it
reads a row: the global order, the held-out split, the blend's schedule and the evaluation
ids. Each size runs in a fresh child process that builds them as `batches.open_data` does
(three sources blended 5:3:2 holding 50/30/20% of the rows, data.eval.fraction 0.01,
data.eval.max_rows 2000, global batch 256, rank 0 of 8) and enumerates the global batch of
the job's last step; its figure is the child's peak resident memory (ru_maxrss) above the
same process after its imports. No Ray and no store: the order's objects alone.

after   raytrain.data.order as it is (keyed bijections, the blend solved per position, the
        evaluation set capped and read per micro-batch)
before  order.py at --before (a permutation of every store's rows, the blend's schedule laid
        out to max_steps x G, a tuple per held-out row), loaded from `git show`
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = [(1_000_000, 10_000), (10_000_000, 100_000)]  # (rows over all sources, max_steps): 1x, 10x
SHARES, WEIGHTS = (0.5, 0.3, 0.2), [5, 3, 2]
GLOBAL_BATCH, WORLD, RANK, FRACTION, MAX_ROWS, WINDOW, SEED = 256, 8, 0, 0.01, 2000, 1024, 0


def child(arm: str, rows: int, steps: int, before: str | None) -> dict:
    """Build the data plane in this process; its peak resident memory above the imports, in KiB."""
    import numpy as np

    if arm == "before":
        spec = importlib.util.spec_from_file_location("order_before", before)
        order = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
        spec.loader.exec_module(order)
    else:
        from raytrain.data import order
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    sizes = [int(rows * s) for s in SHARES]
    last = np.arange((steps - 1) * GLOBAL_BATCH, steps * GLOBAL_BATCH)
    if arm == "before":  # as open_data did
        splits = [order.held_out(r, FRACTION) for r in sizes]
        stream = order.Stream([train for train, _ in splits], WEIGHTS, SEED, True, WINDOW, horizon=steps * GLOBAL_BATCH)
        stream.at(last)
        ids = [(i, int(r)) for i, (_, held) in enumerate(splits) for r in held]
        start, stop = order.rank_slice(len(ids), WORLD, RANK)
        eval_rows = len(ids[start:stop])
    else:  # as open_data does; EvalBatches reads its micro-batches' ids from the EvalSet, one at a time
        splits = [order.HeldOut(r, FRACTION) for r in sizes]
        stream = order.Stream(splits, WEIGHTS, SEED, True, WINDOW)
        stream.at(last)
        evaluation = order.EvalSet(splits, MAX_ROWS)
        start, stop = order.rank_slice(evaluation.rows, WORLD, RANK)
        eval_rows = len(evaluation.at(np.arange(start, stop))[1])
    seconds = time.perf_counter() - started
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"arm": arm, "rows": rows, "steps": steps, "kib": grown, "seconds": seconds, "eval_rows": eval_rows}


def run(arm: str, rows: int, steps: int, before: str | None) -> dict:
    command = [sys.executable, "-m", "benchmarks.dataplane", "--child", arm, str(rows), str(steps)]
    proc = subprocess.run(
        command + (["--before-file", before] if before else []), cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {arm} arm at {rows:,} rows, {steps:,} steps failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dataplane", description=__doc__.split("\n")[0])
    p.add_argument(
        "--before",
        default="7253d348b55641d8d1aeb95fbe95a83b07c332bb",
        help="the git revision whose raytrain/data/order.py is the before arm",
    )
    p.add_argument("--child", nargs=3, metavar=("ARM", "ROWS", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--before-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        arm, rows, steps = args.child
        print(json.dumps(child(arm, int(rows), int(steps), args.before_file)))
        return

    source = subprocess.run(
        ["git", "show", f"{args.before}:raytrain/data/order.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    print(
        f"S3 data plane: {len(SHARES)} sources {':'.join(map(str, WEIGHTS))}, eval fraction {FRACTION}, "
        f"max_rows {MAX_ROWS}, G {GLOBAL_BATCH}, rank {RANK} of {WORLD}, the last step's batch; "
        f"command: python -m benchmarks.dataplane --before {args.before[:12]}"
    )
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp, "order_before.py")
        before.write_text(source)
        for arm in ("after", "before"):
            figures = [run(arm, rows, steps, str(before) if arm == "before" else None) for rows, steps in SIZES]
            for f in figures:
                print(
                    f"  {arm:6} rows {f['rows']:>11,} steps {f['steps']:>8,}: peak +{f['kib'] / 1024:8.1f} MiB "
                    f"in {f['seconds']:6.2f} s ({f['eval_rows']} evaluation rows on this rank)"
                )
            ratios[arm] = (figures[1]["kib"] / max(figures[0]["kib"], 1), figures[0]["kib"], figures[1]["kib"])
    a, b = ratios["after"], ratios["before"]
    print(
        f"S3 peak host memory of the data plane, 10x rows and steps / 1x: after {_ratio(a)}, before {_ratio(b)}; "
        "goal <= 1.2"
    )


def _ratio(figure: tuple[float, int, int]) -> str:
    ratio, one, ten = figure
    return f"{ratio:.2f} ({one / 1024:.1f} -> {ten / 1024:.1f} MiB)"


if __name__ == "__main__":
    main()
