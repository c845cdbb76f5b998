"""The job spec: one YAML file, validated into typed sections before Ray is touched.

Every field has a docstring (it is the reference documentation of the YAML), and every
rule that ties sections together is a function in rules.py with a message that names the fix.
The spec crosses into the workers as plain JSON and is validated again there, so a
worker never runs on a dict nobody checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from raytrain.job import objectives, rules, strategies
from raytrain.job.data import DataSpec
from raytrain.job.section import Section
from raytrain.job.sections import (
    CheckpointSpec,
    FailureSpec,
    ModelSpec,
    OptimizerSpec,
    ScalingSpec,
    TrackingSpec,
)
from raytrain.job.training import TrainingSpec

LOSS_CHUNK_BYTES = 256 << 20  # fp32 logits a chunk of `training.chunked_loss` holds
# A key that names a secret: a job file holds none (validate refuses one), and MLflow never gets one.
SECRET_KEY = re.compile(
    r"(^|[_\-.])(token|secrets?|password|passwd|pwd|api[_-]?key|access[_-]?key|credentials?|auth)($|[_\-.])", re.I
)


class JobSpec(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    """Run name: the run directory under `storage_path` and the MLflow run name."""
    model: ModelSpec
    """What to fine-tune."""
    data: DataSpec
    """What to train on."""
    training: TrainingSpec = TrainingSpec()
    """How to train."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """AdamW and LR schedule."""
    scaling: ScalingSpec = ScalingSpec()
    """How many workers, on what."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Sharded checkpoints and final export."""
    failure: FailureSpec = FailureSpec()
    """Automatic restarts."""
    tracking: TrackingSpec = TrackingSpec()
    """MLflow."""

    @model_validator(mode="after")
    def _sections_fit_together(self):
        for rule in rules.RULES:  # each raises ValueError with the fields and the fix
            rule(self)
        return self

    def loss_chunk_tokens(self, model_config: dict) -> int:
        """Tokens per cross-entropy chunk for this model (its config.json), 0 for the whole logits at
        once: the one place `training.chunked_loss` is resolved (the strategy computes by it, the
        estimate counts it). A model that transforms its logits after the output layer (Gemma 2's
        softcapping, Cohere's logit scale) computes them whole."""
        vocab, chunked = model_config.get("vocab_size") or 0, self.training.chunked_loss
        if any(model_config.get(k) is not None for k in ("final_logit_softcapping", "logit_scale")):
            chunked = False
        tokens = (
            self.training.micro_batch_size
            * self.sequences_per_row
            * self.data.seq_len
            // self.scaling.sequence_parallel
        )
        # auto: chunked once the logits pass a chunk's 256 MiB of fp32 (a CPU worker's DPO pair of 1k
        # tokens at a 49k vocabulary kept 1.1 GiB of logits and their gradient at once); the price is
        # the output layer's matmul again in backward, ~3% of a 135M model's step, less for larger ones.
        if (
            chunked is False
            or not vocab
            or not strategies.of(self).head_after_forward
            or self.scores
            or (chunked == "auto" and tokens * vocab * 4 <= LOSS_CHUNK_BYTES)
        ):
            return 0
        if chunked is True or chunked == "auto":
            return max(1, LOSS_CHUNK_BYTES // (vocab * 4))  # 523 tokens at 128k
        return chunked

    # What the objective is: its row in job/objectives.py, the one table of objectives.
    @property
    def preference(self) -> bool:
        """Rows are (prompt, chosen, rejected) pairs, or KTO's labelled rows: not single sequences."""
        return objectives.of(self).rows not in (False, "prompt")

    @property
    def packed(self) -> bool:
        """Rows hold several documents (SFT with data.pack); pairs, KTO rows and prompts never do."""
        return self.data.pack and objectives.of(self).packs

    @property
    def rl(self) -> bool:
        """GRPO: rows are prompts, and the workers sample what is trained (rl/)."""
        return objectives.of(self).rows == "prompt"

    @property
    def scores(self) -> bool:
        """A reward model: a score head (`AutoModelForSequenceClassification`) instead of the LM head."""
        return objectives.of(self).score_head

    @property
    def unpaired(self) -> bool:
        """KTO: rows are a prompt, a completion and a label (data/unpaired.py)."""
        return objectives.of(self).rows == "kto"

    @property
    def row_kind(self) -> bool | str:
        """What a source row is, as the prepare step and `validate` read it (and the store's key records it)."""
        return objectives.of(self).rows

    @property
    def sequences_per_row(self) -> int:
        """Sequences a row trains in one forward: a preference pair's two (chosen and rejected), a
        GRPO prompt's num_generations completions."""
        return objectives.sequences_per_row(self)

    @property
    def stored_sequences(self) -> int:
        """Sequences a row is in the token store."""
        return objectives.of(self).stored

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the starting model to compare against (under LoRA the reference is the
        same model with its adapter off)."""
        return objectives.needs_reference(self)

    @property
    def run_dir(self) -> str:
        return self.checkpoint.storage_path.rstrip("/") + "/" + self.name


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=20` -> (["training", "max_steps"], 20); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. training.max_steps=20")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    return raw


def load_yaml(path: str | Path, overrides: list[str] = ()) -> dict:
    """Read a job file with yaml.safe_load (never yaml.load: a job file must not run code)."""
    text = Path(path).read_text()
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a job file is a YAML mapping (name:, model:, data:, ...), got {type(raw).__name__}")
    return apply_overrides(raw, list(overrides))
