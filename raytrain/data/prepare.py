"""Prepare once: a Ray Data job on the cluster's CPUs reads every source, tokenizes (a batch
of rows per tokenizer call) and packs each read unit on its own, and writes the token store;
the driver writes its manifest last. A small dataset is prepared by one plain Ray task, unit
after unit, in less time than Ray Data's workers take to start. Training workers never tokenize.

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
import os
import sys
import time
from functools import partial
from importlib import metadata
from itertools import islice
from pathlib import Path

from raytrain.data.pairs import encode_pairs
from raytrain.data.prompts import encode_prompts
from raytrain.data.records import encode_rows
from raytrain.data.sources import Source, Unit, list_sources, plan_units, read_unit
from raytrain.data.store import TokenStore, shard_name, token_dtype
from raytrain.data.store_writer import shard_rows, write_manifest, write_shard
from raytrain.data.unpaired import encode_unpaired
from raytrain.errors import BadRowError, JobError
from raytrain.job.data import DataSpec
from raytrain.job.spec import JobSpec
from raytrain.rundir import storage

PACKER_VERSION = (
    4  # 2: units sized from the file; 3: positions per document, chat labels from one rendering; 4: store format 4
)
UNIT_BYTES = 16 << 20  # the most JSON Lines bytes per prepare task
# Less source data than this is prepared by one plain task, unit after unit: done before Ray Data's
# workers would have started and imported transformers.
LOCAL_BYTES = 4 << 20
BATCH_ROWS = 256  # rows tokenized per tokenizer call: its per-call cost is spread thin, a batch's memory stays small
BAD_EXAMPLES = 10
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
)


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


def store_key(d: DataSpec, sources: list[Source], tokenizer: str, unit_bytes: int, pairs: bool | str = False) -> str:
    inputs = {
        "pairs": pairs,
        "sources": [[s.path, s.size, s.mtime_ns] for s in sources],
        "tokenizer": tokenizer,
        "format": d.format,
        "columns": d.columns.model_dump(),
        "tags": d.tags.model_dump(),
        "train_on_inputs": d.train_on_inputs,
        "seq_len": d.seq_len,
        "pack": d.pack,
        "unit_bytes": unit_bytes,
        "packer": PACKER_VERSION,
    }
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
    return {
        "train": [uri for (_, uri), _ in train],
        "weights": [w for _, w in train],
        "eval": eval_uri,
        "key": hashlib.sha256(repr(identity).encode()).hexdigest()[:20],
    }


def ensure_inputs(spec: JobSpec) -> dict:
    """`plan_inputs`, with every store in it prepared (or found complete and verified)."""
    planned = plan_inputs(spec)
    datasets = [data for data, _ in spec.data.inputs()] + ([spec.data.eval_input()] if spec.data.eval_input() else [])
    prepared = {ensure_store(spec, data).uri for data in datasets}
    if prepared != {*planned["train"], *([planned["eval"]] if planned["eval"] else [])}:
        raise JobError(
            "the data changed while it was being prepared (a source file was written meanwhile); "
            "run the job again once the files are final"
        )
    return planned


def _planned(spec: JobSpec, data: DataSpec, unit_bytes: int = UNIT_BYTES) -> tuple[str, str, object, list[Source]]:
    """(key, uri, the sources' filesystem, the sources) of one dataset's store; the key hashes
    everything that changes its tokens."""
    fs, root = storage.filesystem(data.path)
    try:
        sources = list_sources(fs, root)
    except FileNotFoundError as exc:
        raise JobError(str(exc)) from None
    g = spec.training.grpo  # a prompt's room, and whether it must be messages (tools)
    kind = (
        [spec.row_kind, g.max_completion_length] + (["conversational"] if g.agents else [])
        if spec.rl
        else spec.row_kind
    )
    key = store_key(data, sources, tokenizer_fingerprint(spec), unit_bytes, kind)
    return key, f"{datasets_root(spec)}/{key}", fs, sources


def ensure_store(
    spec: JobSpec, data: DataSpec | None = None, unit_bytes: int = UNIT_BYTES, concurrency: int | None = None
) -> TokenStore:
    """The token store of one dataset (default: `data.path`): reused when complete, else
    prepared on the cluster (Ray is up)."""
    data = data or spec.data
    key, uri, fs, sources = _planned(spec, data, unit_bytes)
    store = TokenStore.open(uri)
    if store is not None:  # its rows are checked as they are read (store.py): nothing to scan here
        print(f"[raytrain] data: reusing token store {store.describe()}", flush=True)
        return store
    started = time.perf_counter()
    units = plan_units(fs, sources, unit_bytes)
    out_fs, out_path = storage.filesystem(uri)
    out_fs.create_dir(out_path, recursive=True)
    out_fs.delete_dir_contents(out_path, missing_dir_ok=True)  # a half-written earlier attempt
    results = _run_units(spec, data, fs, units, out_fs, out_path, concurrency)
    manifest = {
        **_manifest(data, key, sources, units, results),
        "sequences_per_row": spec.stored_sequences,
        "token_dtype": next((r["token_dtype"] for r in results if "token_dtype" in r), "uint32"),
    }
    write_manifest(out_fs, out_path, manifest)
    store = TokenStore.open(uri)
    if store is None:
        raise JobError(
            f"the token store at {uri} did not verify right after it was written; is the storage consistent?"
        )
    print(
        f"[raytrain] data: prepared token store {store.describe()} in {time.perf_counter() - started:.1f}s "
        f"({manifest['docs']:,} documents, {len(units)} units)",
        flush=True,
    )
    return store


def _run_units(
    spec: JobSpec, data: DataSpec, fs, units: list[Unit], out_fs, out_path: str, concurrency: int | None
) -> list[dict]:
    """Each unit's own read, tokenize, pack and shard write (`prepare_unit`), results in unit
    order: in this process for a small dataset (one unit, or under LOCAL_BYTES of sources), else
    one Ray Data task per unit on the cluster's CPUs (`concurrency` of them at most). The same
    function on the same units either way, so the same store."""
    kwargs = {
        "fs": fs,
        "out_fs": out_fs,
        "out_path": out_path,
        "spec": spec.model_dump(mode="json"),
        "data": data.model_dump(mode="json"),
    }
    import ray

    if len(units) <= 1 or _source_bytes(fs, units) < LOCAL_BYTES:
        items = [{"index": i, "unit": u.to_json()} for i, u in enumerate(units)]
        if not ray.is_initialized():  # a tool or test without a cluster
            return _prepare_units(items, kwargs)
        # One task on a worker Ray already runs: the tokenizer's import and the tokenizing happen
        # beside the driver's work (the trainer's start), not in its process and under its GIL.
        return ray.get(ray.remote(num_cpus=1)(_prepare_units).remote(items, kwargs))
    import logging

    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset INFO lines are noise to a user
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = True
    items = [{"index": i, "unit": u.to_json()} for i, u in enumerate(units)]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    results = ds.map(
        prepare_unit, fn_kwargs={**kwargs, "one_core": True}, concurrency=concurrency, num_cpus=1
    ).take_all()
    return [json.loads(r["result"]) for r in sorted(results, key=lambda r: r["index"])]


def _prepare_units(items: list[dict], kwargs: dict) -> list[dict]:
    return [json.loads(prepare_unit(item, **kwargs)["result"]) for item in items]


def _source_bytes(fs, units: list[Unit]) -> int:
    parquet = sorted({u.file for u in units if u.kind == "parquet"})
    return sum(u.stop - u.start for u in units if u.kind != "parquet") + sum(i.size for i in fs.get_file_info(parquet))


_TOKENIZERS: dict = {}


def prepare_unit(item: dict, fs, out_fs, out_path: str, spec: dict, data: dict, one_core: bool = False) -> dict:
    """One unit -> one shard file (a Ray Data task, or a call in the driver). Bad rows are counted
    and the first few kept (by row number within the unit: the driver numbers them within the file).
    `one_core`: a task holds one CPU, so the tokenizer's batches stay on one thread."""
    from raytrain.model.hub import load_tokenizer  # torch-free callers (validate) never reach this

    job, d = JobSpec.model_validate(spec), DataSpec.model_validate(data)
    tok_key = json.dumps(spec["model"], sort_keys=True)
    if tok_key not in _TOKENIZERS:
        _TOKENIZERS[tok_key] = load_tokenizer(job)
    tok = _TOKENIZERS[tok_key]
    if one_core:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read at each call: else a thread per core of the node
    encode = (
        partial(
            encode_prompts,
            completion_room=job.training.grpo.max_completion_length,
            conversational=job.training.grpo.agents,
        )
        if job.rl
        else encode_unpaired
        if job.unpaired
        else partial(encode_pairs, margins=job.scores)
        if job.preference
        else encode_rows
    )
    unit = Unit(**json.loads(item["unit"]))
    docs, bad, examples, lines = [], 0, [], 0
    rows, problem, done = read_unit(fs, unit), None, False
    while not done:  # BATCH_ROWS rows at a time, each row's result as if encoded alone
        batch = []
        try:
            batch.extend(islice(rows, BATCH_ROWS))  # keeps the rows read before a problem
        except ValueError as file_problem:  # a file that cannot be read as its kind at all
            problem = file_problem
        done = problem is not None or len(batch) < BATCH_ROWS
        for encoded in encode(tok, d, batch):
            lines += 1
            if isinstance(encoded, ValueError):
                bad += 1
                if len(examples) < BAD_EXAMPLES:
                    examples.append([lines, str(encoded)])
                if d.bad_rows == "fail":  # stops here, as reading row by row did: a later problem is not met
                    done, problem = True, None
                    break
            else:
                docs.append(encoded)
    if problem is not None:
        return {"index": item["index"], "result": json.dumps({"file_error": str(problem)})}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dtype = token_dtype(len(tok))
    grouped = job.stored_sequences > 1  # a row is several sequences (a pair, a KTO row, a prompt and its columns)
    entry = write_shard(
        out_fs, out_path, shard_name(item["index"]), shard_rows(docs, d.seq_len, d.pack, grouped), dtype
    )
    sequences = [s for group in docs for s in group] if grouped else docs
    result = {
        **entry,
        "lines": lines,
        "pad_id": int(pad),
        "token_dtype": dtype.name,
        "bad": bad,
        "examples": examples,
        "docs": len(docs),
        "tokens": int(sum(len(ids) for ids, _ in sequences)),
    }
    return {"index": item["index"], "result": json.dumps(result)}


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
        shards.append(
            {
                "file": r["file"],
                "rows": r["rows"],
                "first_row": row,
                "tokens": r["tokens"],
                "index_sha256": r["index_sha256"],
            }
        )
        row += r["rows"]
    bad = sum(r["bad"] for r in results)
    if bad and data.bad_rows == "fail":
        raise BadRowError(f"{named[0]} (set data.bad_rows: skip to skip such rows)")
    if row == 0:
        raise JobError(
            f"data.path={data.path} gave no usable rows ({bad} bad, the rest empty); e.g. {named[0]}"
            if named
            else f"data.path={data.path} holds no rows"
        )
    if bad:
        print(f"[raytrain] data: skipped {bad} bad row(s), e.g. {named[0]}", file=sys.stderr, flush=True)
    pad_id = next((r["pad_id"] for r in results if "pad_id" in r), 0)
    return {
        "key": key,
        "rows": row,
        "seq_len": data.seq_len,
        "pad_id": pad_id,
        "shards": shards,
        "bad_rows": bad,
        "bad_examples": named,
        "docs": sum(r["docs"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "sources": [{"path": s.path, "size": s.size, "mtime_ns": s.mtime_ns} for s in sources],
        "settings": {"format": data.format, "pack": data.pack, "packer": PACKER_VERSION},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
