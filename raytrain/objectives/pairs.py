"""Objectives on preference pairs (a micro-batch of b pairs is its b chosen sequences, then its b
rejected ones, in one forward): DPO and SimPO (TRL's DPOTrainer, CPOTrainer), and a reward model
(TRL's RewardTrainer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raytrain.data.pairs import MARGIN_TAG_BITS
from raytrain.job.spec import JobSpec
from raytrain.job.training import PreferenceSpec
from raytrain.model.facts import SCORE_HEAD
from raytrain.objectives.base import Objective
from raytrain.objectives.tokens import (
    balance,
    forward,
    real_pairs,
    replaced_forward,
    routed,
    sequence_logps,
    staged,
    unwrapped,
)


def pair_losses(
    objective: str,
    p: PreferenceSpec,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair, from summed log-probs and token counts."""
    if objective == "simpo":  # length-normalized, no reference, a target margin gamma
        chosen_avg, rejected_avg = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        z = p.beta * (chosen_avg - rejected_avg) - p.gamma
        loss = -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)
        return loss, p.beta * chosen_avg.detach(), p.beta * rejected_avg.detach()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if p.loss == "sigmoid":  # with label smoothing: conservative DPO
        loss = -(1 - p.label_smoothing) * F.logsigmoid(p.beta * delta) - p.label_smoothing * F.logsigmoid(
            -p.beta * delta
        )
    elif p.loss == "hinge":
        loss = torch.relu(1 - p.beta * delta)
    else:  # ipo, normalized by the completion's tokens as TRL does (confirmed with IPO's authors, per TRL)
        ipo = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
        loss = (ipo - 1 / (2 * p.beta)) ** 2
    return loss, p.beta * chosen_ratio.detach(), p.beta * rejected_ratio.detach()


class Preference(Objective):
    """DPO or SimPO over the pairs of a micro-batch (its first half chosen, its second half
    rejected, in one forward); the mean over the global batch's pairs."""

    metrics = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    shown = (("acc", "rewards/accuracies"), ("margin", "rewards/margins"))  # on the step line

    def __init__(self, spec: JobSpec):
        self.objective, self.settings = spec.training.objective, spec.training.preference

    def units(self, mb: dict) -> int:
        return int(real_pairs(mb).sum())

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
        stats = [
            reward_c,
            reward_r,
            (reward_c > reward_r).float(),
            reward_c - reward_r,
            chosen_logged.detach(),
            rejected_logged.detach(),
        ]
        return (loss * real).sum(), [(s * real).sum() for s in stats]


class Reward(Objective):
    """A reward model on preference pairs, as TRL's RewardTrainer trains it: a sequence's score is the
    head's output at its last token that is not padding (where `AutoModelForSequenceClassification`
    reads it, so an exported model scores as the workers did), and the loss is
    -logsigmoid(r_chosen - r_rejected - margin) (the row's margin, 0 without one), plus
    center_rewards_coefficient x (r_chosen + r_rejected)^2; the mean over the global batch's pairs.
    TRL's metric names (its `margin` is r_chosen - r_rejected, the rows' margins apart); its
    min/max_reward are not sums and are left out."""

    metrics = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")
    shown = (("acc", "accuracy"), ("margin", "margin"))

    def __init__(self, spec: JobSpec):
        self.center = spec.training.preference.center_rewards_coefficient

    def units(self, mb: dict) -> int:
        return int(real_pairs(split_margins(mb)).sum())

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        split = strategy.sequence
        scores = score(strategy, strategy.model, split_margins(mb))
        if split:  # the rank holding a sequence's last token scored it, the others added 0
            scores = split.sum(scores)
        chosen, rejected = scores.float().split(len(scores) // 2)
        loss = -F.logsigmoid(chosen - rejected - staged(strategy, mb)["margin"])
        if self.center:
            loss = loss + self.center * (chosen + rejected) ** 2
        real = staged(strategy, mb)["real"] / (split.size if split else 1)  # as Preference's
        c, r = chosen.detach(), rejected.detach()
        stats = [(c > r).float(), c - r, (c + r) / 2, c, r]
        return (loss * real).sum(), [(s * real).sum() for s in stats]


def split_margins(mb: dict) -> dict:
    """A reward micro-batch (each row's chosen, rejected and margin tag: data/pairs.py) as its pairs
    (the b chosen sequences, then the b rejected ones) and their margins (`margin`, host float32);
    made once, in place. A padding pair's margin is 0 (its tag is padding, not a number)."""
    if "margin" not in mb:
        b = len(mb["input_ids"]) // 3
        tags = mb["input_ids"][2 * b :]
        mb.update({k: mb[k][: 2 * b] for k in ("input_ids", "labels", "position_ids")})
        mb["margin"] = torch.where(real_pairs(mb), margins_of(tags), 0.0)
    return mb


def margins_of(tags: torch.Tensor) -> torch.Tensor:
    """The margins `data.pairs.margin_tag` stored: float32 bits, MARGIN_TAG_BITS a token, high first."""
    t = tags[:, :3].long() & ((1 << MARGIN_TAG_BITS) - 1)
    bits = (t[:, 0] << 2 * MARGIN_TAG_BITS) | (t[:, 1] << MARGIN_TAG_BITS) | t[:, 2]
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def score(strategy, model, mb: dict) -> torch.Tensor:
    """Each sequence's score (this rank's share under sequence parallelism: 0 unless its part holds
    the scored token). The head is applied to that one position only, inside the model's forward,
    where every strategy has gathered it (a head call after the forward would find ZeRO-3's
    partitioned again); transformers' own pooling then picks it out of a constant row."""
    x = staged(strategy, mb)
    head = getattr(unwrapped(model), SCORE_HEAD)  # under LoRA peft's wrapper, which calls the trained copy
    own = head.forward
    trained = head.modules_to_save["default"] if hasattr(head, "modules_to_save") else head  # LoRA: fp32 copy

    def pooled(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[torch.arange(len(hidden), device=hidden.device), x["last"]].to(trained.weight.dtype)
        out = own(picked) * x["here"][:, None].to(picked.dtype)
        return out[:, None].expand(-1, hidden.shape[1], -1)

    with strategy.autocast(), replaced_forward(head, pooled):
        out = model(input_ids=x["input_ids"], position_ids=x["position_ids"], **x["attention"], **routed(strategy))
    balance(strategy, out, x)
    return out.logits.squeeze(-1)
