"""Prepare once: a Ray Data job on the cluster's CPUs reads every source, tokenizes and
packs each read unit on its own, and writes the token store; the driver writes its
manifest last. Training workers never tokenize.

The store's key hashes everything that changes its tokens (the sources' paths, sizes and
modification times; the tokenizer's files and library versions; the format settings,
seq_len, packing, the unit size and the packer version), so a second run, a restart or
another job on the same data reuses it and tokenizes nothing. What goes into a row
depends only on its unit (packing restarts at each unit), never on Ray Data's
parallelism, block sizes or the cluster's CPU count.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from .. import storage
from ..config import DataSpec, JobSpec
from ..errors import BadRowError, JobError
from .pairs import encode_pair
from .records import encode_row, pack, pad_rows
from .sources import Source, Unit, list_sources, plan_units, read_unit
from .store import PLANES, TokenStore, write_manifest

PACKER_VERSION = 3  # 2: units sized from the file; 3: positions per document, chat labels from one rendering
UNIT_BYTES = 16 << 20  # the most JSON Lines bytes per prepare task
BAD_EXAMPLES = 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json")


def datasets_root(spec: JobSpec) -> str:
    return spec.checkpoint.storage_path.rstrip("/") + "/datasets"


def tokenizer_fingerprint(spec: JobSpec) -> str:
    """The tokenizer's own files (a local folder) or its hub id and revision, and the
    versions of the libraries that turn text into ids."""
    digest = hashlib.sha256()
    name = spec.model.tokenizer or spec.model.path
    folder = Path(name)
    if folder.is_dir():
        for file in TOKENIZER_FILES:
            if (folder / file).is_file():
                digest.update(file.encode() + b"\0" + (folder / file).read_bytes())
    else:
        digest.update(f"{name}@{spec.model.hub_kwargs(name)['revision']}".encode())
    for lib in ("tokenizers", "transformers"):
        digest.update(f"{lib}=={metadata.version(lib)}".encode())
    return digest.hexdigest()[:16]


def store_key(d: DataSpec, sources: list[Source], tokenizer: str, unit_bytes: int, pairs: bool = False) -> str:
    inputs = {"pairs": pairs, "sources": [[s.path, s.size, s.mtime_ns] for s in sources], "tokenizer": tokenizer,
              "format": d.format, "columns": d.columns.model_dump(), "tags": d.tags.model_dump(),
              "train_on_inputs": d.train_on_inputs, "seq_len": d.seq_len, "pack": d.pack, "unit_bytes": unit_bytes,
              "packer": PACKER_VERSION}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def plan_inputs(spec: JobSpec) -> dict:
    """Every store the job trains and evaluates on, as the workers open them, before any is
    prepared (a store's place follows from its key): {"train": [uri, ...], "weights": [...],
    "eval": uri | None, "key": what a checkpoint's data position refers to}. The driver starts
    the workers with it and prepares the stores (`ensure_inputs`) while they build the model."""
    train = [(_planned(spec, data)[:2], weight) for data, weight in spec.data.inputs()]
    eval_data = spec.data.eval_input()
    eval_key, eval_uri = _planned(spec, eval_data)[:2] if eval_data else (None, None)
    fraction = spec.data.eval.fraction if spec.data.eval else None
    # The stores' keys (not their URIs: the same data under another storage path is the same data).
    identity = ([key for (key, _), _ in train], [w for _, w in train], eval_key, fraction)
    return {"train": [uri for (_, uri), _ in train], "weights": [w for _, w in train], "eval": eval_uri,
            "key": hashlib.sha256(repr(identity).encode()).hexdigest()[:20]}


def ensure_inputs(spec: JobSpec) -> dict:
    """`plan_inputs`, with every store in it prepared (or found complete and verified)."""
    planned = plan_inputs(spec)
    datasets = [data for data, _ in spec.data.inputs()] + ([spec.data.eval_input()] if spec.data.eval_input() else [])
    prepared = {ensure_store(spec, data).uri for data in datasets}
    if prepared != {*planned["train"], *([planned["eval"]] if planned["eval"] else [])}:
        raise JobError("the data changed while it was being prepared (a source file was written meanwhile); "
                       "run the job again once the files are final")
    return planned


def _planned(spec: JobSpec, data: DataSpec, unit_bytes: int = UNIT_BYTES) -> tuple[str, str, object, list[Source]]:
    """(key, uri, the sources' filesystem, the sources) of one dataset's store; the key hashes
    everything that changes its tokens."""
    fs, root = storage.filesystem(data.path)
    try:
        sources = list_sources(fs, root)
    except FileNotFoundError as exc:
        raise JobError(str(exc)) from None
    key = store_key(data, sources, tokenizer_fingerprint(spec), unit_bytes, spec.preference)
    return key, f"{datasets_root(spec)}/{key}", fs, sources


def ensure_store(spec: JobSpec, data: DataSpec | None = None, unit_bytes: int = UNIT_BYTES,
                 concurrency: int | None = None) -> TokenStore:
    """The token store of one dataset (default: `data.path`): reused when complete, else
    prepared on the cluster (Ray is up)."""
    data = data or spec.data
    key, uri, fs, sources = _planned(spec, data, unit_bytes)
    store = TokenStore.open(uri)
    if store is not None:
        store.verify_contents()
        print(f"[raytrain] data: reusing token store {store.describe()}", flush=True)
        return store
    started = time.perf_counter()
    units = plan_units(fs, sources, unit_bytes)
    out_fs, out_path = storage.filesystem(uri)
    out_fs.create_dir(out_path, recursive=True)
    out_fs.delete_dir_contents(out_path, missing_dir_ok=True)  # a half-written earlier attempt
    results = _run_units(spec, data, fs, units, out_fs, out_path, concurrency)
    manifest = {**_manifest(data, key, sources, units, results), "planes": PLANES * spec.sequences_per_row}
    write_manifest(out_fs, out_path, manifest)
    store = TokenStore.open(uri)
    if store is None:
        raise JobError(f"the token store at {uri} did not verify right after it was written; is the storage consistent?")
    print(f"[raytrain] data: prepared token store {store.describe()} in {time.perf_counter() - started:.1f}s "
          f"({manifest['docs']:,} documents, {len(units)} units)", flush=True)
    return store


def _run_units(spec: JobSpec, data: DataSpec, fs, units: list[Unit], out_fs, out_path: str,
               concurrency: int | None) -> list[dict]:
    """One Ray Data task per unit (its own read, tokenize, pack and shard write)."""
    import logging

    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset INFO lines are noise to a user
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = True
    items = [{"index": i, "unit": u.to_json()} for i, u in enumerate(units)]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    kwargs = {"fs": fs, "out_fs": out_fs, "out_path": out_path, "spec": spec.model_dump(mode="json"),
              "data": data.model_dump(mode="json")}
    results = ds.map(prepare_unit, fn_kwargs=kwargs, concurrency=concurrency, num_cpus=1).take_all()
    return [json.loads(r["result"]) for r in sorted(results, key=lambda r: r["index"])]


_TOKENIZERS: dict = {}


def prepare_unit(item: dict, fs, out_fs, out_path: str, spec: dict, data: dict) -> dict:
    """Ray Data task: one unit -> one shard file. Bad rows are counted and the first few
    kept (by row number within the unit: the driver numbers them within the file)."""
    from ..modeling import load_tokenizer  # torch-free callers (validate) never reach this

    job, d = JobSpec.model_validate(spec), DataSpec.model_validate(data)
    tok_key = json.dumps(spec["model"], sort_keys=True)
    if tok_key not in _TOKENIZERS:
        _TOKENIZERS[tok_key] = load_tokenizer(job)
    tok = _TOKENIZERS[tok_key]
    unit = Unit(**json.loads(item["unit"]))
    docs, bad, examples, lines = [], 0, [], 0
    try:
        for lines, row in enumerate(read_unit(fs, unit), start=1):
            try:
                docs.append(encode_pair(tok, d, row) if job.preference else encode_row(tok, d, row))
            except ValueError as why:
                bad += 1
                if len(examples) < BAD_EXAMPLES:
                    examples.append([lines, str(why)])
                if d.bad_rows == "fail":
                    break
    except ValueError as file_problem:  # a file that cannot be read as its kind at all
        return {"index": item["index"], "result": json.dumps({"file_error": str(file_problem)})}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if job.preference:  # a row is a pair: the chosen sequence's planes, then the rejected one's
        planes = [*pad_rows([c for c, _ in docs], d.seq_len, pad), *pad_rows([r for _, r in docs], d.seq_len, pad)]
        sequences = [c for c, _ in docs] + [r for _, r in docs]
    else:
        planes, sequences = (pack if d.pack else pad_rows)(docs, d.seq_len, pad), docs
    ids = planes[0]
    rows = np.stack(planes, axis=1).astype(np.int32).tobytes()
    with out_fs.open_output_stream(f"{out_path}/{shard_name(item['index'])}") as f:
        f.write(rows)
    result = {"rows": len(ids), "sha256": hashlib.sha256(rows).hexdigest(), "lines": lines, "pad_id": int(pad), "bad": bad, "examples": examples, "docs": len(docs),
              "tokens": int(sum(len(ids) for ids, _ in sequences))}
    return {"index": item["index"], "result": json.dumps(result)}


def shard_name(index: int) -> str:
    return f"part-{index:06d}.bin"


def _manifest(data: DataSpec, key: str, sources: list[Source], units: list[Unit], results: list[dict]) -> dict:
    """Row numbers within each file, the bad rows named, the shards and their row ranges."""
    file_errors = [r["file_error"] for r in results if "file_error" in r]
    if file_errors:
        raise JobError(f"data.path: {file_errors[0]}")
    first_line: dict[str, int] = {}
    named, shards, row = [], [], 0
    for index, (unit, r) in enumerate(zip(units, results)):
        before = first_line.get(unit.file, 0)  # a file's units are consecutive, in file order
        named += [f"{unit.file} row {before + n}: {why}" for n, why in r["examples"]]
        first_line[unit.file] = before + r["lines"]
        shards.append({"file": shard_name(index), "rows": r["rows"], "first_row": row, "sha256": r["sha256"]})
        row += r["rows"]
    bad = sum(r["bad"] for r in results)
    if bad and data.bad_rows == "fail":
        raise BadRowError(f"{named[0]} (set data.bad_rows: skip to skip such rows)")
    if row == 0:
        raise JobError(f"data.path={data.path} gave no usable rows ({bad} bad, the rest empty); "
                       f"e.g. {named[0]}" if named else f"data.path={data.path} holds no rows")
    if bad:
        print(f"[raytrain] data: skipped {bad} bad row(s), e.g. {named[0]}", file=sys.stderr, flush=True)
    pad_id = next((r["pad_id"] for r in results if "pad_id" in r), 0)
    return {"key": key, "rows": row, "seq_len": data.seq_len, "pad_id": pad_id, "shards": shards, "bad_rows": bad,
            "bad_examples": named, "docs": sum(r["docs"] for r in results), "tokens": sum(r["tokens"] for r in results),
            "sources": [{"path": s.path, "size": s.size, "mtime_ns": s.mtime_ns} for s in sources],
            "settings": {"format": data.format, "pack": data.pack, "packer": PACKER_VERSION},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
