"""S5, D5 and the quickstart's prepare time (issue #24): how close prepare comes to the tokenizer's own speed.

    python -m benchmarks.bench s5 --quick          (or: python -m benchmarks.prepare_speed [--rows N])

S5  prepare tokens/s per CPU (Ray Data on a local cluster of 2 CPUs, cluster start excluded)
    / the same tokenizer's batch encoding per CPU, one plain process on one thread, the same
    texts (the fastest of the fast tokenizer's __call__ on 1,024 texts, with and without the
    attention mask, and its backend's encode_batch; the texts decoded beforehand)  goal >= 0.7
D5  prepare tokens/s, Ray Data on 2 CPUs / the same per-unit prepare (`prepare_unit` on every
    unit) in one plain process on one thread                                        goal >= 1
Q   the quickstart's data (jobs/quickstart.yaml on the demo's 4,000 rows): `ensure_inputs` in a
    fresh process with Ray up (and what `raytrain run` has imported), from the call to the
    store's manifest; then the same again in that process                        goal <= 3 s
Only APIs the code had before issue #24 are used, so the same file measures an older checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import harness as h

SOURCE_ROWS = 200_000
CPUS = 2
QUICKSTART = """
import json, sys, time, yaml, ray
import raytrain.driver.launcher  # what the driver of `raytrain run` has imported when it prepares
from raytrain.job.spec import JobSpec
from raytrain.data.prepare import ensure_inputs
raw = yaml.safe_load(open(sys.argv[1]))
raw["model"]["path"], raw["data"]["path"] = sys.argv[2] + "/model", sys.argv[2] + "/text.jsonl"
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
took = []
for storage in ("cold", "warm"):  # the second into another storage path: prepared again, nothing left to import or load
    raw["checkpoint"]["storage_path"] = sys.argv[3] + "/" + storage
    started = time.perf_counter()
    ensure_inputs(JobSpec.model_validate(raw))
    took.append(time.perf_counter() - started)
print(json.dumps({"prepare_s": took[0], "warm_s": took[1]}))
"""


@contextlib.contextmanager
def one_thread():
    """The tokenizers library's own threads off (it reads the variable at each call)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM")
        if before is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def plain_and_batch(spec, data: Path, out: Path, tok) -> tuple[float, int, dict, float]:
    """One plain process on one thread: `prepare_unit` on every unit of `data` (seconds, the
    tokens the tokenizer made), the same texts through the tokenizer's batch encodings (tokens/s
    of each, the better of two passes), and the rows' encoding alone, no shard written (seconds)."""
    from pyarrow.fs import LocalFileSystem

    from raytrain.data import records
    from raytrain.data.prepare import UNIT_BYTES, prepare_unit
    from raytrain.data.sources import list_sources, plan_units, read_unit

    fs = LocalFileSystem()
    units = plan_units(fs, list_sources(fs, str(data)), UNIT_BYTES)
    out.mkdir()
    kwargs = {
        "fs": fs,
        "out_fs": fs,
        "out_path": str(out),
        "spec": spec.model_dump(mode="json"),
        "data": spec.data.model_dump(mode="json"),
    }
    with one_thread():
        started = time.perf_counter()
        results = [
            json.loads(prepare_unit({"index": i, "unit": u.to_json()}, **kwargs)["result"]) for i, u in enumerate(units)
        ]
        plain_s = time.perf_counter() - started
        rows = [row for u in units for row in read_unit(fs, u)]
        started = time.perf_counter()
        if hasattr(records, "encode_rows"):  # 256 rows a call, as prepare_unit
            [records.encode_rows(tok, spec.data, rows[i : i + 256]) for i in range(0, len(rows), 256)]
        else:  # before batching: a row at a time
            [records.encode_row(tok, spec.data, row) for row in rows]
        encode_s = time.perf_counter() - started
        texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
        baseline = {}
        for name, encode in (
            ("__call__", lambda b: tok(b)["input_ids"]),
            (
                "__call__ ids only",
                lambda b: tok(b, return_attention_mask=False, return_token_type_ids=False)["input_ids"],
            ),
            ("backend encode_batch", lambda b: [e.ids for e in tok.backend_tokenizer.encode_batch(b)]),
        ):
            for _ in range(2):
                started, n = time.perf_counter(), 0
                for i in range(0, len(texts), 1024):
                    n += sum(map(len, encode(texts[i : i + 1024])))
                baseline[name] = max(baseline.get(name, 0), n / (time.perf_counter() - started))
    return plain_s, sum(r["tokens"] - r["docs"] for r in results), baseline, encode_s


def s5(s: h.Setting) -> dict:
    import ray

    from raytrain.data import prepare
    from raytrain.data.prepare import ensure_store
    from raytrain.demo_assets import make_all, text_rows, write_jsonl
    from raytrain.job.spec import JobSpec
    from raytrain.model.hub import load_tokenizer

    h.header("S5 prepare speed: tokens/s per CPU vs the tokenizer's batch encoding; D5; the quickstart's prepare", s)
    rows = s.data_rows if s.name == "smoke" else int(os.environ.get("BENCH_PREPARE_ROWS", SOURCE_ROWS))
    model, _ = h.assets(s)
    data = h.CACHE / f"text-{rows}.jsonl"
    if not data.exists():
        write_jsonl(data, text_rows(rows, seed=3))
    folder = h.scratch("s5")
    try:
        # Q first, in a fresh process holding only what the driver of `raytrain run` has imported by then.
        demo = make_all(h.CACHE / "quickstart-4000")
        job = h.REPO / "jobs" / "quickstart.yaml"
        proc = subprocess.run(
            [sys.executable, "-c", QUICKSTART, str(job), str(demo), str(folder / "quickstart")],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=h.REPO,
            env={**os.environ, "PYTHONPATH": str(h.REPO)},
        )
        if proc.returncode:
            raise RuntimeError(f"the quickstart's prepare failed: {proc.stderr[-2000:]}")
        quickstart = json.loads(proc.stdout.strip().splitlines()[-1])
        quickstart_s = quickstart["prepare_s"]
        print(
            f"Q the quickstart's prepare (4,000 rows, Ray up, a fresh driver): {quickstart_s:.2f} s (goal <= 3 s); "
            f"the same "
            f"again in that process {quickstart['warm_s']:.2f} s (the first paid the one-time start: Ray Data's "
            f"workers, "
            "importing transformers, loading the tokenizer)",
            flush=True,
        )

        ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
        try:
            took = []
            for arm in (
                "ray",
                "ray-warm",
            ):  # again into another folder: Ray Data's workers started, the tokenizer loaded
                spec = JobSpec.model_validate(h.job(s, "s5", folder / arm, model, data))
                started = time.perf_counter()
                store = ensure_store(spec)
                took.append(time.perf_counter() - started)
            ray_s, warm_s = took
        finally:
            ray.shutdown()
        tokens = int(store.manifest["tokens"]) - int(
            store.manifest["docs"]
        )  # the tokenizer's: not the eos each text gets

        tok = load_tokenizer(spec)
        plain_s, plain_tokens, baseline, encode_s = plain_and_batch(spec, data, folder / "plain", tok)
        assert plain_tokens == tokens, "the plain arm made other tokens than the store"
        # The same on documents 20 times longer (about 400 tokens): what a row costs beside its tokens matters less.
        docs = h.CACHE / f"docs-{rows // 20}.jsonl"
        if not docs.exists():
            texts = [r["text"] for r in text_rows(rows, seed=3)]
            write_jsonl(docs, [{"text": " ".join(texts[i : i + 20])} for i in range(0, len(texts), 20)])
        long_s, long_tokens, long_baseline, long_encode_s = plain_and_batch(
            spec.model_copy(update={"data": spec.data.model_copy(update={"path": str(docs)})}),
            docs,
            folder / "docs",
            tok,
        )
        best = max(baseline.values())
        # Since #24 a dataset under prepare.LOCAL_BYTES is prepared in the driver: then this is not Ray Data.
        where = (
            f"Ray Data on {CPUS} CPUs" if data.stat().st_size >= getattr(prepare, "LOCAL_BYTES", 0) else "the driver"
        )
        ray_rate, plain_rate = tokens / ray_s, tokens / plain_s
        s5_ratio, d5 = ray_rate / CPUS / best, ray_rate / plain_rate
        print(
            f"    {rows:,} rows, {tokens:,} tokens from the tokenizer ({tokens / rows:.1f} a row), {store.shards} units"
        )
        print("    batch encoding, one thread: " + ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in baseline.items()))
        print(
            f"S5 prepare per CPU / batch encoding per CPU: {where} {ray_s:.1f} s = {ray_rate / CPUS:,.0f} "
            f"tokens/s a CPU / {best:,.0f} = ratio {s5_ratio:.2f} (goal >= 0.7); one plain process on one thread "
            f"{plain_rate:,.0f} tokens/s = {plain_rate / best:.2f}; the rows' encoding alone (no shard written) "
            f"{tokens / encode_s:,.0f} tokens/s = {tokens / encode_s / best:.2f}"
        )
        long_best = max(long_baseline.values())
        print(
            f"    documents of {long_tokens * 20 / rows:.0f} tokens: one plain process on one thread "
            f"{long_tokens / long_s:,.0f} tokens/s / batch encoding {long_best:,.0f} = "
            f"{long_tokens / long_s / long_best:.2f}; "
            f"the encoding alone {long_tokens / long_encode_s / long_best:.2f}"
        )
        print(
            f"D5 prepare, {where} / one plain process: {ray_s:.1f} s / {plain_s:.1f} s = ratio {d5:.2f} "
            f"(goal >= 1); again with Ray Data's workers started {warm_s:.1f} s = {plain_s / warm_s:.2f}, "
            f"{tokens / warm_s / CPUS / best:.2f} of the batch encoding a CPU",
            flush=True,
        )
        return {
            "ratio_s5": s5_ratio,
            "ratio_d5": d5,
            "quickstart_prepare_s": quickstart_s,
            "quickstart_warm_s": quickstart["warm_s"],
            "ray_s": ray_s,
            "ray_warm_s": warm_s,
            "plain_s": plain_s,
            "tokens": tokens,
            "rows": rows,
            "units": store.shards,
            "batch_tokens_per_s": baseline,
            "plain_ratio_to_batch": plain_rate / best,
            "encode_ratio_to_batch": tokens / encode_s / best,
            "long_documents_plain_ratio_to_batch": long_tokens / long_s / long_best,
            "long_documents_encode_ratio_to_batch": long_tokens / long_encode_s / long_best,
        }
    finally:
        h.cleanup(Path(folder))


if __name__ == "__main__":
    if "--rows" in sys.argv:
        os.environ["BENCH_PREPARE_ROWS"] = sys.argv[sys.argv.index("--rows") + 1]
    print(json.dumps(s5(h.SETTINGS["quick"]), default=str))
