"""GRPO's prompt rows (`data.format: prompt`, `training.objective: grpo`): one source row -> the
prompt the workers complete, and the row's other columns, which the rewards read.

The shape is TRL's: a `prompt` column, a string (tokenized as written, as GRPOTrainer does) or a
list of messages (rendered by the tokenizer's chat template with the generation prompt), plus any
other columns (`solution`, `answer`, ...); `data.columns.prompt` maps another name. Rows users
already keep for SFT work too (`data.format: alpaca`, `sharegpt` or `chat` with the objective
grpo): the conversation up to its last assistant turn is the prompt, that turn's text the column
`answer` (the reference an `accuracy` reward reads), and the row's unmapped columns ride along.

A row is stored as two sequences (the store's rows are lists of sequences, as a pair's two):
  1. the prompt's tokens, flagged as labelled so its length survives the store's padding (a
     prompt is never trained: the objective labels only the sampled completion);
  2. the row's columns as UTF-8 JSON, a byte a token, flagged alike: {"prompt": the prompt as
     written, ...every other column}. The rewards get them back exactly (`columns_of`).
A prompt with no room for `max_completion_length` tokens in `data.seq_len`, or columns longer
than `data.seq_len` bytes, is a bad row. Pure functions, like records.py.
"""

from __future__ import annotations

import json

from raytrain.data.pairs import record_of
from raytrain.data.records import check_record, turn_messages
from raytrain.job.data import DataSpec

Sequence = tuple[list[int], list[int]]  # token ids, labels


def to_prompt(data: DataSpec, row) -> tuple[str | list[dict], dict]:
    """(the prompt, the row's columns as the rewards get them) of a source row."""
    record = record_of(row)
    if data.format != "prompt":
        return _from_conversation(data, record)
    column = data.column("prompt")
    value = record.get(column)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"column {column!r} (the prompt) is empty")
        prompt = value
    elif isinstance(value, list):
        prompt = turn_messages(
            data.model_copy(update={"columns": data.columns.model_copy(update={"messages": column})}), {column: value}
        )
        if prompt[-1]["role"] == "assistant":
            raise ValueError("the prompt must end with a user (or tool) turn: the completion answers it")
    else:
        raise ValueError(
            f"no {column!r} column (a string or a list of messages; data.columns.prompt maps another "
            f"name), got {type(value).__name__}"
        )
    return prompt, _fits(data, {**{k: v for k, v in record.items() if k != column}, "prompt": prompt})


def _from_conversation(data: DataSpec, record: dict) -> tuple[list[dict], dict]:
    """An SFT row (alpaca / sharegpt / chat) -> (its turns before the last assistant turn, its
    columns with that turn's text as `answer`). The columns the format maps are consumed."""
    messages = check_record(data, record)
    if messages[-1]["role"] != "assistant" or len(messages) < 2 or messages[-2]["role"] == "assistant":
        raise ValueError("the conversation must end with an assistant turn (the reference answer) after a prompt")
    prompt, answer = messages[:-1], messages[-1]["content"]
    mapped = {data.column(n) for n in ("prompt", "query", "response", "system", "history", "messages")}
    return prompt, _fits(
        data, {**{k: v for k, v in record.items() if k not in mapped}, "answer": answer, "prompt": prompt}
    )


def _fits(data: DataSpec, columns: dict) -> dict:
    size = len(stored_columns(columns))
    if size > data.seq_len:
        raise ValueError(
            f"the row's columns are {size} bytes of JSON, more than data.seq_len={data.seq_len} (they "
            "ride beside the prompt, a byte a token): drop the columns no reward reads, or raise seq_len"
        )
    return columns


def stored_columns(columns: dict) -> list[int]:
    """The columns sequence's tokens: the row's columns as compact UTF-8 JSON, a byte a token."""
    return list(json.dumps(columns, ensure_ascii=False, separators=(",", ":")).encode())


def encode_prompts(tok, data: DataSpec, rows: list, completion_room: int, conversational: bool = False) -> list:
    """Each row's (prompt, columns) sequences as the store keeps them, or the ValueError saying why
    it is unusable. `completion_room`: the tokens a completion may take (max_completion_length);
    `conversational`: only a list of messages will do (tools: the template renders them beside it)."""
    out = []
    texts, where = [], []
    for i, row in enumerate(rows):
        try:
            prompt, columns = to_prompt(data, row)
            if conversational and not isinstance(prompt, list):
                raise ValueError(
                    "the prompt is plain text: tools need a list of messages (the chat template renders both)"
                )
            if isinstance(prompt, list):
                try:
                    prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                except Exception as exc:  # the template's own refusal: this row is unusable
                    raise ValueError(f"the chat template rejects this prompt ({type(exc).__name__}: {exc})") from None
            out.append(stored_columns(columns))
            texts.append(prompt)
            where.append(i)
        except ValueError as why:
            out.append(why)
    ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    room = data.seq_len - completion_room
    for i, prompt_ids in zip(where, ids):
        if not prompt_ids:
            out[i] = ValueError("the prompt has no tokens")
        elif len(prompt_ids) > room:
            out[i] = ValueError(
                f"the prompt is {len(prompt_ids)} tokens: with max_completion_length="
                f"{completion_room} it does not fit data.seq_len={data.seq_len}; raise seq_len"
            )
        else:
            raw = out[i]
            out[i] = ((list(prompt_ids), list(prompt_ids)), (raw, raw))
    return out


def columns_of(tokens) -> dict:
    """A stored columns sequence (its real tokens, each a byte) -> the row's columns."""
    return json.loads(bytes(int(t) for t in tokens).decode())
