"""One source row -> token ids and labels: the format rules, and packing.

Pure functions (no Ray, no torch): the prepare step applies them to every row, pre-flight
to the first rows of each source, and the tests to hand-made rows. A row the job cannot
train on raises ValueError saying why; the caller names the file and the row.
"""

from __future__ import annotations

import json

import numpy as np

from ..config import DataSpec

IGNORE = -100
CHAT_ROLES = {"system", "user", "assistant", "tool"}


def to_value(data: DataSpec, row) -> str | list:
    """A source row as `sources.read_unit` gives it (a raw JSON Lines line, or an object
    decoded from a JSON array or parquet) -> the text or messages the format needs."""
    return parse_record(data, row) if isinstance(row, (bytes, str)) else check_record(data, row)


def parse_record(data: DataSpec, raw: bytes | str):
    """One raw JSON Lines line -> the text (str) or messages (list) the format needs."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start} of the line)") from None
    if not raw.strip():
        raise ValueError("empty line")
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    return check_record(data, record)


def check_record(data: DataSpec, record) -> str | list:
    """A decoded row (a JSON object, a parquet row) -> the text or messages the format needs."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if data.format == "text":
        return check_text(record.get(data.text_column, None), data)
    return check_messages(record.get(data.messages_column, None), data)


def encode_row(tok, data: DataSpec, row) -> tuple[list[int], list[int]]:
    """A source row -> (token ids, labels); ValueError says why the row is unusable."""
    value = to_value(data, row)
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
