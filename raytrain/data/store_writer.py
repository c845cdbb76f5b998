"""Writing a token store (its format is store.py's): packed rows into shards, then the shard
table and the signed manifest, last, so a reader sees the whole store or none."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.fs as pafs

from raytrain.data.records import IGNORE, document_positions
from raytrain.data.store import BLOCK_ENTRY, DIGEST, FORMAT_VERSION, MANIFEST, RECORD, TABLE, flags, shard_name
from raytrain.rundir import signing

TABLE_BLOCK = 1024  # shards a block of the table: what a reader reads and checks at once (56 KiB; the manifest says)


def encode_shard(
    rows: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]], dtype: np.dtype
) -> tuple[bytes, bytes, int]:
    """Rows, each a list of sequences (ids, labels, positions as packing laid them out, padding
    already cut off) -> (.bin bytes, .idx bytes, tokens). A label is either the token or IGNORE:
    anything else cannot be stored as a flag, so it is refused here, at prepare."""
    trained_bit, start_bit = flags(dtype)
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
    index = np.asarray(offsets, np.uint64).tobytes() + np.asarray(first_pos, np.uint32).tobytes() + b"".join(digests)
    return data, index, at


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
    labels = np.concatenate([np.asarray(lab, np.int64) for _, lab in docs])
    pos = document_positions([len(i) for i, _ in docs])
    return [
        [(ids[a : a + seq_len], labels[a : a + seq_len], pos[a : a + seq_len])] for a in range(0, len(ids), seq_len)
    ]


def write_shard(out_fs: pafs.FileSystem, out_path: str, name: str, rows, dtype: np.dtype) -> dict:
    """One shard's .bin and .idx (see `encode_shard`); the manifest's entry for it, less first_row."""
    data, index, tokens = encode_shard(rows, dtype)
    for suffix, payload in ((".bin", data), (".idx", index)):
        with out_fs.open_output_stream(f"{out_path}/{name}{suffix}") as f:
            f.write(payload)
    return {"file": name, "rows": len(rows), "tokens": tokens, "index_sha256": hashlib.sha256(index).hexdigest()}


def write_table(fs: pafs.FileSystem, path: str, shards: list[dict], block_shards: int | None = None) -> dict:
    """shards.tbl from the shards' entries (`write_shard`'s, with first_row; shard i's file must be
    `shard_name(i)`); the manifest's summary of it, whose directory sha256 binds every record."""
    block_shards = block_shards or TABLE_BLOCK
    records = np.zeros(len(shards), RECORD)
    row = 0
    for i, s in enumerate(shards):
        if s["file"] != shard_name(i) or s["first_row"] != row:
            raise ValueError(
                f"shard {i} is {s['file']} from row {s['first_row']}: the table needs {shard_name(i)} "
                f"from row {row} (the shards in order, each named by its number)"
            )
        records[i] = (s["first_row"], s["rows"], s["tokens"], np.frombuffer(bytes.fromhex(s["index_sha256"]), np.uint8))
        row += s["rows"]
    directory = np.zeros(-(-len(shards) // block_shards), BLOCK_ENTRY)
    for b in range(len(directory)):
        block = records[b * block_shards : (b + 1) * block_shards]
        directory[b] = (block["first_row"][0], np.frombuffer(hashlib.sha256(block.tobytes()).digest(), np.uint8))
    with fs.open_output_stream(f"{path}/{TABLE}") as f:
        f.write(records.tobytes())
        f.write(directory.tobytes())
    return {
        "shards": len(shards),
        "block_shards": block_shards,
        "directory_sha256": hashlib.sha256(directory.tobytes()).hexdigest(),
    }


def write_manifest(fs: pafs.FileSystem, path: str, manifest: dict) -> None:
    """The last writes of a prepare: the shard table (`manifest["shards"]`, see `write_table`),
    then the manifest with the table's summary in place of the list, to a temporary name, then
    moved into place (atomic locally, a single object on an object store), so a reader sees the
    whole store or none."""
    doc = {k: v for k, v in manifest.items() if k != "shards"}
    doc["shard_table"] = write_table(fs, path, manifest["shards"])
    tmp = f"{path}/{MANIFEST}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(signing.sign_document({**doc, "format_version": FORMAT_VERSION}), indent=1).encode())
    fs.move(tmp, f"{path}/{MANIFEST}")
