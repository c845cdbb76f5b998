"""A prepared token store: fixed-size rows in binary shards, and a manifest written last.

Layout under `<checkpoint.storage_path>/datasets/<key>/`:
  part-000000.bin ...  rows of int32 [input_ids | labels | position_ids], 12 x seq_len bytes each (a
                       preference pair: the chosen sequence's three planes, then the rejected one's), so row i
                       of a shard is at byte i x row_bytes: one ranged read per row (or run
                       of rows), local or on an object store, nothing else read to reach it
  manifest.json        rows, seq_len, the shards with their row ranges, sizes and sha256, the
                       key's inputs, the bad-row count and the first bad rows named; signed
                       (signing.py) and written last

A store without its manifest, or whose shards do not have the sizes the manifest says, is
never opened: `open()` returns None and the prepare step builds it again. A manifest whose
signature fails is refused, and so is a shard whose bytes are not the signed ones (the
driver hashes every shard when it reuses a store; a worker checks sizes and the signature).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from .. import signing, storage
from ..errors import JobError

MANIFEST = "manifest.json"
FORMAT_VERSION = 3  # 2: position ids stored with each row (documents packed without cross-talk); 3: signed
PLANES = 3  # input_ids, labels, position_ids (of each sequence in a row)


@dataclass
class ReadCounters:
    rows: int = 0
    bytes: int = 0
    reads: int = 0


class TokenStore:
    def __init__(self, uri: str, manifest: dict, fs: pafs.FileSystem, path: str):
        self.uri, self.manifest, self.fs, self.path = uri, manifest, fs, path
        self.key: str = manifest["key"]
        self.rows: int = manifest["rows"]
        self.seq_len: int = manifest["seq_len"]
        self.bad_rows: int = manifest["bad_rows"]
        self.planes: int = manifest.get("planes", PLANES)  # 6: a preference pair per row
        self.row_bytes = 4 * self.planes * self.seq_len
        self._first = np.array([s["first_row"] for s in manifest["shards"]], dtype=np.int64)
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()
        self.read_counters = ReadCounters()

    @classmethod
    def open(cls, uri: str) -> "TokenStore | None":
        """The complete store at `uri`, or None (absent, half-written, or not matching its manifest)."""
        fs, path = storage.filesystem(uri)
        try:
            with fs.open_input_stream(f"{path}/{MANIFEST}") as f:
                manifest = json.loads(f.read())
        except (FileNotFoundError, OSError, ValueError):
            return None
        if manifest.get("format_version") != FORMAT_VERSION:
            return None
        manifest = signing.verify_document(manifest, f"the token store {uri}/{MANIFEST}")
        signing.require_place(manifest, "key", uri.rstrip("/").rsplit("/", 1)[-1], f"the token store {uri}/{MANIFEST}")
        infos = fs.get_file_info([f"{path}/{s['file']}" for s in manifest["shards"]])
        row_bytes = 4 * manifest.get("planes", PLANES) * manifest["seq_len"]
        if any(i.type != pafs.FileType.File or i.size != s["rows"] * row_bytes for i, s in zip(infos, manifest["shards"])):
            return None
        return cls(uri, manifest, fs, path)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The given rows, in that order: int32 [len(rows), planes, seq_len] (input_ids, labels,
        position_ids; twice for a pair). Consecutive rows of a shard are one read; nothing else is read."""
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
            end = min(j, i + int(self._first[shard] + self.manifest["shards"][shard]["rows"] - first))
            raw = self._file(shard).read_at((end - i) * self.row_bytes, (first - self._first[shard]) * self.row_bytes)
            out[order[i:end]] = np.frombuffer(raw, dtype=np.int32).reshape(end - i, self.planes, self.seq_len)
            self.read_counters.reads += 1
            self.read_counters.bytes += len(raw)
            i = end
        self.read_counters.rows += len(rows)
        return out

    def _file(self, shard: int):
        with self._lock:
            if shard not in self._files:
                self._files[shard] = self.fs.open_input_file(f"{self.path}/{self.manifest['shards'][shard]['file']}")
            return self._files[shard]

    def verify_contents(self) -> None:
        """Every shard's bytes against the signed sha256 (reads the whole store once)."""
        for shard in self.manifest["shards"]:
            digest = hashlib.sha256()
            with self.fs.open_input_stream(f"{self.path}/{shard['file']}") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
            if digest.hexdigest() != shard["sha256"]:
                raise JobError(f"refusing the token store {self.uri}: {shard['file']} was changed after it was prepared "
                               "(its sha256 is not the signed one). Delete the folder to prepare it again")

    def describe(self) -> str:
        return (f"{self.uri} ({self.rows:,} rows of {self.seq_len} tokens from {len(self.manifest['sources'])} file(s), "
                f"{self.bad_rows} bad row(s) skipped)")


def write_manifest(fs: pafs.FileSystem, path: str, manifest: dict) -> None:
    """Last write of a prepare: to a temporary name, then moved into place (atomic locally,
    a single object on an object store), so a reader sees the whole manifest or none."""
    tmp = f"{path}/{MANIFEST}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(signing.sign_document({**manifest, "format_version": FORMAT_VERSION}), indent=1).encode())
    fs.move(tmp, f"{path}/{MANIFEST}")
