"""A prepared token store: documents' tokens at their own lengths, an index per shard, and a
signed manifest written last (Megatron's `.bin`/`.idx`, with a hash per row).

Layout under `<checkpoint.storage_path>/datasets/<key>/`:
  part-000000.bin  the tokens of every row, unpadded, one word each: uint16 where the vocabulary
                   fits in 14 bits, else uint32. The top bit says "trained" (the label is the
                   token, else IGNORE) and the next "a document starts here", so labels and
                   position ids need no planes of their own: 2 or 4 bytes a token.
  part-000000.idx  per sequence its first token's offset (uint64, one more at the end) and the
                   position id it starts at (uint32: a packed document may run on from the row
                   before); per row a 16-byte BLAKE2b of its tokens. 28-40 bytes a row.
  manifest.json    rows, seq_len, the shards (rows, first row, tokens, the .idx's sha256), the
                   key's inputs, the bad-row count and the first bad rows named; signed
                   (signing.py) and written last
A row is one sequence (text, chat) or two (a preference pair: chosen, then rejected), each up to
seq_len tokens; `read` pads them back to seq_len exactly as packing laid them out (pad id,
labels IGNORE, positions counting from 0), so the model sees what it always saw.

Trust without a start-up scan: a reader checks the signed manifest, then each shard's .idx
against the manifest's sha256 the first time it touches that shard (kept in a bounded cache),
then each row's bytes against the row's hash in that index, before the row is used. Nothing
hashes the whole store; a rank reads the index of the shards it touches and its own rows'
bytes only. A store without its manifest is never opened (`open` returns None and the prepare
step builds it again); a changed row, index or manifest is refused with its file named.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from .. import signing, storage
from ..errors import JobError
from .records import IGNORE, document_positions

MANIFEST = "manifest.json"
FORMAT_VERSION = 4  # 3: 12 bytes a token in three int32 planes, padded; 4: 2-4 bytes, unpadded, hash per row
PLANES = 3  # what `read` gives per sequence: input_ids, labels, position_ids
DIGEST = 16  # bytes of a row's BLAKE2b
INDEX_CACHE_BYTES = 64 << 20  # verified shard indexes a reader keeps (LRU): ~2M rows' worth


@dataclass
class ReadCounters:
    rows: int = 0
    bytes: int = 0
    reads: int = 0


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest word holding a token id and the two flag bits."""
    if vocab_size <= 1 << 14:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 30:
        return np.dtype(np.uint32)
    raise ValueError(f"a vocabulary of {vocab_size} tokens is larger than the store's 30-bit ids")


def _flags(dtype: np.dtype) -> tuple[int, int]:
    bits = dtype.itemsize * 8
    return 1 << (bits - 1), 1 << (bits - 2)  # trained, document start


def encode_shard(rows: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]], dtype: np.dtype) -> tuple[bytes, bytes, int]:
    """Rows, each a list of sequences (ids, labels, positions as packing laid them out, padding
    already cut off) -> (.bin bytes, .idx bytes, tokens). A label is either the token or IGNORE:
    anything else cannot be stored as a flag, so it is refused here, at prepare."""
    trained_bit, start_bit = _flags(dtype)
    words, offsets, first_pos, digests, at = [], [0], [], [], 0
    for sequences in rows:
        row_words = []
        for ids, labels, pos in sequences:
            ids, labels, pos = (np.asarray(a, np.int64) for a in (ids, labels, pos))
            trained = labels != IGNORE
            if (labels[trained] != ids[trained]).any() or (ids < 0).any() or (ids >= start_bit).any():
                raise ValueError("a label that is neither its token nor ignored, or a token id out of range")
            starts = np.zeros(len(ids), bool)
            starts[1:] = pos[1:] == 0
            starts[:1] = pos[:1] == 0
            w = ids | np.where(trained, trained_bit, 0) | np.where(starts, start_bit, 0)
            row_words.append(w.astype(dtype))
            at += len(ids)
            offsets.append(at)
            first_pos.append(int(pos[0]) if len(pos) else 0)
        joined = np.concatenate(row_words) if row_words else np.zeros(0, dtype)
        words.append(joined)
        digests.append(hashlib.blake2b(joined.tobytes(), digest_size=DIGEST).digest())
    data = (np.concatenate(words) if words else np.zeros(0, dtype)).tobytes()
    index = (np.asarray(offsets, np.uint64).tobytes() + np.asarray(first_pos, np.uint32).tobytes() + b"".join(digests))
    return data, index, at


class TokenStore:
    def __init__(self, uri: str, manifest: dict, fs: pafs.FileSystem, path: str):
        self.uri, self.manifest, self.fs, self.path = uri, manifest, fs, path
        self.key: str = manifest["key"]
        self.rows: int = manifest["rows"]
        self.seq_len: int = manifest["seq_len"]
        self.bad_rows: int = manifest["bad_rows"]
        self.sequences: int = manifest["sequences_per_row"]  # 2: a preference pair
        self.planes = PLANES * self.sequences
        self.dtype = np.dtype(manifest["token_dtype"])
        self.pad_id = int(manifest.get("pad_id", 0))
        self._first = np.array([s["first_row"] for s in manifest["shards"]], dtype=np.int64)
        self._files: dict[str, object] = {}
        self._index: OrderedDict[int, tuple] = OrderedDict()
        self._index_bytes = 0
        self._lock = threading.Lock()
        self.read_counters = ReadCounters()

    @classmethod
    def open(cls, uri: str) -> "TokenStore | None":
        """The complete store at `uri` (its manifest is there and signed), or None (absent or
        half-written). One read: the shards are checked as they are read, not here."""
        fs, path = storage.filesystem(uri)
        try:
            with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
                manifest = json.loads(f.read())
        except (FileNotFoundError, OSError, ValueError):
            return None
        where = f"the token store {uri}/{MANIFEST}"
        if manifest.get("format_version") != FORMAT_VERSION:
            raise JobError(f"refusing {where}: it was written by an older raytrain (store format "
                           f"{manifest.get('format_version')}, this one reads {FORMAT_VERSION}). Delete the folder "
                           f"{uri} and run the job again (or `raytrain prepare`) to prepare it in the new format")
        manifest = signing.verify_document(manifest, where)
        signing.require_place(manifest, "key", uri.rstrip("/").rsplit("/", 1)[-1], where)
        return cls(uri, manifest, fs, path)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The given rows, in that order: int32 [len(rows), planes, seq_len] (input_ids, labels,
        position_ids; twice for a pair). Consecutive rows of a shard are one read of their tokens
        (plus the shard's index the first time it is touched); each row is checked before use."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.planes, self.seq_len), dtype=np.int32)
        order = np.argsort(rows, kind="stable")
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and rows[order[j]] == rows[order[j - 1]] + 1:
                j += 1
            first = int(rows[order[i]])
            shard = int(np.searchsorted(self._first, first, side="right")) - 1
            if shard < 0 or first >= self.rows:
                raise IndexError(f"row {first} of a store of {self.rows} rows")
            local = first - int(self._first[shard])
            end = min(j, i + int(self.manifest["shards"][shard]["rows"]) - local)
            self._read_run(shard, local, order[i:end], out)
            i = end
        self.read_counters.rows += len(rows)
        return out

    def _read_run(self, shard: int, local: int, targets: np.ndarray, out: np.ndarray) -> None:
        """Rows local..local+len(targets) of one shard: one ranged read of their tokens."""
        offsets, first_pos, digests = self._shard_index(shard)
        s, n = self.sequences, len(targets)
        lo, hi = int(offsets[local * s]), int(offsets[(local + n) * s])
        item = self.dtype.itemsize
        name = self.manifest["shards"][shard]["file"]
        raw = self._file(name + ".bin").read_at((hi - lo) * item, lo * item)
        self.read_counters.reads += 1
        self.read_counters.bytes += len(raw)
        words = np.frombuffer(raw, dtype=self.dtype)
        trained_bit, start_bit = _flags(self.dtype)
        id_mask = start_bit - 1
        for k in range(n):
            a, b = int(offsets[(local + k) * s]) - lo, int(offsets[(local + k + 1) * s]) - lo
            row = words[a:b] if b <= len(words) else None
            if row is None or hashlib.blake2b(row.tobytes(), digest_size=DIGEST).digest() != digests[local + k]:
                raise self._changed(f"{name}.bin", f"row {local + k}'s tokens are not the signed ones")
            dest = out[targets[k]]
            for q in range(s):
                seq = local * s + k * s + q
                w = words[int(offsets[seq]) - lo:int(offsets[seq + 1]) - lo].astype(np.int64)
                length = len(w)
                ids, starts = w & id_mask, (w & start_bit) != 0
                at = np.arange(length)
                last = np.maximum.accumulate(np.where(starts, at, -1)) if length else at
                pos = np.where(last >= 0, at - last, int(first_pos[seq]) + at)
                plane = dest[q * PLANES:(q + 1) * PLANES]
                plane[0, :length], plane[1, :length] = ids, np.where((w & trained_bit) != 0, ids, IGNORE)
                plane[2, :length] = pos
                plane[0, length:], plane[1, length:] = self.pad_id, IGNORE
                # Padding continues the last document's positions: it is never a document of its own
                # (masks.py), so an unpadded row's attention needs no mask.
                plane[2, length:] = (int(pos[-1]) + 1 if length else 0) + np.arange(self.seq_len - length)

    def _shard_index(self, shard: int) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """A shard's index, checked against the manifest's sha256 the first time it is read."""
        with self._lock:
            if shard in self._index:
                self._index.move_to_end(shard)
                return self._index[shard]
        meta = self.manifest["shards"][shard]
        name = meta["file"] + ".idx"
        try:
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                raw = f.read()
        except FileNotFoundError:
            raise JobError(f"refusing the token store {self.uri}: {name} is missing (deleted after it was prepared). "
                           "Delete the folder to prepare it again") from None
        self.read_counters.reads += 1
        self.read_counters.bytes += len(raw)
        if hashlib.sha256(raw).hexdigest() != meta["index_sha256"]:
            raise self._changed(name, "its sha256 is not the signed one")
        sequences = meta["rows"] * self.sequences
        offsets = np.frombuffer(raw, np.uint64, sequences + 1)
        first_pos = np.frombuffer(raw, np.uint32, sequences, offset=8 * (sequences + 1))
        tail = raw[8 * (sequences + 1) + 4 * sequences:]
        digests = [tail[k * DIGEST:(k + 1) * DIGEST] for k in range(meta["rows"])]
        entry = (offsets, first_pos, digests)
        with self._lock:
            self._index[shard] = entry
            self._index_bytes += len(raw)
            while self._index_bytes > INDEX_CACHE_BYTES and len(self._index) > 1:
                _, old = self._index.popitem(last=False)
                self._index_bytes -= len(old[0]) * 8 + len(old[1]) * 4 + len(old[2]) * DIGEST
        return entry

    def _changed(self, name: str, why: str) -> JobError:
        return JobError(f"refusing the token store {self.uri}: {name} was changed after it was prepared ({why}). "
                        "Delete the folder to prepare it again")

    def _file(self, name: str):
        with self._lock:
            if name not in self._files:
                try:
                    self._files[name] = self.fs.open_input_file(f"{self.path}/{name}")
                except FileNotFoundError:
                    raise JobError(f"refusing the token store {self.uri}: {name} is missing (deleted after it was "
                                   "prepared). Delete the folder to prepare it again") from None
            return self._files[name]

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def describe(self) -> str:
        return (f"{self.uri} ({self.rows:,} rows of {self.seq_len} tokens from {len(self.manifest['sources'])} file(s), "
                f"{self.bad_rows} bad row(s) skipped)")


def shard_rows(docs: list, seq_len: int, pack: bool, pairs: bool) -> list[list[tuple]]:
    """A unit's encoded documents -> its rows, each a list of unpadded sequences (ids, labels,
    positions): a pair is one row of two; packing concatenates documents and cuts every seq_len
    tokens (positions count within each document, so a document may run on into the next row)."""
    if pairs:
        return [[(ids, labels, np.arange(len(ids))) for ids, labels in pair] for pair in docs]
    if not pack:
        return [[(ids, labels, np.arange(len(ids)))] for ids, labels in docs]
    if not docs:
        return []
    ids = np.concatenate([np.asarray(i, np.int64) for i, _ in docs])
    labels = np.concatenate([np.asarray(l, np.int64) for _, l in docs])
    pos = document_positions([len(i) for i, _ in docs])
    return [[(ids[a:a + seq_len], labels[a:a + seq_len], pos[a:a + seq_len])] for a in range(0, len(ids), seq_len)]


def write_shard(out_fs: pafs.FileSystem, out_path: str, name: str, rows, dtype: np.dtype) -> dict:
    """One shard's .bin and .idx (see `encode_shard`); the manifest's entry for it, less first_row."""
    data, index, tokens = encode_shard(rows, dtype)
    for suffix, payload in ((".bin", data), (".idx", index)):
        with out_fs.open_output_stream(f"{out_path}/{name}{suffix}") as f:
            f.write(payload)
    return {"file": name, "rows": len(rows), "tokens": tokens, "index_sha256": hashlib.sha256(index).hexdigest()}


def write_manifest(fs: pafs.FileSystem, path: str, manifest: dict) -> None:
    """Last write of a prepare: to a temporary name, then moved into place (atomic locally,
    a single object on an object store), so a reader sees the whole manifest or none."""
    tmp = f"{path}/{MANIFEST}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(signing.sign_document({**manifest, "format_version": FORMAT_VERSION}), indent=1).encode())
    fs.move(tmp, f"{path}/{MANIFEST}")
