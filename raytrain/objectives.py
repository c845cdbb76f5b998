"""What a step minimizes: next-token loss (`sft`) or a preference loss (`dpo`, `simpo`).

An objective turns one micro-batch into a summed loss and summed metrics, and says how many
units (labelled tokens, or preference pairs) the micro-batch holds. The loop divides by the
global batch's units, so the loss is the same mean at any worker count and micro-batch split,
and every metric is an exact mean over the global batch (its sums ride on the loop's one
all-reduce). The preference losses and metric names are TRL's (DPOTrainer, CPOTrainer's
SimPO); tests/test_preference.py checks them against TRL itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import attention
from .config import JobSpec, PreferenceSpec
from .data import IGNORE


@dataclass
class Hidden:
    """What a forward gives under `training.chunked_loss`: the last hidden states and the output
    layer, which the loss applies a chunk of tokens at a time."""
    states: torch.Tensor
    head: torch.nn.Module
    chunk: int
    autocast: Callable  # the strategy's compute precision, which the output layer runs in as in the model


def token_loss(out: torch.Tensor | Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over the labelled tokens; `targets` are the labels shifted by one
    (`targets_of`), aligned with `out`'s positions."""
    if isinstance(out, Hidden):
        return chunked_cross_entropy(out, targets).sum()
    return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def sequence_logps(out: torch.Tensor | Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Per sequence: the summed log-probability of its labelled tokens (of this rank's part of it
    under sequence parallelism). Cross-entropy per token rather than a log-softmax over the
    vocabulary: one fp32 copy of the logits, not two."""
    if isinstance(out, Hidden):
        return -chunked_cross_entropy(out, targets).sum(-1)
    return -F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="none").view(targets.shape).sum(-1)


def targets_of(labels: torch.Tensor) -> torch.Tensor:
    """The next token's label at each position (IGNORE at the last): position t predicts label t+1.
    Shifted before a sequence is split over ranks, so a part's last position is scored against the
    next part's first label."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def chunked_cross_entropy(out: Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (0 where unlabelled), `out.chunk` tokens at a time. Each chunk's
    logits are recomputed in backward (a checkpoint), so at most one chunk's exist at once: at a
    128k vocabulary a 4k-token sequence's fp32 logits and their gradient are 4 GiB, a chunk 256 MiB."""
    states, labels = out.states.flatten(0, 1), targets.flatten()
    weight, bias = out.head.weight, out.head.bias
    with out.autocast():  # recorded by each checkpoint and restored when backward recomputes it
        parts = [checkpoint(_chunk_cross_entropy, states[i:i + out.chunk], weight, bias, labels[i:i + out.chunk],
                            use_reentrant=False) for i in range(0, len(labels), out.chunk)]
    return torch.cat(parts).view(targets.shape)


def _chunk_cross_entropy(states, weight, bias, labels) -> torch.Tensor:
    return F.cross_entropy(F.linear(states, weight, bias).float(), labels, ignore_index=IGNORE, reduction="none")


def pair_losses(objective: str, p: PreferenceSpec, chosen: torch.Tensor, rejected: torch.Tensor,
                ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, n_chosen: torch.Tensor,
                n_rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair, from summed log-probs and token counts."""
    if objective == "simpo":  # length-normalized, no reference, a target margin gamma
        chosen_avg, rejected_avg = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        z = p.beta * (chosen_avg - rejected_avg) - p.gamma
        loss = -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)
        return loss, p.beta * chosen_avg.detach(), p.beta * rejected_avg.detach()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if p.loss == "sigmoid":  # with label smoothing: conservative DPO
        loss = -(1 - p.label_smoothing) * F.logsigmoid(p.beta * delta) - p.label_smoothing * F.logsigmoid(-p.beta * delta)
    elif p.loss == "hinge":
        loss = torch.relu(1 - p.beta * delta)
    else:  # ipo, normalized by the completion's tokens as TRL does (confirmed with IPO's authors, per TRL)
        ipo = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
        loss = (ipo - 1 / (2 * p.beta)) ** 2
    return loss, p.beta * chosen_ratio.detach(), p.beta * rejected_ratio.detach()


class SFT:
    """Next-token cross-entropy, the token mean over the global batch."""

    metrics: tuple[str, ...] = ()

    def units(self, mb: dict) -> int:
        return int((mb["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out, targets = forward(strategy, strategy.model, mb)
        return token_loss(out, targets), []  # a sequence part's share: the parts' losses add up


class Preference:
    """DPO or SimPO over the pairs of a micro-batch (its first half chosen, its second half
    rejected, in one forward); the mean over the global batch's pairs."""

    metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")

    def __init__(self, spec: JobSpec):
        self.objective, self.settings = spec.training.objective, spec.training.preference

    def units(self, mb: dict) -> int:
        return int(_real_pairs(mb).sum())

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        split = strategy.sequence
        out, targets = forward(strategy, strategy.model, mb)
        logps = sequence_logps(out, targets)
        counts = staged(strategy, mb)["counts"]  # whole sequences'
        if self.objective == "dpo":
            with torch.no_grad(), strategy.reference() as reference:
                ref_logps = sequence_logps(*forward(strategy, reference, mb))
        else:
            ref_logps = torch.zeros_like(logps)
        if split:  # each rank scored its part: the pair losses need whole sequences' log-probs
            logps, ref_logps = split.sum(logps), split.sum(ref_logps).detach()
        pairs = len(logps) // 2
        (chosen, rejected), (ref_c, ref_r), (n_c, n_r) = (t.split(pairs) for t in (logps, ref_logps, counts))
        if self.objective == "simpo":  # TRL's CPO logs the length-normalized log-probs SimPO trains on
            chosen_logged, rejected_logged = chosen / n_c.clamp(min=1), rejected / n_r.clamp(min=1)
        else:
            chosen_logged, rejected_logged = chosen, rejected
        loss, reward_c, reward_r = pair_losses(self.objective, self.settings, chosen, rejected, ref_c, ref_r, n_c, n_r)
        real = staged(strategy, mb)["real"]  # a padding pair adds nothing
        # Under sequence parallelism every rank of the group holds the pair's loss: each adds 1/sp of
        # it, so the group's sums are the pair's values, and the summed log-probs' gradient flows to
        # each part once (`SequenceSplit.sum`).
        real = real / (split.size if split else 1)
        stats = [reward_c, reward_r, (reward_c > reward_r).float(), reward_c - reward_r, chosen_logged.detach(),
                 rejected_logged.detach()]
        return (loss * real).sum(), [(s * real).sum() for s in stats]


def _real_pairs(mb: dict) -> torch.Tensor:
    chosen_labels = mb["labels"][: len(mb["labels"]) // 2, 1:]
    return (chosen_labels != IGNORE).any(-1)


def forward(strategy, model, mb: dict) -> tuple[torch.Tensor | Hidden, torch.Tensor]:
    """(logits, or under `training.chunked_loss` the last hidden states with the output layer; the
    targets they are scored against) of a micro-batch. Packed documents attend only to themselves
    (attention.py, told by `staged`). Under sequence parallelism: this rank's part of each sequence."""
    chunk, head = strategy.loss_chunk, getattr(model, "module", model).get_output_embeddings()  # (DDP's wrapper)
    x, split = staged(strategy, mb), strategy.sequence
    with strategy.autocast(), _skipped(head) if chunk else contextlib.nullcontext():
        out = model(input_ids=x["input_ids"], position_ids=x["position_ids"], **x["attention"])
    # The output layer is used after the model's forward: FSDP2 keeps the root's parameters (the
    # output layer's among them) gathered from its forward to its backward, so this is the same weight.
    logits, targets = out.logits, x["targets"]
    if split is None or split.rank == split.size - 1:  # a sequence's last position predicts nothing: its
        logits, targets = logits[:, :-1], targets[:, :-1]  # sums then add exactly the terms they always did
    return (Hidden(logits, head, chunk, strategy.autocast) if chunk else logits), targets


def staged(strategy, mb: dict) -> dict:
    """The micro-batch on the strategy's device, made once for all its forward passes (DPO's
    reference reuses it): this rank's part of its ids, positions and shifted labels, its pairs'
    token counts, and its attention boundaries (from the whole rows' host positions, `masks.py`).
    Every copy is from pinned memory and asynchronous: nothing here waits for the device.
    The loop stages the next micro-batch while this one's backward runs and drops each after it."""
    if "_staged" in mb:
        return mb["_staged"]
    device, split = strategy.device, strategy.sequence
    ids, positions, targets = mb["input_ids"], mb["position_ids"], targets_of(mb["labels"])
    boundaries = attention.Boundaries.of(positions)  # whole rows: under sp too
    compute = torch.bfloat16 if strategy.compute_bf16 else torch.float32
    out = {"attention": attention.model_kwargs(boundaries, strategy.spec.model.attn_implementation,
                                               strategy.attention_windows, device, compute)}
    if strategy.spec.preference:  # whole sequences' counts (targets before the split)
        out["counts"] = attention.to_device((targets != IGNORE).sum(-1), device)
        out["real"] = attention.to_device(_real_pairs(mb).float(), device)
    if split:
        ids, positions, targets = split.part(ids), split.part(positions), split.part(targets)
    out.update(input_ids=attention.to_device(ids, device), position_ids=attention.to_device(positions, device),
               targets=attention.to_device(targets, device))
    mb["_staged"] = out
    return out


def unstage(mb: dict) -> None:
    """Drop a micro-batch's device copies (its masks are b x s x s)."""
    mb.pop("_staged", None)


@contextlib.contextmanager
def _skipped(head: torch.nn.Module):
    head.forward = _identity  # shadows the layer's own forward for this call: the model returns its hidden states
    try:
        yield
    finally:
        del head.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def build(spec: JobSpec) -> SFT | Preference:
    return Preference(spec) if spec.preference else SFT()


def evaluate(strategy, objective, micro_batches: Iterable[dict]) -> dict[str, float]:
    """`eval_loss` (and `eval_<metric>`) over every rank's evaluation rows: a collective, every
    rank runs the same number of forward passes. The sums stay on the device until the end."""
    device = strategy.device
    sums = torch.zeros(2 + len(objective.metrics), dtype=torch.float64, device=device)
    strategy.model.eval()
    with torch.no_grad():
        for mb in micro_batches:
            loss, stats = objective(strategy, mb)
            sums[:-1] += torch.stack([t.double() for t in (loss, *stats)])
            sums[-1] += objective.units(mb)
    strategy.model.train()
    torch.distributed.all_reduce(sums)
    mesh = strategy.layout  # a row's ranks each count its units; its tp ranks each add its loss (as in the loop)
    totals = (sums[:-1] / mesh.tp / (sums[-1] / mesh.row_ranks).clamp(min=1)).tolist()  # host: once per evaluation
    return {f"eval_{name}": value for name, value in zip(("loss", *objective.metrics), totals)}


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host values as a float64 vector on `device`, without waiting for the device's queue."""
    return attention.to_device(torch.tensor(values, dtype=torch.float64), device)
