"""Preference rows (`training.objective: dpo | simpo`): one source row -> a prompt and two
responses, then two token sequences that share the prompt.

The shapes users already have, by `data.format`:
  text      TRL's standard shape: `prompt`, `chosen`, `rejected` strings
  chat      TRL's conversational shape: `prompt` a message list, `chosen`/`rejected` an
            assistant message (or a list of them, or a string); or its implicit-prompt shape:
            no `prompt`, `chosen`/`rejected` whole conversations that share the prompt turns
  alpaca    `instruction` (+ `input`, `system`, `history`) with `chosen`/`rejected` strings
  sharegpt  LLaMA-Factory's ranking shape: `conversations` holds the prompt turns,
            `chosen`/`rejected` one {from, value} message each
with the same `data.columns` / `data.tags` mapping as supervised rows.

Only the responses are labelled: the prompt is context, never trained. A pair whose prompt
plus either response is longer than `data.seq_len` is not truncated (a cut response would
compare two different things): it is a bad row, skipped and counted or fatal per
`data.bad_rows`.

A reward model's row (`training.objective: reward`) may carry TRL's `margin`, a number the
chosen score must beat the rejected one by (`-logsigmoid(r_c - r_r - margin)`); a row without
one has margin 0. It is stored as a third sequence, a tag of three tokens holding the margin's
float32 bits (`margin_tag`), as a KTO row stores its label. Pure functions, like records.py.
"""

from __future__ import annotations

import struct

from raytrain.data.records import (
    IGNORE,
    alpaca_messages,
    chat_steps,
    check_messages,
    decode_line,
    run_batch,
    run_one,
    turn_messages,
)
from raytrain.job.data import DataSpec

Sequence = tuple[list[int], list[int]]  # token ids, labels


def to_pair(data: DataSpec, row) -> tuple[str | list, object, object]:
    """(prompt, chosen, rejected) of a row: strings for `text`, messages for the others."""
    record = record_of(row)
    chosen, rejected = (record.get(data.column(k)) for k in ("chosen", "rejected"))
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise ValueError(
                f"no {data.column(name)!r} column ({name} response of a preference pair; "
                f"data.columns.{name} maps another name)"
            )
    if data.format == "text":
        return (
            text_prompt(data, record),
            text_column(chosen, data.column("chosen")),
            text_column(rejected, data.column("rejected")),
        )
    if data.format == "chat" and data.column("prompt") not in record:
        record, chosen, rejected = _implicit_prompt(data, record, chosen, rejected)
    prompt = prompt_messages(data, record)
    return prompt, response_messages(data, chosen, "chosen"), response_messages(data, rejected, "rejected")


def record_of(row) -> dict:
    """A source row (a raw JSON Lines line, or a decoded object) as the JSON object it must be."""
    record = decode_line(row) if isinstance(row, (bytes, str)) else row
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def text_prompt(data: DataSpec, record: dict) -> str:
    prompt = record.get(data.column("prompt"))
    if not isinstance(prompt, str):
        raise ValueError(f"column {data.column('prompt')!r} (the prompt) must be a string, got {type(prompt).__name__}")
    return prompt


def _implicit_prompt(data: DataSpec, record: dict, chosen, rejected):
    """TRL's implicit-prompt shape (UltraFeedback, HH-RLHF): no prompt column; `chosen` and
    `rejected` are whole conversations, and the prompt is the turns they share."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise ValueError(
            f"no {data.column('prompt')!r} column, and {data.column('chosen')!r}/"
            f"{data.column('rejected')!r} are not whole conversations sharing their first turns"
        )
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return {**record, data.column("prompt"): chosen[:shared]}, chosen[shared:], rejected[shared:]


def text_column(value, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"column {column!r} must be a non-empty string, got {str(value)[:60]!r}")
    return value


def prompt_messages(data: DataSpec, record: dict) -> list[dict]:
    if data.format == "alpaca":
        messages = alpaca_messages(data, {**record, data.column("response"): ""})[
            :-1
        ]  # the pair's responses come after
    elif data.format == "sharegpt":
        messages = turn_messages(data, record)
    else:  # chat: TRL's conversational `prompt` column
        messages = turn_messages(
            data.model_copy(update={"columns": data.columns.model_copy(update={"messages": data.column("prompt")})}),
            record,
        )
    system = record.get(data.column("system")) if data.column("system") else None
    if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    if not messages or messages[-1]["role"] == "assistant":
        raise ValueError("the prompt must end with a user (or tool) turn: the responses answer it")
    return messages


def response_messages(data: DataSpec, value, name: str) -> list[dict]:
    """A response as assistant messages: a string, one turn, or a list of turns."""
    if isinstance(value, str):
        turns = [{"role": "assistant", "content": value}]
    else:
        items = value if isinstance(value, list) else [value]
        column = data.column(name)
        turns = turn_messages(
            data.model_copy(update={"columns": data.columns.model_copy(update={"messages": column})}), {column: items}
        )
    if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        raise ValueError(f"the {name} response has no assistant text")
    return turns


def encode_pair(tok, data: DataSpec, row, margins: bool = False) -> tuple[Sequence, ...]:
    """A preference row -> (chosen, rejected) sequences; labels on the response tokens only
    (`margins`: and its margin tag)."""
    return run_one(tok, pair_steps(tok, data, row, tok.eos_token_id, margins))


def encode_pairs(tok, data: DataSpec, rows: list, margins: bool = False) -> list:
    """`encode_pair` of each row, tokenized as one batch (records.run_batch): each pair, or its
    ValueError. `margins` (a reward model's rows): each pair with its margin tag as a third sequence."""
    eos = tok.eos_token_id  # once: transformers' special-token attributes cost microseconds a lookup
    return run_batch(tok, [pair_steps(tok, data, row, eos, margins) for row in rows])


MARGIN_TAG_BITS = 11  # a float32's 32 bits in 3 tokens under 2**11: below any store's token limit (2**14)
FLOAT32_MAX = 3.4028234663852886e38  # a margin is stored as a float32, as TRL's collator makes it


def to_margin(data: DataSpec, record: dict) -> float:
    """A reward row's margin (TRL's `margin` column; data.columns.margin maps another name), 0 without one."""
    value = record.get(data.column("margin"))
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= FLOAT32_MAX:
        raise ValueError(
            f"column {data.column('margin')!r} (the pair's margin) must be a finite number, got {str(value)[:40]!r}"
        )
    return float(value)  # host: a JSON number from the row


def margin_tag(margin: float) -> list[int]:
    """The tag sequence's tokens: the margin's float32 bits, MARGIN_TAG_BITS a token, high first
    (objectives.pairs.margins_of reads them back, bit for bit)."""
    bits = struct.unpack("<I", struct.pack("<f", margin))[0]
    mask = (1 << MARGIN_TAG_BITS) - 1
    return [bits >> 2 * MARGIN_TAG_BITS, (bits >> MARGIN_TAG_BITS) & mask, bits & mask]


def pair_steps(tok, data: DataSpec, row, eos: int, margins: bool = False):
    row = record_of(row)
    margin = to_margin(data, row) if margins else None
    prompt, chosen, rejected = to_pair(data, row)
    if data.format == "text":
        (head, _), *tails = yield [(prompt, True, False), (chosen, False, False), (rejected, False, False)]
        pair = tuple((head + tail + [eos], [IGNORE] * len(head) + tail + [eos]) for tail, _ in tails)
    else:
        check_messages([*prompt, *chosen])
        pair = []  # chosen first, then rejected: a row's first problem is the one it reports
        for response in (chosen, rejected):
            pair.append((yield from chat_steps(tok, [*prompt, *response], first_trained=len(prompt))))
        pair = tuple(pair)
    for name, (ids, labels) in zip(("chosen", "rejected"), pair):
        if len(ids) > data.seq_len:
            raise ValueError(
                f"prompt + {name} response is {len(ids)} tokens, longer than data.seq_len={data.seq_len} "
                "(pairs are never truncated: raise seq_len)"
            )
        if all(label == IGNORE for label in labels):
            raise ValueError(f"the {name} response has no tokens to compare")
    return pair if margin is None else (*pair, (margin_tag(margin), [IGNORE] * 3))
