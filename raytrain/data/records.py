"""One source row -> token ids, labels and positions: the format rules, and packing.

Pure functions (no Ray, no torch): the prepare step applies them to every row, pre-flight
to the first rows of each source, the tests to hand-made rows. A row the job cannot train
on raises ValueError saying why; the caller names the file and the row.

Every format but `text` becomes OpenAI-style messages, rendered once by the tokenizer's own
chat template. The assistant turns are then located in that one rendering (each turn's
content found in order, plus the end-of-turn token the template puts right after it) and
mapped to tokens through the tokenizer's offsets: nothing is re-rendered prefix by prefix,
so a template that rewrites earlier turns or injects text cannot shift a label. A turn the
template does not render as written, or a token that straddles template text and content,
makes the row refused with the reason.
"""

from __future__ import annotations

import json
import re

import numpy as np

from raytrain.job.data import DataSpec

IGNORE = -100
CHAT_ROLES = {"system", "user", "assistant", "tool"}


def to_value(data: DataSpec, row) -> str | list:
    """A source row as `sources.read_unit` gives it (a raw JSON Lines line, or an object
    decoded from a JSON array or parquet) -> the text or messages the format needs."""
    return parse_record(data, row) if isinstance(row, (bytes, str)) else check_record(data, row)


def parse_record(data: DataSpec, raw: bytes | str):
    """One raw JSON Lines line -> the text (str) or messages (list) the format needs."""
    return check_record(data, decode_line(raw))


def decode_line(raw: bytes | str):
    """One raw JSON Lines line -> the decoded JSON value."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start} of the line)") from None
    if not raw.strip():
        raise ValueError("empty line")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def check_record(data: DataSpec, record) -> str | list:
    """A decoded row -> the text (`text`) or the messages (every other format)."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if data.format == "text":
        return check_text(record.get(data.column("text")), data.column("text"))
    messages = {"chat": turn_messages, "sharegpt": turn_messages, "alpaca": alpaca_messages}[data.format](data, record)
    system = record.get(data.column("system")) if data.column("system") else None
    if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return check_messages(messages)


def _string(record: dict, column: str | None, what: str, required: bool = True) -> str:
    value = record.get(column) if column else None
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"column {column!r} ({what}) must be a string, got {type(value).__name__}")
    return value


def alpaca_messages(data: DataSpec, record: dict) -> list[dict]:
    """instruction (+ "\\n" + input) -> user, output -> assistant, after the history pairs."""
    messages = []
    history = record.get(data.column("history")) or []
    if not isinstance(history, list) or not all(isinstance(p, list) and len(p) == 2 for p in history):
        raise ValueError(f"column {data.column('history')!r} must be a list of [query, response] pairs")
    for query, response in history:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
    prompt = _string(record, data.column("prompt"), "the instruction")
    query = _string(record, data.column("query"), "the input", required=False)
    messages.append({"role": "user", "content": f"{prompt}\n{query}" if query.strip() else prompt})
    messages.append({"role": "assistant", "content": _string(record, data.column("response"), "the response")})
    return messages


def turn_messages(data: DataSpec, record: dict) -> list[dict]:
    """chat / sharegpt turns -> messages with the template's roles (system, user, assistant, tool)."""
    column, role_key, content_key = data.column("messages"), data.tag("role_tag"), data.tag("content_tag")
    turns = record.get(column)
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"column {column!r} must be a non-empty list of turns")
    roles = {
        data.tag("user_tag"): "user",
        data.tag("assistant_tag"): "assistant",
        data.tag("system_tag"): "system",
        data.tag("observation_tag"): "tool",
        data.tag("function_tag"): "assistant",
    }
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get(role_key) not in roles or not isinstance(turn.get(content_key), str):
            raise ValueError(
                f"turn {i} must be {{{role_key}: one of {sorted(r for r in roles if r)}, {content_key}: "
                f"string}}, got {str(turn)[:80]} (data.tags maps other keys and role names)"
            )
        messages.append({"role": roles[turn[role_key]], "content": turn[content_key]})
    return messages


def check_text(text, column: str = "text") -> str:
    if not isinstance(text, str):
        raise ValueError(f"column {column!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"column {column!r} is empty")
    return text


def check_messages(messages: list) -> list:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"message {i} must be {{role: one of {sorted(CHAT_ROLES)}, content: string}}, got {str(m)[:80]}"
            )
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError("no assistant message with content: nothing to train on")
    return messages


# ---------------------------------------------------------------- tokens
# Each row's encoding is a generator of the format rules: it yields the texts it needs tokenized,
# as [(text, add_special_tokens, offsets), ...], receives their [(ids, offsets or None), ...] and
# returns (ids, labels), or raises ValueError saying why the row is unusable. `encode_row` runs one,
# tokenizing text by text; `encode_rows` runs a batch of them in lockstep and tokenizes what they all
# ask for in one tokenizer call per kind of request: one set of rules, so a batch gives each row
# exactly what it gets alone, at the tokenizer's batch speed (its per-call cost is most of a short row's).
Ask = tuple[str, bool, bool]  # text, add_special_tokens, with character offsets


def encode_row(tok, data: DataSpec, row) -> tuple[list[int], list[int]]:
    """A source row -> (token ids, labels); ValueError says why the row is unusable."""
    return run_one(tok, row_steps(tok, data, row, tok.eos_token_id))


def encode_rows(tok, data: DataSpec, rows: list) -> list:
    """`encode_row` of each row, tokenized as one batch: each (ids, labels), or the ValueError it raises."""
    eos = tok.eos_token_id  # once: transformers' special-token attributes cost microseconds a lookup
    return run_batch(tok, [row_steps(tok, data, row, eos) for row in rows])


def row_steps(tok, data: DataSpec, row, eos: int):
    value = to_value(data, row)
    if data.format == "text":
        ids, labels = yield from text_steps(value, eos)  # checked by to_value
    else:
        ids, labels = yield from chat_steps(tok, value, data.train_on_inputs)
    if not data.pack and len(ids) > data.seq_len:
        raise ValueError(
            f"{len(ids)} tokens, longer than data.seq_len={data.seq_len} (raise seq_len or set data.pack: true)"
        )
    return ids, labels


def encode_text(tok, text: str) -> tuple[list[int], list[int]]:
    return run_one(tok, text_steps(check_text(text), tok.eos_token_id))


def text_steps(text: str, eos: int):
    [(ids, _)] = yield [(text, True, False)]
    ids = ids + [eos]
    return ids, list(ids)


def encode_chat(
    tok, messages: list, train_on_inputs: bool = False, first_trained: int = 0
) -> tuple[list[int], list[int]]:
    """The conversation rendered once; labels on each assistant turn's content and the
    end-of-turn token after it (everything, with `train_on_inputs`), from message
    `first_trained` on (a preference pair's response: its prompt's turns are never trained)."""
    return run_one(tok, chat_steps(tok, messages, train_on_inputs, first_trained))


def chat_steps(tok, messages: list, train_on_inputs: bool = False, first_trained: int = 0):
    check_messages(messages)
    try:
        text = tok.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # the template's own refusal (jinja's raise_exception): this row is unusable
        raise ValueError(f"the chat template rejects this conversation ({type(exc).__name__}: {exc})") from None
    [(ids, offsets)] = yield [(text, False, not train_on_inputs)]
    ids = list(ids)
    if train_on_inputs:
        return ids, list(ids)
    labels = [IGNORE] * len(ids)
    for start, end in assistant_spans(tok, text, messages)[first_trained:]:
        for t, (a, b) in enumerate(offsets):
            if b <= start or a >= end:
                continue
            outside = text[a : max(a, min(b, start))] + text[max(a, end) : b] if (a < start or b > end) else ""
            if outside.strip():
                raise ValueError(
                    f"token {tok.convert_ids_to_tokens(ids[t])!r} spans template text {outside!r} and an "
                    "assistant turn: the tokenizer merges across the turn's boundary, so its labels would be "
                    "ambiguous"
                )
            labels[t] = ids[t]
    return ids, labels


def run_one(tok, steps):
    """Run one encoding generator, tokenizing each text it asks for on its own."""
    try:
        asked = next(steps)
        while True:
            got = [_tokenize_one(tok, *ask) for ask in asked]
            failed = next((g for g in got if isinstance(g, Exception)), None)
            asked = steps.throw(failed) if failed else steps.send(got)
    except StopIteration as done:
        return done.value


def run_batch(tok, steps: list) -> list:
    """Run encoding generators in lockstep: each round tokenizes every text they ask for in one
    call per (add_special_tokens, offsets). Each generator's result, or the ValueError it raised."""
    results: list = [None] * len(steps)
    asked: list[tuple[int, list[Ask]]] = []

    def advance(i: int, got=None, failed=None) -> None:
        try:
            asks = steps[i].throw(failed) if failed else steps[i].send(got)
        except StopIteration as done:
            results[i] = done.value
        except ValueError as why:
            results[i] = why
        else:
            asked.append((i, asks))

    for i in range(len(steps)):
        advance(i)
    while asked:
        now, asked = asked, []
        encoded, refused = _tokenize_all(tok, [ask for _, asks in now for ask in asks])
        k = 0
        for i, asks in now:
            got, k = encoded[k : k + len(asks)], k + len(asks)
            advance(i, got, refused and next((g for g in got if isinstance(g, Exception)), None))
    return results


def _tokenize_all(tok, asks: list[Ask]) -> tuple[list, bool]:
    """Each ask's (ids, offsets or None), one tokenizer call per kind of ask; a text the tokenizer
    refuses fails only its own row (then the second value is True)."""
    out, refused, kinds = [None] * len(asks), False, {}
    for k, (_, special, offsets) in enumerate(asks):
        kinds.setdefault((special, offsets), []).append(k)
    for (special, offsets), ks in kinds.items():
        texts = [asks[k][0] for k in ks]
        try:
            enc = tok(
                texts,
                add_special_tokens=special,
                return_offsets_mapping=offsets,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            got = zip(enc["input_ids"], enc["offset_mapping"] if offsets else [None] * len(ks))
        except Exception:  # e.g. a lone surrogate: each text alone, so only its row fails
            got, refused = [_tokenize_one(tok, text, special, offsets) for text in texts], True
        for k, one in zip(ks, got):
            out[k] = one
    return out, refused


def _tokenize_one(tok, text: str, special: bool, offsets: bool):
    """(ids, offsets or None) of one text, or the ValueError that makes its row unusable."""
    try:
        enc = tok(
            text,
            add_special_tokens=special,
            return_offsets_mapping=offsets,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
    except TypeError:  # the tokenizer's only word for a lone surrogate (JSON's "\ud800" decodes to one)
        bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is None:
            raise
        return ValueError(f"not valid Unicode text (a lone surrogate \\u{ord(text[bad]):04x} at character {bad})")
    return enc["input_ids"], enc["offset_mapping"] if offsets else None


def assistant_spans(tok, text: str, messages: list) -> list[tuple[int, int]]:
    """Character spans of each assistant turn in the rendering, one entry per message (empty
    for other turns): its content, found after the previous turn's, plus the special token
    the template closes the turn with."""
    # The tokens that close a turn (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, the eos), not
    # those that open the next one.
    names = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    specials = sorted(
        {t for t in names if t and (t == tok.eos_token or re.search(r"end|eot|</s>", t, re.I))}, key=len, reverse=True
    )
    closer = re.compile(r"[ \t]*(?:" + "|".join(map(re.escape, specials)) + ")") if specials else None
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m["content"].strip()
        at = text.find(content, cursor) if content else -1
        if at < 0:
            spans.append((0, 0))
            if m["role"] == "assistant" and content:
                raise ValueError(
                    f"the chat template does not render assistant turn {i} as written (it rewrites or drops "
                    "it, as templates that strip earlier reasoning do), so its tokens cannot be located; "
                    "keep such turns out of the data or set data.train_on_inputs: true"
                )
            continue
        end = at + len(content)
        if m["role"] == "assistant":
            close = closer.match(text, end) if closer else None
            spans.append((at, close.end() if close else end))
        else:
            spans.append((0, 0))
        cursor = end
    return spans


def document_positions(lengths: list[int]) -> np.ndarray:
    """Position ids restarting at 0 for each document: where a position does not step by one, a
    new document starts (masks.py), and attention never crosses it."""
    if not lengths:
        return np.zeros(0, np.int32)
    starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    return (np.arange(sum(lengths)) - starts).astype(np.int32)


def pack(docs, seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate documents into full rows; the tail becomes one padded row (nothing
    dropped). Returns ids, labels and per-document positions, [rows, seq_len] each."""
    if not docs:
        return tuple(np.zeros((0, seq_len), np.int32) for _ in range(3))
    lengths = [len(d[0]) for d in docs]
    ids = np.concatenate([np.asarray(d[0], np.int32) for d in docs])
    labels = np.concatenate([np.asarray(d[1], np.int32) for d in docs])
    rows = -(-len(ids) // seq_len)
    tail = rows * seq_len - len(ids)
    out_ids = np.concatenate([ids, np.full(tail, pad, np.int32)])
    out_labels = np.concatenate([labels, np.full(tail, IGNORE, np.int32)])
    pos = document_positions(lengths)  # padding continues the last document (masks.py): never one of its own
    out_pos = np.concatenate([pos, pos[-1] + 1 + np.arange(tail, dtype=np.int32)])
    return tuple(a.reshape(rows, seq_len) for a in (out_ids, out_labels, out_pos))


def pad_rows(docs, seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out_ids = np.full((len(docs), seq_len), pad, np.int32)
    out_labels = np.full((len(docs), seq_len), IGNORE, np.int32)
    out_pos = np.zeros((len(docs), seq_len), np.int32)
    for i, (ids, labels) in enumerate(docs):
        out_ids[i, : len(ids)], out_labels[i, : len(labels)] = ids, labels
        out_pos[i] = np.arange(seq_len)  # one document; its padding continues its positions (masks.py)
    return out_ids, out_labels, out_pos
