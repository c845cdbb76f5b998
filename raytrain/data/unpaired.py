"""Unpaired feedback rows (`training.objective: kto`): one row -> a prompt, one completion and a
label (desirable or not), as TRL's KTOTrainer and LLaMA-Factory's `kto_tag` read them.

The shapes users already have, by `data.format`:
  text      TRL's standard unpaired shape: `prompt` and `completion` strings, `label`
  chat      TRL's conversational shape: `prompt` a message list, `completion` the assistant's
            message(s); or LLaMA-Factory's kto_en_demo.json: `messages` whose last turn is the
            assistant's completion. Both with `label`
  alpaca    `instruction` (+ `input`, `system`, `history`), `output` the completion, `label`
  sharegpt  `conversations` whose last turn is the completion, `label`
`data.columns.label` names the label column (LLaMA-Factory's `kto_tag`); it must be true or false.

A row is stored as three sequences (the store's rows are lists of sequences, as a pair's two):
  1. the example, its completion labelled (the prompt is context, never trained);
  2. the KL sequence: its prompt with another row's completion, the mismatched pair TRL's
     KTOTrainer estimates KL(policy || reference) from. A row's partner is the row before it
     among the usable rows of its tokenization batch (the first takes the last's), as TRL shifts
     completions by one within a batch: a fixed pairing, whatever the worker count;
  3. a one-token tag: the label, 1 desirable, 0 undesirable.
Pure functions, like records.py and pairs.py.
"""

from __future__ import annotations

from raytrain.data.pairs import prompt_messages, record_of, response_messages, text_column, text_prompt
from raytrain.data.records import IGNORE, chat_steps, check_messages, run_batch, turn_messages
from raytrain.job.data import DataSpec

Sequence = tuple[list[int], list[int]]  # token ids, labels


def to_unpaired(data: DataSpec, row) -> tuple[str | list, str | list, bool]:
    """(prompt, completion, label) of a row: strings for `text`, messages for the others."""
    record = record_of(row)
    label = record.get(data.column("label"))
    if not isinstance(label, bool):
        raise ValueError(
            f"column {data.column('label')!r} (the row's label) must be true (desirable) or false "
            f"(undesirable), got {str(label)[:40]!r}; data.columns.label maps another name"
        )
    if data.format == "text":
        return (
            text_prompt(data, record),
            text_column(record.get(data.column("completion")), data.column("completion")),
            label,
        )
    if data.format == "chat" and data.column("completion") in record:  # TRL's conversational shape
        return (
            prompt_messages(data, record),
            response_messages(data, record[data.column("completion")], "completion"),
            label,
        )
    if data.format == "alpaca":
        prompt = prompt_messages(data, record)
        return prompt, response_messages(data, record.get(data.column("response")) or "", "response"), label
    turns = turn_messages(
        data, record
    )  # chat's `messages` / sharegpt's `conversations`: the last turn is the completion
    if turns[-1]["role"] != "assistant":
        raise ValueError("the last turn must be the assistant's: it is the completion the label judges")
    return turns[:-1], turns[-1:], label


def encode_unpaired(tok, data: DataSpec, rows: list) -> list:
    """Each row's (example, KL sequence, label tag) as the store keeps them, or the ValueError
    saying why it is unusable; the rows of one call are one tokenization batch (their KL partners)."""
    eos = tok.eos_token_id
    encoded = run_batch(tok, [_steps(tok, data, row, eos) for row in rows])
    usable = [i for i, e in enumerate(encoded) if not isinstance(e, ValueError)]
    out = list(encoded)
    for k, i in enumerate(usable):
        (ids, labels), label = encoded[i]
        (other_ids, other_labels), _ = encoded[usable[k - 1]]
        head, other = _first_trained(labels), _first_trained(other_labels)
        kl = (ids[:head] + other_ids[other:])[: data.seq_len], ([IGNORE] * head + other_labels[other:])[: data.seq_len]
        out[i] = ((ids, labels), kl, ([int(label)], [IGNORE]))
    return out


def _first_trained(labels: list[int]) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE)


def _steps(tok, data: DataSpec, row, eos: int):
    prompt, completion, label = to_unpaired(data, row)
    if data.format == "text":
        (head, _), (tail, _) = yield [(prompt, True, False), (completion, False, False)]
        ids, labels = head + tail + [eos], [IGNORE] * len(head) + tail + [eos]
    else:
        check_messages([*prompt, *completion])
        ids, labels = yield from chat_steps(tok, [*prompt, *completion], first_trained=len(prompt))
    if len(ids) > data.seq_len:
        raise ValueError(
            f"prompt + completion is {len(ids)} tokens, longer than data.seq_len={data.seq_len} "
            "(a completion is never truncated: raise seq_len)"
        )
    if all(t == IGNORE for t in labels):
        raise ValueError("the completion has no tokens to train")
    return (ids, labels), label
