"""Data: Ray Data reads, tokenizes and packs on the cluster; each worker cuts its part of
every global batch from one deterministic stream.

Why every worker reads the same ordered stream instead of a Ray split: a split hands
blocks to whichever worker asks first, so which sample lands where (and therefore the
loss) would change from run to run and with the worker count. Here the order of packed
rows depends only on the files, `training.seed` and the epoch; a global batch is the
next `global_batch_size` rows of it; rank r takes its slice. The checkpoint stores
(epoch, offset), so a resumed run, at any world size, starts at the next unseen row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa

from .config import DataSpec, JobSpec
from .errors import BadRowError, JobError

IGNORE = -100
CHAT_ROLES = {"system", "user", "assistant", "tool"}
FILE_EXTENSIONS = ["jsonl", "json", "parquet"]


# ---------------------------------------------------------------- reading (driver + Ray Data tasks)
def _row_numbered_files():
    from ray.data.datasource import FileBasedDatasource

    class RowNumberedFiles(FileBasedDatasource):
        """jsonl/parquet rows with their file and row number, so a bad row can be named.
        jsonl lines stay raw text here: type checks happen per row in `tokenize_batch`."""

        def _read_stream(self, f, path: str):
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                table = pq.read_table(pa.BufferReader(f.read()))
                rows = table.to_pylist()
                records = [json.dumps(r, default=str) for r in rows]
            else:
                records = f.read().decode("utf-8").splitlines()
            for start in range(0, len(records), 1024):
                chunk = records[start:start + 1024]
                yield pa.table({"__file": [path] * len(chunk), "__row": list(range(start + 1, start + 1 + len(chunk))),
                                "__json": chunk})

    return RowNumberedFiles


def build_dataset(spec: JobSpec):
    """The Ray Dataset of packed rows: input_ids/labels [seq_len] and the count of skipped rows."""
    import ray.data
    from . import storage

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is part of the training recipe
    ctx.target_max_block_size = 4 * 1024 * 1024  # small blocks stream; big ones arrive all at once
    ctx.enable_progress_bars = False
    fs, path = storage.filesystem(spec.data.path)
    source = _row_numbered_files()(path, filesystem=fs, file_extensions=FILE_EXTENSIONS)
    ds = ray.data.read_datasource(source)
    return ds.map_batches(tokenize_batch, fn_kwargs={"spec": spec.model_dump(mode="json")},
                          batch_format="pyarrow", batch_size=256, zero_copy_batch=True)


_TOKENIZERS: dict = {}


def _tokenizer(spec: JobSpec):
    from .modeling import load_tokenizer

    key = (spec.model.tokenizer or spec.model.path, spec.model.trust_remote_code)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


def tokenize_batch(batch: pa.Table, spec: dict) -> dict[str, np.ndarray]:
    """Ray Data UDF: raw rows -> packed (or padded) token rows. Bad rows are skipped and
    counted, or raise a BadRowError naming file and row, per `data.bad_rows`."""
    job = JobSpec.model_validate(spec)
    tok = _tokenizer(job)
    docs, bad = [], 0
    for file, row, raw in zip(batch["__file"].to_pylist(), batch["__row"].to_pylist(), batch["__json"].to_pylist()):
        try:
            docs.append(encode_record(tok, job.data, raw))
        except ValueError as why:
            if job.data.bad_rows == "fail":
                raise BadRowError(f"{file} row {row}: {why} (set data.bad_rows: skip to skip such rows)") from None
            bad += 1
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, labels = (pack if job.data.pack else pad_rows)(docs, job.data.seq_len, pad)
    skipped = np.zeros(len(ids), dtype=np.int32)
    if len(skipped):
        skipped[0] = bad  # carried on the batch's first row, summed by the worker that trains on it
    return {"input_ids": ids, "labels": labels, "bad_rows": skipped}


# ---------------------------------------------------------------- pure encoding (unit-tested)
def parse_record(data: DataSpec, raw: str):
    """One raw jsonl line -> the text (str) or messages (list) the format needs; ValueError
    says why the row is unusable. No tokenizer: pre-flight checks the first rows with it."""
    if not raw.strip():
        raise ValueError("empty line")
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if data.format == "text":
        return check_text(record.get(data.text_column, None), data)
    return check_messages(record.get(data.messages_column, None), data)


def encode_record(tok, data: DataSpec, raw: str) -> tuple[list[int], list[int]]:
    """One raw jsonl line -> (token ids, labels); ValueError says why the row is unusable."""
    value = parse_record(data, raw)
    return (encode_text if data.format == "text" else encode_chat)(tok, value, data)


def check_text(text, data: DataSpec) -> str:
    if not isinstance(text, str):
        raise ValueError(f"column {data.text_column!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"column {data.text_column!r} is empty")
    return text


def check_messages(messages, data: DataSpec) -> list:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"column {data.messages_column!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in CHAT_ROLES:
            raise ValueError(f"message {i} must be {{role: one of {sorted(CHAT_ROLES)}, content: string}}, got {str(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to train on")
    return messages


def encode_text(tok, text, data: DataSpec) -> tuple[list[int], list[int]]:
    check_text(text, data)
    ids = tok(text, add_special_tokens=True)["input_ids"] + [tok.eos_token_id]
    return _length_checked(ids, list(ids), data)


def encode_chat(tok, messages, data: DataSpec) -> tuple[list[int], list[int]]:
    """Loss on assistant tokens only. Each message's tokens are found by rendering the
    conversation prefix by prefix through the tokenizer's own chat template."""
    check_messages(messages, data)
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        try:
            prefix = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        except Exception as exc:  # the template's own refusal (jinja's raise_exception): this row is unusable
            raise ValueError(f"the chat template rejects message {i} ({type(exc).__name__}: {exc})") from None
        full = tok(prefix, add_special_tokens=False)["input_ids"]
        new = full[len(ids):]
        ids.extend(new)
        labels.extend(new if message["role"] == "assistant" else [IGNORE] * len(new))
    return _length_checked(ids, labels, data)


def _length_checked(ids: list[int], labels: list[int], data: DataSpec) -> tuple[list[int], list[int]]:
    if not data.pack and len(ids) > data.seq_len:
        raise ValueError(f"{len(ids)} tokens, longer than data.seq_len={data.seq_len} (raise seq_len or set data.pack: true)")
    return ids, labels


def pack(docs, seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents into full rows; the tail becomes one padded row (nothing dropped)."""
    if not docs:
        return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32)
    ids = np.concatenate([np.asarray(d[0], np.int32) for d in docs])
    labels = np.concatenate([np.asarray(d[1], np.int32) for d in docs])
    rows = -(-len(ids) // seq_len)
    out_ids = np.full(rows * seq_len, pad, np.int32)
    out_labels = np.full(rows * seq_len, IGNORE, np.int32)
    out_ids[: len(ids)], out_labels[: len(labels)] = ids, labels
    return out_ids.reshape(rows, seq_len), out_labels.reshape(rows, seq_len)


def pad_rows(docs, seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    out_ids = np.full((len(docs), seq_len), pad, np.int32)
    out_labels = np.full((len(docs), seq_len), IGNORE, np.int32)
    for i, (ids, labels) in enumerate(docs):
        out_ids[i, : len(ids)], out_labels[i, : len(labels)] = ids, labels
    return out_ids, out_labels


# ---------------------------------------------------------------- the global order (workers)
@dataclass
class DataPosition:
    """Where the global stream stands: rows of `epoch` consumed so far, in shuffled order."""

    epoch: int = 0
    offset: int = 0


@dataclass
class StepBatch:
    micro_batches: list[dict]  # this rank's micro-batches: input_ids, labels (torch.long)
    sample_ids: list[tuple[int, int]] = field(default_factory=list)  # (epoch, stream index) of this rank's rows
    bad_rows: int = 0


def window_order(seed: int, epoch: int, window: int, n: int, shuffle: bool) -> np.ndarray:
    """The permutation of one shuffle window: a function of seed, epoch and window only."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, window]).permutation(n)


class GlobalBatches:
    """Cuts this rank's micro-batches out of consecutive global batches of the stream."""

    def __init__(self, shard, spec: JobSpec, rank: int, world_size: int, position: DataPosition):
        self.shard, self.spec, self.rank, self.world = shard, spec, rank, world_size
        self.position = DataPosition(position.epoch, position.offset)
        self._rows = self._stream()

    def _stream(self) -> Iterator[tuple[int, int, dict]]:
        import torch

        window_rows = self.spec.data.shuffle_window
        epoch, skip = self.position.epoch, self.position.offset
        while True:
            seen = 0
            batches = self.shard.iter_torch_batches(batch_size=window_rows, dtypes=torch.long, prefetch_batches=2)
            for w, window in enumerate(batches):
                n = len(window["input_ids"])
                order = window_order(self.spec.training.seed, epoch, w, n, self.spec.data.shuffle)
                for j in range(n):
                    pos = w * window_rows + j
                    seen += 1
                    if pos < skip:
                        continue  # consumed before the checkpoint this run resumed from
                    i = int(order[j])
                    yield epoch, w * window_rows + i, {k: v[i] for k, v in window.items()}
            if seen == 0:
                raise JobError(f"data.path={self.spec.data.path} gave no usable rows (all skipped as bad, or empty)")
            epoch, skip = epoch + 1, 0

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        import torch

        t = self.spec.training
        per_rank = t.global_batch_size // self.world
        lo, hi = self.rank * per_rank, (self.rank + 1) * per_rank
        mine, ids, bad = [], [], 0
        for k in range(t.global_batch_size):
            epoch, index, row = next(self._rows)
            bad += int(row["bad_rows"])
            if lo <= k < hi:
                mine.append(row)
                ids.append((epoch, index))
            self.position = DataPosition(epoch, self.position.offset + 1 if epoch == self.position.epoch else 1)
        micro = [
            {key: torch.stack([r[key] for r in mine[s:s + t.micro_batch_size]]) for key in ("input_ids", "labels")}
            for s in range(0, per_rank, t.micro_batch_size)
        ]
        return StepBatch(micro, ids, bad)
