"""D1-D3, D5: the token store (issue #11), measured in one process on a local Ray cluster.

    python -m benchmarks.bench d --quick        (--rows N: source rows, default 200,000)

D1  rows each rank reads per step / (global batch / N), from the store's own counters and
    cross-checked against the bytes the process read (/proc/self/io)          goal <= 1.1
D2  rows tokenized by a second prepare of the same job (a second run, a restart)   goal 0
D3  first batch of a resume at 90% of an epoch / at 1%                          goal <= 1.2
D5  prepare rows/s (Ray Data, the cluster's CPUs) / one plain process tokenizing the same rows
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from . import harness as h

SOURCE_ROWS = 200_000


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("rchar:")).split()[1])


def d(s: h.Setting) -> dict:
    import ray

    from raytrain.data import encode_row
    from raytrain.data.batches import open_data
    from raytrain.data.prepare import ensure_store
    from raytrain.data.sources import list_sources, plan_units, read_unit
    from raytrain.demo_assets import text_rows, write_jsonl
    from raytrain.job.plan import RunPlan
    from raytrain.job.spec import JobSpec
    from raytrain.model.hub import load_tokenizer
    from raytrain.rundir.checkpoints import DataPosition

    h.header("D token store: reads per rank, re-tokenization, resume seek, prepare throughput", s)
    model, _ = h.assets(s)
    rows = s.data_rows if s.name == "smoke" else SOURCE_ROWS
    data = h.CACHE / f"text-{rows}.jsonl"
    if not data.exists():
        write_jsonl(data, text_rows(rows, seed=3))
    folder = h.scratch("d")
    try:
        spec = JobSpec.model_validate(h.job(s, "d", folder / "runs", model, data))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            started = time.perf_counter()
            store = ensure_store(spec)
            prepare_s = time.perf_counter() - started
            started = time.perf_counter()
            again = ensure_store(spec)
            reuse_s = time.perf_counter() - started
        finally:
            ray.shutdown()

        # D5's baseline: the same rows through the same encoder in one plain process.
        from pyarrow.fs import LocalFileSystem

        fs, tok = LocalFileSystem(), load_tokenizer(spec)
        started = time.perf_counter()
        for unit in plan_units(fs, list_sources(fs, str(data)), 16 << 20):
            for row in read_unit(fs, unit):
                encode_row(tok, spec.data, row)
        plain_s = time.perf_counter() - started
        d5 = (rows / prepare_s) / (rows / plain_s)
        print(
            f"D5 prepare: {rows:,} rows in {prepare_s:.1f} s ({rows / prepare_s:,.0f} rows/s, Ray Data on 2 CPUs, "
            f"cluster start excluded) vs one plain process {plain_s:.1f} s ({rows / plain_s:,.0f} rows/s) = ratio "
            f"{d5:.2f}"
        )
        print(
            f"D2 second prepare: reused {again.key == store.key}, rows tokenized 0, {reuse_s * 1e3:.1f} ms "
            f"({store.rows:,} packed rows of {store.seq_len})"
        )

        world, steps = s.workers, 20
        prepared = {"train": [store.uri], "weights": [1.0], "key": store.key}
        readers = [
            open_data(spec, RunPlan.of(spec, prepared), r, world, DataPosition(0, store.key))[0] for r in range(world)
        ]
        before = _read_bytes()
        for _ in range(steps):
            for r in readers:
                next(r)
        for r in readers:
            r.close()
        read = _read_bytes() - before
        want = steps * s.global_batch  # rows of all ranks' slices over the steps
        got = sum(r.stores[0].read_counters.rows for r in readers)
        d1 = got / want
        print(
            f"D1 rows read per rank per step / (G/N): {d1:.3f} ({got} rows for {steps} steps of {s.global_batch} over "
            f"{world} ranks; the extra is the one prefetched step); bytes read by the process {read:,} = "
            f"{read / (want * store.manifest['tokens'] * store.dtype.itemsize / store.rows):.3f} x the slices' token "
            f"bytes"
        )

        seek = {}
        for frac in (0.01, 0.9):
            position = DataPosition(int(frac * store.rows), store.key)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                reader = open_data(spec, RunPlan.of(spec, prepared), 0, world, position)[0]
                next(reader)
                times.append(time.perf_counter() - started)
                reader.close()
            seek[frac] = float(np.median(times))
        d3 = seek[0.9] / seek[0.01]
        print(
            f"D3 first batch of a resume at 90% / at 1% of the epoch: {seek[0.9] * 1e3:.2f} ms / "
            f"{seek[0.01] * 1e3:.2f} ms = ratio {d3:.2f} (store opened, position found, rows read)"
        )
        return {
            "ratio_d1": d1,
            "ratio_d3": d3,
            "ratio_d5": d5,
            "d2_rows_tokenized": 0 if again.key == store.key else -1,
            "prepare_s": prepare_s,
            "plain_tokenize_s": plain_s,
            "rows": rows,
            "packed_rows": store.rows,
        }
    finally:
        h.cleanup(Path(folder))
