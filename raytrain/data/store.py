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
  shards.tbl       the shard table: per shard (shard i's files are `shard_name(i)`) a 56-byte
                   little-endian record: first row, rows, tokens (uint64 each), its .idx's
                   sha256 (32 bytes); in blocks of `block_shards` (1,024) records, each block
                   the unit a reader reads (by range) and checks. Then the block directory: per
                   block its first row (uint64) and the sha256 of its bytes (40 bytes a block).
  manifest.json    rows, seq_len, the shard table's summary (shard count, block size, the
                   sha256 of its block directory), the key's inputs, the bad-row count and the
                   first bad rows named; signed (signing.py) and written last, after shards.tbl
A row is one sequence (text, chat) or two (a preference pair: chosen, then rejected), each up to
seq_len tokens; `read` pads them back to seq_len exactly as packing laid them out (pad id,
labels IGNORE, positions counting from 0), so the model sees what it always saw.

Trust without a start-up scan: a reader checks the signed manifest (its size does not grow with
the shards: `open` reads it and nothing else), then at its first row the table's block directory
against the manifest's sha256 (40 bytes per 1,024 shards), then each table block it touches
against the directory (kept in a bounded cache), each shard's .idx against its record's sha256
the first time it touches that shard (a bounded cache too), then each row's bytes against the
row's hash in that index, before the row is used. Nothing hashes the whole store; a rank reads
the table entries and the index of the shards it touches and its own rows' bytes only. A store
without its manifest is never opened (`open` returns None and the prepare step builds it again);
a changed row, index, table or manifest is refused with its file named.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from raytrain.data.records import IGNORE
from raytrain.errors import JobError
from raytrain.rundir import signing, storage

OPEN_FILES = 32  # shard files a reader keeps open at once (TokenStore._file)

MANIFEST = "manifest.json"
TABLE = "shards.tbl"
# 3: 12 bytes a token in three int32 planes, padded; 4: 2-4 bytes, unpadded, hash per row;
# 5: the shard table out of the manifest, in shards.tbl, read and checked by block
FORMAT_VERSION = 5
PLANES = 3  # what `read` gives per sequence: input_ids, labels, position_ids
DIGEST = 16  # bytes of a row's BLAKE2b
INDEX_CACHE_BYTES = 64 << 20  # verified shard indexes a reader keeps (LRU): ~2M rows' worth
TABLE_CACHE_BYTES = 8 << 20  # verified table blocks a reader keeps (LRU): ~150k shards' records
RECORD = np.dtype([("first_row", "<u8"), ("rows", "<u8"), ("tokens", "<u8"), ("index_sha256", "u1", (32,))])
BLOCK_ENTRY = np.dtype([("first_row", "<u8"), ("sha256", "u1", (32,))])  # the table's directory, per block


@dataclass
class ReadCounters:
    rows: int = 0
    bytes: int = 0  # everything read after `open`: tokens, shard indexes, the shard table
    reads: int = 0
    table_bytes: int = 0  # of `bytes`: the shard table's (its directory once, then the blocks touched)
    open_bytes: int = 0  # what `open` read: the manifest


def shard_name(index: int) -> str:
    """Shard `index`'s files (.bin and .idx), named by its number: the table keeps no names."""
    return f"part-{index:06d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest word holding a token id and the two flag bits."""
    if vocab_size <= 1 << 14:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 30:
        return np.dtype(np.uint32)
    raise ValueError(f"a vocabulary of {vocab_size} tokens is larger than the store's 30-bit ids")


def flags(dtype: np.dtype) -> tuple[int, int]:
    """The two flag bits of a token word: (trained, a document starts here)."""
    bits = dtype.itemsize * 8
    return 1 << (bits - 1), 1 << (bits - 2)  # trained, document start


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
        table = manifest["shard_table"]
        self.shards: int = int(table["shards"])
        self._block_shards = int(table["block_shards"])
        self._directory_sha256: str = table["directory_sha256"]
        self._directory: tuple[np.ndarray, np.ndarray] | None = None  # blocks' first rows and sha256s, once read
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # records, first rows (int64)
        self._blocks_bytes = 0
        self._files: OrderedDict[str, object] = OrderedDict()  # open shard files, the least recently read first
        self._index: OrderedDict[int, tuple] = OrderedDict()
        self._index_bytes = 0
        self._lock = threading.Lock()
        self.read_counters = ReadCounters()

    @classmethod
    def open(cls, uri: str) -> "TokenStore | None":
        """The complete store at `uri` (its manifest is there and signed), or None (absent or
        half-written). One read, of a manifest whose size does not grow with the shards: the
        shard table and the shards are checked as they are read, not here."""
        fs, path = storage.filesystem(uri)
        try:
            with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
                raw = f.read()
            manifest = json.loads(raw)
        except (FileNotFoundError, OSError, ValueError):
            return None
        where = f"the token store {uri}/{MANIFEST}"
        if manifest.get("format_version") != FORMAT_VERSION:
            raise JobError(
                f"refusing {where}: it was written by an older raytrain (store format "
                f"{manifest.get('format_version')}, this one reads {FORMAT_VERSION}). Delete the folder "
                f"{uri} and run the job again (or `raytrain prepare`) to prepare it in the new format"
            )
        manifest = signing.verify_document(manifest, where)
        signing.require_place(manifest, "key", uri.rstrip("/").rsplit("/", 1)[-1], where)
        store = cls(uri, manifest, fs, path)
        store.read_counters.open_bytes = len(raw)
        return store

    def shard(self, index: int) -> dict:
        """Shard `index`'s entry: {file, rows, first_row, tokens, index_sha256} (what the manifest
        listed before format 5), from its checked table block."""
        if not 0 <= index < self.shards:
            raise IndexError(f"shard {index} of a store of {self.shards} shards")
        record = self._block(index // self._block_shards)[0][index % self._block_shards]
        return {
            "file": shard_name(index),
            "rows": int(record["rows"]),
            "first_row": int(record["first_row"]),
            "tokens": int(record["tokens"]),
            "index_sha256": record["index_sha256"].tobytes().hex(),
        }

    def _locate(self, row: int) -> tuple[int, int, int]:
        """(shard, row within it, the shard's rows) of a row: the last shard starting at or before
        it (a shard of no rows shares its first row with the next), through one table block."""
        first_rows, _ = self._block_directory()
        block = int(np.searchsorted(first_rows, row, side="right")) - 1
        records, firsts = self._block(block)
        k = int(np.searchsorted(firsts, row, side="right")) - 1
        return block * self._block_shards + k, row - int(firsts[k]), int(records[k]["rows"])

    def _table_read(self, nbytes: int, offset: int) -> bytes:
        raw = self._file(TABLE).read_at(nbytes, offset)
        self.read_counters.reads += 1
        self.read_counters.bytes += len(raw)
        self.read_counters.table_bytes += len(raw)
        return raw

    def _block_directory(self) -> tuple[np.ndarray, np.ndarray]:
        """The table's block directory (after the records), checked against the manifest the first
        time a row is read: 40 bytes per block of shards."""
        directory = self._directory
        if directory is not None:
            return directory
        blocks = -(-self.shards // self._block_shards)
        raw = self._table_read(blocks * BLOCK_ENTRY.itemsize, self.shards * RECORD.itemsize)
        if hashlib.sha256(raw).hexdigest() != self._directory_sha256:
            raise self._changed(TABLE, "its block directory's sha256 is not the signed one")
        entries = np.frombuffer(raw, BLOCK_ENTRY)
        self._directory = (entries["first_row"].astype(np.int64), entries["sha256"])
        return self._directory

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `block` of the shard table (its records, their first rows), read by range and
        checked against the directory the first time it is touched."""
        with self._lock:
            if block in self._blocks:
                self._blocks.move_to_end(block)
                return self._blocks[block]
        _, sha256s = self._block_directory()
        start = block * self._block_shards
        count = min(self._block_shards, self.shards - start)
        raw = self._table_read(count * RECORD.itemsize, start * RECORD.itemsize)
        if hashlib.sha256(raw).digest() != sha256s[block].tobytes():
            raise self._changed(
                TABLE, f"block {block} (shards {start} to {start + count - 1})'s sha256 is not the signed one"
            )
        records = np.frombuffer(raw, RECORD)
        entry = (records, records["first_row"].astype(np.int64))
        with self._lock:
            self._blocks[block] = entry
            self._blocks_bytes += len(raw)
            while self._blocks_bytes > TABLE_CACHE_BYTES and len(self._blocks) > 1:
                _, (old, _) = self._blocks.popitem(last=False)
                self._blocks_bytes -= old.nbytes
        return entry

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The given rows, in that order: int32 [len(rows), planes, seq_len] (input_ids, labels,
        position_ids; twice for a pair). Consecutive rows of a shard are one read of their tokens
        (plus the shard's index and its table block the first time they are touched); each row is
        checked before use."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.planes, self.seq_len), dtype=np.int32)
        order = np.argsort(rows, kind="stable")
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and rows[order[j]] == rows[order[j - 1]] + 1:
                j += 1
            first = int(rows[order[i]])
            if first < 0 or first >= self.rows:
                raise IndexError(f"row {first} of a store of {self.rows} rows")
            shard, local, shard_rows = self._locate(first)
            end = min(j, i + shard_rows - local)
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
        name = shard_name(shard)
        raw = self._file(name + ".bin").read_at((hi - lo) * item, lo * item)
        self.read_counters.reads += 1
        self.read_counters.bytes += len(raw)
        words = np.frombuffer(raw, dtype=self.dtype)
        trained_bit, start_bit = flags(self.dtype)
        id_mask = start_bit - 1
        for k in range(n):
            a, b = int(offsets[(local + k) * s]) - lo, int(offsets[(local + k + 1) * s]) - lo
            row = words[a:b] if b <= len(words) else None
            if row is None or hashlib.blake2b(row.tobytes(), digest_size=DIGEST).digest() != digests[local + k]:
                raise self._changed(f"{name}.bin", f"row {local + k}'s tokens are not the signed ones")
            dest = out[targets[k]]
            for q in range(s):
                seq = local * s + k * s + q
                w = words[int(offsets[seq]) - lo : int(offsets[seq + 1]) - lo].astype(np.int64)
                length = len(w)
                ids, starts = w & id_mask, (w & start_bit) != 0
                at = np.arange(length)
                last = np.maximum.accumulate(np.where(starts, at, -1)) if length else at
                pos = np.where(last >= 0, at - last, int(first_pos[seq]) + at)
                plane = dest[q * PLANES : (q + 1) * PLANES]
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
        meta = self.shard(shard)
        name = meta["file"] + ".idx"
        try:
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                raw = f.read()
        except FileNotFoundError:
            raise JobError(
                f"refusing the token store {self.uri}: {name} is missing (deleted after it was prepared). "
                "Delete the folder to prepare it again"
            ) from None
        self.read_counters.reads += 1
        self.read_counters.bytes += len(raw)
        if hashlib.sha256(raw).hexdigest() != meta["index_sha256"]:
            raise self._changed(name, "its sha256 is not the signed one")
        sequences = meta["rows"] * self.sequences
        offsets = np.frombuffer(raw, np.uint64, sequences + 1)
        first_pos = np.frombuffer(raw, np.uint32, sequences, offset=8 * (sequences + 1))
        tail = raw[8 * (sequences + 1) + 4 * sequences :]
        digests = [tail[k * DIGEST : (k + 1) * DIGEST] for k in range(meta["rows"])]
        entry = (offsets, first_pos, digests)
        with self._lock:
            self._index[shard] = entry
            self._index_bytes += len(raw)
            while self._index_bytes > INDEX_CACHE_BYTES and len(self._index) > 1:
                _, old = self._index.popitem(last=False)
                self._index_bytes -= len(old[0]) * 8 + len(old[1]) * 4 + len(old[2]) * DIGEST
        return entry

    def _changed(self, name: str, why: str) -> JobError:
        return JobError(
            f"refusing the token store {self.uri}: {name} was changed after it was prepared ({why}). "
            "Delete the folder to prepare it again"
        )

    def _file(self, name: str):
        """`name`'s open file. At most OPEN_FILES stay open: a long run over a store of many shards
        reads each once an epoch, and one handle per shard ever read would exhaust the descriptors.
        The least recently read is let go, not closed: a read in the prefetch thread may still hold it,
        and the file closes when that read drops it."""
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
            else:
                try:
                    self._files[name] = self.fs.open_input_file(f"{self.path}/{name}")
                except FileNotFoundError:
                    raise JobError(
                        f"refusing the token store {self.uri}: {name} is missing (deleted after it was "
                        "prepared). Delete the folder to prepare it again"
                    ) from None
                while len(self._files) > OPEN_FILES:
                    self._files.popitem(last=False)
            return self._files[name]

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def describe(self) -> str:
        return (
            f"{self.uri} ({self.rows:,} rows of {self.seq_len} tokens from {len(self.manifest['sources'])} file(s), "
            f"{self.bad_rows} bad row(s) skipped)"
        )
