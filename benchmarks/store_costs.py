"""S1, S2 (issue #24): what a reused store costs the driver, and what a token costs on disk.

    python -m benchmarks.store_costs [--base-rows 20000] [--scale 20] [--seq-len 1024]
    python -m benchmarks.store_costs --open-only [--open-shards 1000] [--open-scale 10]

S1  the driver's store phase on a reused store (`prepare.ensure_inputs`: everything between
    `raytrain run` connecting to Ray and the workers being told where the data is) for a store
    of `scale` x the rows / the same for the base size                     goal <= 1.2
S2  bytes on disk (every file of the store but its manifest) / the tokens it holds, for text
    (packed) and a preference store (TRL's shape, padded pairs)            goal <= 4 and <= 5
Open  bytes a rank reads at `TokenStore.open` (what the kernel counted: /proc/self/io's rchar)
    for `open-scale` x the shards / for `open-shards` shards, side by side in one run; and
    what its first row then reads (the shard table's directory and one block, the shard's
    index, the row). Tiny synthetic shards written as a prepare writes them: no Ray, no
    tokenizer, a few seconds (`--open-only` runs this alone)              goal <= 1.2

Run it from any checkout (the numbers are about the code it imports): `git worktree add
/tmp/before <rev>` and `cd /tmp/before && /path/to/.venv/bin/python -m benchmarks.store_costs`
gives the before figures with the same data and sizes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from . import harness as h


def _store_bytes(store) -> int:
    return sum(p.stat().st_size for p in Path(store.path).iterdir() if p.name != "manifest.json")


def _process_reads() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _reads_of(fn) -> tuple[int, object]:
    """(bytes this process read during fn(), less what reading the counter itself costs), fn()'s value."""
    noise = min(-_process_reads() + _process_reads() for _ in range(3))
    before = _process_reads()
    value = fn()
    return _process_reads() - before - noise, value


def _synthetic_store(folder: Path, shards: int, rows_per_shard: int = 4) -> str:
    """A store of `shards` shards of short padded rows, written by the store's own writers."""
    import numpy as np
    import pyarrow.fs as pafs

    from raytrain.data.store import token_dtype
    from raytrain.data.store_writer import shard_rows, write_manifest, write_shard

    fs, dtype, key, rng = pafs.LocalFileSystem(), token_dtype(300), "o" * 20, np.random.default_rng(0)
    store_dir = folder / key
    store_dir.mkdir(parents=True)
    entries, first = [], 0
    for i in range(shards):
        docs = [(t, t) for t in (rng.integers(0, 300, 12).tolist() for _ in range(rows_per_shard))]
        part = shard_rows(docs, 16, False, False)
        entries.append({**write_shard(fs, str(store_dir), f"part-{i:06d}", part, dtype), "first_row": first})
        first += len(part)
    write_manifest(
        fs,
        str(store_dir),
        {
            "key": key,
            "rows": first,
            "seq_len": 16,
            "pad_id": 0,
            "bad_rows": 0,
            "bad_examples": [],
            "shards": entries,
            "docs": first,
            "tokens": 12 * first,
            "sources": [{"path": "/data/rows.jsonl", "size": 1 << 40, "mtime_ns": 0}],
            "sequences_per_row": 1,
            "token_dtype": dtype.name,
        },
    )
    return str(store_dir)


def open_costs(base_shards: int, scale: int) -> dict:
    import numpy as np

    from raytrain.data.store import TokenStore

    folder = Path(tempfile.mkdtemp(prefix="raytrain-store-open-"))
    try:
        measured = {}
        for shards in (base_shards, base_shards * scale):
            started = time.perf_counter()
            uri = _synthetic_store(folder / str(shards), shards)
            write_s = time.perf_counter() - started
            opened, store = _reads_of(lambda: TokenStore.open(uri))
            first_row, _ = _reads_of(lambda: store.read(np.array([store.rows // 2])))
            measured[shards] = {
                "open": opened,
                "first_row": first_row,
                "write_s": write_s,
                "table": getattr(store.read_counters, "table_bytes", 0),
                "manifest": Path(uri, "manifest.json").stat().st_size,
            }
        (small, a), (big, b) = measured.items()
        ratio = b["open"] / a["open"]
        print(
            f"Open bytes a rank reads at store open: {big:,} shards {b['open']:,} B / {small:,} shards {a['open']:,} B "
            f"= ratio {ratio:.2f} (goal <= 1.2; the manifests are {b['manifest']:,} / {a['manifest']:,} B)"
        )
        print(
            f"     then its first row: {b['first_row']:,} B / {a['first_row']:,} B (of it the shard table's: "
            f"{b['table']:,} / {a['table']:,} B; stores written in {b['write_s']:.1f} / {a['write_s']:.1f} s)"
        )
        return {"ratio_open": ratio, **{f"{k}_{n}": v for n, m in measured.items() for k, v in m.items()}}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-rows", type=int, default=20_000)
    parser.add_argument("--scale", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--open-shards", type=int, default=1000)
    parser.add_argument("--open-scale", type=int, default=10)
    parser.add_argument("--open-only", action="store_true", help="only the bytes read at store open (no Ray)")
    args = parser.parse_args()
    open_costs(args.open_shards, args.open_scale)
    if args.open_only:
        return

    import ray

    from raytrain.data.prepare import ensure_inputs, ensure_store
    from raytrain.demo_assets import preference_rows, text_rows, write_jsonl
    from raytrain.job.spec import JobSpec

    s = h.SETTINGS["quick"]
    model, _ = h.assets(s)
    folder = Path(tempfile.mkdtemp(prefix="raytrain-store-costs-"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        def spec(name: str, source: Path, **over) -> JobSpec:
            raw = h.job(s, name, folder / "runs", model, source)
            raw["data"] = {**raw["data"], "seq_len": args.seq_len, **over.pop("data", {})}
            for section, values in over.items():
                raw[section] = {**raw.get(section, {}), **values}
            return JobSpec.model_validate(raw)

        reuse = {}
        for rows in (args.base_rows, args.base_rows * args.scale):
            data = h.CACHE / f"text-{rows}.jsonl"
            if not data.exists():
                write_jsonl(data, text_rows(rows, seed=3))
            job = spec(f"s1-{rows}", data)
            started = time.perf_counter()
            store = ensure_store(job)
            prepare_s = time.perf_counter() - started
            times = []
            for _ in range(5):
                started = time.perf_counter()
                ensure_inputs(job)
                times.append(time.perf_counter() - started)
            reuse[rows] = (statistics.median(times), store, prepare_s)
        (small_s, small, _), (big_s, big, big_prepare_s) = reuse.values()
        print(
            f"S1 reused store, driver's store phase: {big.rows:,} rows ({_store_bytes(big) / 2**20:.1f} MiB) "
            f"{big_s * 1e3:.1f} ms / {small.rows:,} rows ({_store_bytes(small) / 2**20:.1f} MiB) "
            f"{small_s * 1e3:.1f} ms = ratio {big_s / small_s:.2f} (median of 5; the big store took "
            f"{big_prepare_s:.1f} s to prepare)"
        )
        text_bytes = _store_bytes(big) / big.manifest["tokens"]
        print(
            f"S2 text store (packed, seq_len {args.seq_len}): {_store_bytes(big):,} bytes / "
            f"{big.manifest['tokens']:,} tokens = {text_bytes:.2f} bytes a token"
        )

        pairs = h.CACHE / "preference-4000.jsonl"
        if not pairs.exists():
            write_jsonl(pairs, preference_rows(4000, seed=3))
        dpo = ensure_store(spec("s2-dpo", pairs, data={"format": "text", "pack": False}, training={"objective": "dpo"}))
        print(
            f"S2 preference store (padded pairs, seq_len {args.seq_len}): {_store_bytes(dpo):,} bytes / "
            f"{dpo.manifest['tokens']:,} real tokens = {_store_bytes(dpo) / dpo.manifest['tokens']:.2f} bytes a token"
        )
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
