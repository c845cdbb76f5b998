"""The objective protocol the loop (train/loop.py) and evaluation call, as a base class whose hooks
have defaults: an objective overrides what it needs and nothing is probed with hasattr.

A step calls, in order: `at(step, rows)` once the step's rows are known; then for each of its
`iterations` passes over the micro-batches (inside `strategy.gathered()` when `gathers_model`):
`begin(strategy, micro_batches)` before the first pass's first forward, `units(mb)` of each
micro-batch, and `objective(strategy, mb)` -> (summed loss, summed metric tensors, in `metrics`'
order). The global batch's means of those metrics go through `finish` into what MLflow and the step
line (`shown`) get; `samples`, when set, are logged with each checkpoint."""

from __future__ import annotations

import torch


class Objective:
    metrics: tuple[str, ...] = ()  # names of the summed stats __call__ returns after the loss
    shown: tuple[tuple[str, str], ...] = ()  # (label, metric name) on the step line
    gathers_model: bool = False  # a pass's many forwards share one gathered sharded model (GRPO's rollout)
    samples: list[dict] | None = None  # what the last step sampled and scored, logged with its checkpoint
    begins: bool = False  # `begin` needs every micro-batch before the first forward (evaluation lists them)

    def __init__(self, spec) -> None:
        self.spec = spec

    @property
    def iterations(self) -> int:
        """Passes over one step's micro-batches (GRPO's num_iterations); the last ends the step."""
        return 1

    def at(self, step: int, rows: list[tuple[int, int, int]]) -> None:
        """The step about to run and this rank's rows (source, epoch, row): GRPO keys its samples by them."""

    def begin(self, strategy, micro_batches: list[dict]) -> None:
        """Before the step's first forward, with all of this rank's micro-batches (KTO's KL estimate
        over the global batch; GRPO's rollouts)."""

    def units(self, mb: dict) -> int:
        """What the loss is a mean over, in this micro-batch (labelled tokens, pairs, rows)."""
        raise NotImplementedError

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """The metrics users see, from the global batch's means of `metrics`."""
        return means
