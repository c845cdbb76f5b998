"""S1, S2 (issue #24): what a reused store costs the driver, and what a token costs on disk.

    python -m benchmarks.store_costs [--base-rows 20000] [--scale 20] [--seq-len 1024]

S1  the driver's store phase on a reused store (`prepare.ensure_inputs`: everything between
    `raytrain run` connecting to Ray and the workers being told where the data is) for a store
    of `scale` x the rows / the same for the base size                     goal <= 1.2
S2  bytes on disk (every file of the store but its manifest) / the tokens it holds, for text
    (packed) and a preference store (TRL's shape, padded pairs)            goal <= 4 and <= 5

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-rows", type=int, default=20_000)
    parser.add_argument("--scale", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()

    import ray

    from raytrain.config import JobSpec
    from raytrain.data.prepare import ensure_inputs, ensure_store
    from raytrain.demo_assets import preference_rows, text_rows, write_jsonl

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
        print(f"S1 reused store, driver's store phase: {big.rows:,} rows ({_store_bytes(big) / 2**20:.1f} MiB) "
              f"{big_s * 1e3:.1f} ms / {small.rows:,} rows ({_store_bytes(small) / 2**20:.1f} MiB) "
              f"{small_s * 1e3:.1f} ms = ratio {big_s / small_s:.2f} (median of 5; the big store took "
              f"{big_prepare_s:.1f} s to prepare)")
        text_bytes = _store_bytes(big) / big.manifest["tokens"]
        print(f"S2 text store (packed, seq_len {args.seq_len}): {_store_bytes(big):,} bytes / "
              f"{big.manifest['tokens']:,} tokens = {text_bytes:.2f} bytes a token")

        pairs = h.CACHE / "preference-4000.jsonl"
        if not pairs.exists():
            write_jsonl(pairs, preference_rows(4000, seed=3))
        dpo = ensure_store(spec("s2-dpo", pairs, data={"format": "text", "pack": False},
                                training={"objective": "dpo"}))
        print(f"S2 preference store (padded pairs, seq_len {args.seq_len}): {_store_bytes(dpo):,} bytes / "
              f"{dpo.manifest['tokens']:,} real tokens = {_store_bytes(dpo) / dpo.manifest['tokens']:.2f} bytes a token")
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
