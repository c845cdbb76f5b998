"""`data`: where the rows are, their shape and how they become training rows. Pure pydantic:
`raytrain validate` reads it without torch; config.JobSpec holds it as its `data` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raytrain.job.section import Section

# The dataset shapes users already write, with LLaMA-Factory's names and defaults (its
# `dataset_info.json` "columns" and "tags"), so its dataset files work without a mapping.
# Preference rows (`training.objective: dpo | simpo`) add `chosen` and `rejected`: TRL's standard
# and conversational shapes for text and chat, LLaMA-Factory's ranking shapes for alpaca and sharegpt.
# Unpaired feedback rows (`training.objective: kto`) add `completion` (text/chat) and `label`.
PAIR = {"chosen": "chosen", "rejected": "rejected", "completion": "completion", "label": "label", "margin": "margin"}
DEFAULT_COLUMNS = {
    "text": {"text": "text", "prompt": "prompt", **PAIR},
    "chat": {"messages": "messages", "system": "system", "prompt": "prompt", **PAIR},
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
        **PAIR,
    },
    "sharegpt": {"messages": "conversations", "system": "system", **PAIR},
    "prompt": {"prompt": "prompt"},  # GRPO: prompts only, the other columns go to the rewards
}
DEFAULT_TAGS = {
    "chat": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
        "observation_tag": "tool",
        "function_tag": "function_call",
    },
    "sharegpt": {
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "system_tag": "system",
        "observation_tag": "observation",
        "function_tag": "function_call",
    },
}
DEFAULT_TAGS["prompt"] = DEFAULT_TAGS["chat"]  # GRPO's conversational prompts: TRL's messages


class ColumnsSpec(Section):
    """Column names, as LLaMA-Factory's dataset_info.json `columns` names them; unset ones take the format's default."""

    text: str | None = None
    """`text`: the text column (default `text`)."""
    messages: str | None = None
    """`chat`/`sharegpt`: the list of turns (default `messages` / `conversations`)."""
    prompt: str | None = None
    """`alpaca`: the instruction (default `instruction`). Preference rows in `text`/`chat`: the prompt string or message
    list (default `prompt`)."""
    query: str | None = None
    """`alpaca`: the input, appended to the instruction after a newline (default `input`)."""
    response: str | None = None
    """`alpaca`: the answer (default `output`)."""
    history: str | None = None
    """`alpaca`: earlier [query, response] pairs (default `history`)."""
    system: str | None = None
    """A system prompt column (default `system`); used when present in a row."""
    chosen: str | None = None
    """Preference rows: the preferred response (default `chosen`): a string, or for chat/sharegpt a message or list of
    messages."""
    rejected: str | None = None
    """Preference rows: the dispreferred response (default `rejected`), shaped like `chosen`."""
    completion: str | None = None
    """KTO rows in `text`/`chat`: the completion the label judges (default `completion`; without it in a chat row, the
    last turn of `messages`)."""
    label: str | None = None
    """KTO rows: true (desirable) or false (default `label`, TRL's name; LLaMA-Factory's `kto_tag`)."""
    margin: str | None = None
    """Reward-model rows: how much the chosen score must beat the rejected one by (default `margin`, TRL's name); 0 in a
    row without it."""


class TagsSpec(Section):
    """Keys and role names inside each turn, as LLaMA-Factory's `tags`; unset ones take the format's default."""

    role_tag: str | None = None
    """Key of a turn's role (`role` for chat, `from` for sharegpt)."""
    content_tag: str | None = None
    """Key of a turn's text (`content` / `value`)."""
    user_tag: str | None = None
    """Role name of the user (`user` / `human`)."""
    assistant_tag: str | None = None
    """Role name of the model (`assistant` / `gpt`); these turns are trained on."""
    system_tag: str | None = None
    """Role name of a system turn (`system`)."""
    observation_tag: str | None = None
    """Role name of a tool result (`tool` / `observation`); given to the template as a `tool` turn."""
    function_tag: str | None = None
    """Role name of a tool call by the model (`function_call`); an assistant turn, trained on."""


class SourceSpec(Section):
    path: str
    """A file, folder or glob, as `data.path`."""
    format: Literal["text", "chat", "alpaca", "sharegpt", "prompt"] | None = None
    """This source's format; default `data.format`."""
    weight: float = Field(1.0, gt=0)
    """Share of the training rows drawn from this source (weights are relative: 3 and 1 mix 3:1)."""
    columns: ColumnsSpec = ColumnsSpec()
    """This source's column names (LLaMA-Factory's `columns`)."""
    tags: TagsSpec = TagsSpec()
    """This source's turn keys and role names (LLaMA-Factory's `tags`)."""


class EvalSpec(Section):
    path: str | None = None
    """Evaluation rows from their own file, folder or glob (prepared like the training data)."""
    fraction: float | None = Field(None, gt=0, lt=1)
    """Or hold out this fraction of every training source's rows (a fixed choice, never trained on)."""
    every_n_steps: int = Field(100, gt=0)
    """Compute `eval_loss` (the token mean over all evaluation rows) every N steps and at the last step."""
    max_rows: int = Field(2000, gt=0)
    """At most this many evaluation rows, read again a micro-batch at a time at each evaluation. With `fraction`, the
    first of the held-out rows in their fixed order, shared among the sources in proportion to what each holds out
    (the rest stay held out: training never sees any of them); with `path`, the first rows of that data."""

    @model_validator(mode="after")
    def _one_way(self):
        if (self.path is None) == (self.fraction is None):
            raise ValueError(
                "data.eval needs either `path` (its own data) or `fraction` (held out of the training data)"
            )
        return self


class DataSpec(Section):
    path: str | None = None
    """A .jsonl, .json (a JSON array or JSON Lines) or .parquet file, a folder of them, or a glob; a local path or a URI
    (s3://, gs://, ...). Or give `sources`."""
    sources: list[SourceSpec] | None = None
    """Several datasets blended by weight, deterministically (the same rows at any worker count and after any restart);
    each may have its own format and mapping."""
    eval: EvalSpec | None = None
    """An evaluation set and how often to compute `eval_loss`."""
    format: Literal["text", "chat", "alpaca", "sharegpt", "prompt"] = "text"
    """`text`: a text column, loss on every token. `chat`: OpenAI-style messages of {role, content}. `alpaca`:
    instruction/input/output (+ system, history). `sharegpt`: conversations of {from, value}. `prompt` (GRPO): a
    `prompt` column, a string or TRL's list of messages, and the columns the rewards read. Every format but text is
    rendered with the tokenizer's chat template; loss on the assistant turns' content and end-of-turn token."""
    columns: ColumnsSpec = ColumnsSpec()
    """Column names when they differ from the format's defaults (LLaMA-Factory's `columns`)."""
    tags: TagsSpec = TagsSpec()
    """Turn keys and role names when they differ from the format's defaults (LLaMA-Factory's `tags`)."""
    train_on_inputs: bool = False
    """Train on every token of a conversation (system and user turns, template headers) rather than the assistant turns
    only."""
    seq_len: int = Field(512, gt=0, le=1_048_576)
    """Tokens per training sequence."""
    pack: bool = True
    """Concatenate samples into full `seq_len` rows (each keeps its own positions and attends only to itself); otherwise
    pad each sample. SFT only: preference pairs are never packed (each response is padded to `seq_len`)."""
    shuffle: bool = True
    """Shuffle each epoch differently: blocks of 64 packed rows are permuted over the whole dataset, then rows within a
    window; the order depends only on `training.seed`, the epoch and the prepared rows."""
    shuffle_window: int = Field(1024, gt=0)
    """Rows shuffled together after the block permutation (rounded down to whole blocks of 64)."""
    bad_rows: Literal["skip", "fail"] = "skip"
    """A row that is empty, of the wrong type, or has invalid chat roles: `skip` counts it (reported in MLflow), `fail`
    stops the job naming file and row."""
    sample_log: str | None = None
    """A folder (local, or a filesystem every node mounts) where each rank appends one JSON line per step: the (source,
    epoch, row) ids it trained on, its world size and attempt. An audit trail of exactly which rows made each step,
    across restarts and world sizes."""

    @model_validator(mode="after")
    def _one_input(self):
        if self.sample_log and "://" in self.sample_log:
            raise ValueError(
                f"data.sample_log {self.sample_log!r}: appends to files, so it needs a local folder or a "
                "filesystem every node mounts (e.g. /mnt/shared/samples), not a URI"
            )
        if (self.path is None) == (self.sources is None):
            raise ValueError("give data.path (one dataset) or data.sources (a blend), exactly one of them")
        if self.sources is not None and not self.sources:
            raise ValueError("data.sources is empty: list at least one {path, weight}")
        return self

    def inputs(self) -> list[tuple["DataSpec", float]]:
        """The training sources, each as a one-source DataSpec (what a token store is prepared from), with its
        weight."""
        if self.sources is None:
            return [(self, 1.0)]
        return [
            (
                self.model_copy(
                    update={
                        "path": s.path,
                        "format": s.format or self.format,
                        "columns": s.columns,
                        "tags": s.tags,
                        "sources": None,
                        "eval": None,
                    }
                ),
                s.weight,
            )
            for s in self.sources
        ]

    def named_inputs(self) -> list[tuple[str, "DataSpec"]]:
        """Every dataset the job reads (training sources, then the evaluation set), with the YAML field of its path."""
        train = (
            [("data.path", self)]
            if self.sources is None
            else [(f"data.sources[{i}].path", d) for i, (d, _) in enumerate(self.inputs())]
        )
        evaluation = self.eval_input()
        return train + ([("data.eval.path", evaluation)] if evaluation else [])

    def eval_input(self) -> "DataSpec | None":
        """The evaluation set's own data, when it has one (`eval.path`)."""
        if self.eval is None or self.eval.path is None:
            return None
        return self.model_copy(update={"path": self.eval.path, "sources": None, "eval": None})

    def column(self, name: str) -> str | None:
        return getattr(self.columns, name) or DEFAULT_COLUMNS[self.format].get(name)

    def tag(self, name: str) -> str | None:
        return getattr(self.tags, name) or DEFAULT_TAGS.get(self.format, {}).get(name)
