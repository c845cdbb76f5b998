"""What a step minimizes: next-token loss (`sft`), a preference loss (`dpo`, `simpo`), a reward
model's (`reward`) or KTO's (`kto`).

An objective turns one micro-batch into a summed loss and summed metrics, and says how many
units (labelled tokens, preference pairs, KTO rows) the micro-batch holds. The loop divides by the
global batch's units, so the loss is the same mean at any worker count and micro-batch split,
and every metric is an exact mean over the global batch (its sums ride on the loop's one
all-reduce). The preference losses and metric names are TRL's (DPOTrainer, CPOTrainer's
SimPO, RewardTrainer, KTOTrainer); tests/test_preference.py checks them against TRL itself.

The protocol is base.py's `Objective`; which class computes an objective is its row in
job/objectives.py.
"""

from __future__ import annotations

import importlib
from typing import Iterable

import torch

from raytrain.job import objectives as table
from raytrain.job.spec import JobSpec
from raytrain.model import attention
from raytrain.objectives.base import Objective
from raytrain.objectives.grpo import GRPO
from raytrain.objectives.kto import KTO
from raytrain.objectives.pairs import Preference, Reward, pair_losses, score
from raytrain.objectives.tokens import (
    SFT,
    Hidden,
    aux_tokens,
    chunked_cross_entropy,
    forward,
    sequence_logps,
    staged,
    targets_of,
    token_loss,
    unstage,
)

__all__ = [
    "GRPO",
    "KTO",
    "SFT",
    "Hidden",
    "Objective",
    "Preference",
    "Reward",
    "aux_tokens",
    "build",
    "chunked_cross_entropy",
    "evaluate",
    "forward",
    "pair_losses",
    "score",
    "sequence_logps",
    "staged",
    "targets_of",
    "to_device",
    "token_loss",
    "unstage",
]


def build(spec: JobSpec) -> Objective:
    """The job's objective, the class its row in job/objectives.py names."""
    module, name = table.of(spec).implementation.split(":")
    return getattr(importlib.import_module(f"raytrain.objectives.{module}"), name)(spec)


def evaluate(strategy, objective, micro_batches: Iterable[dict]) -> dict[str, float]:
    """`eval_loss` (and `eval_<metric>`) over every rank's evaluation rows: a collective, every
    rank runs the same number of forward passes. The sums stay on the device until the end."""
    device = strategy.device
    sums = torch.zeros(2 + len(objective.metrics), dtype=torch.float64, device=device)
    strategy.model.eval()
    if objective.begins:  # KTO's KL estimate: over the evaluation rows, before their losses
        micro_batches = list(micro_batches)
        objective.begin(strategy, micro_batches)
    with torch.no_grad():
        for mb in micro_batches:
            loss, stats = objective(strategy, mb)
            sums[:-1] += torch.stack([t.double() for t in (loss, *stats)])
            sums[-1] += objective.units(mb)
    strategy.model.train()
    torch.distributed.all_reduce(sums)
    mesh = strategy.layout  # a row's ranks each count its units; its tp ranks each add its loss (as in the loop)
    totals = (sums[:-1] / mesh.tp / (sums[-1] / mesh.row_ranks).clamp(min=1)).tolist()  # host: once per evaluation
    named = objective.finish(dict(zip(objective.metrics, totals[1:])))
    return {f"eval_{name}": value for name, value in {"loss": totals[0], **named}.items()}


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host values as a float64 vector on `device`, without waiting for the device's queue."""
    return attention.to_device(torch.tensor(values, dtype=torch.float64), device)
