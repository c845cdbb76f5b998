"""P3's ingest arm: raytrain's Ray Data pipeline alone, consumed the way a worker consumes it.

    python -m benchmarks.ingest JOB.yaml --rows N --out OUT.json

Builds `raytrain.data.build_dataset(spec)` (read, tokenize, pack) on a local Ray cluster
sized as `raytrain run` sizes its own, and iterates it like `GlobalBatches` does (windows
of `data.shuffle_window` rows as torch.long tensors, 2 batches prefetched), with no model.
Writes the time to the first window, the steady rows/s after it, and rows/s overall
(start-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--rows", type=int, required=True, help="packed rows to read (stops early)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import ray
    import torch

    from raytrain import data
    from raytrain.config import JobSpec, load_yaml

    spec = JobSpec.model_validate(load_yaml(args.job))
    lo, hi = spec.scaling.worker_range
    started = time.perf_counter()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(hi * spec.scaling.cpus_per_worker)) + 2,
             include_dashboard=False, log_to_driver=False)
    ready = time.perf_counter()
    iterator = data.build_dataset(spec).iterator()
    rows, first = 0, None
    for window in iterator.iter_torch_batches(batch_size=spec.data.shuffle_window, dtypes=torch.long, prefetch_batches=2):
        rows += len(window["input_ids"])
        if first is None:
            first, first_rows = time.perf_counter(), rows
        if rows >= args.rows:
            break
    end = time.perf_counter()
    ray.shutdown()
    steady = (rows - first_rows) / (end - first) if end > first else float("nan")
    with open(args.out, "w") as f:
        json.dump({"cluster_start_s": ready - started, "first_window_s": first - ready, "rows": rows,
                   "steady_rows_per_s": steady, "overall_rows_per_s": rows / (end - ready),
                   "tokens_per_row": spec.data.seq_len}, f)


if __name__ == "__main__":
    main()
