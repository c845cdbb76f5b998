"""GRPO's arithmetic as TRL's GRPOTrainer does it, pure tensor functions the objective
(objectives/grpo.py) applies to a micro-batch and tests/test_grpo.py compares with TRL's own code:
group-normalized advantages, the per-token loss of each `loss_type` at each importance-sampling
level, its reduction, and the vLLM engine-mismatch correction."""

from __future__ import annotations

import math

import torch

TRL_STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """TRL's nanstd: the unbiased std of the values that are not NaN."""
    mean = torch.nanmean(x)
    count = (~torch.isnan(x)).sum()
    std = torch.sqrt(torch.nansum((x - mean) ** 2) / (count - 1))
    return std if count > 1 else torch.full_like(std, torch.nan)  # no judged values: unknown, not 0


def advantages(scores: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, ...]:
    """TRL's advantages of a global batch of completions ([n, rewards] scores, NaN where a reward
    returned None; groups of `group` consecutive completions): (advantages, summed rewards,
    whether each completion's group std is 0)."""
    unscorable = torch.isnan(scores).all(dim=1)
    rewards = (scores * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = torch.stack([nanstd(g) for g in grouped]).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + TRL_STD_EPS)
    return torch.nan_to_num(adv, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))


def importance_ratio(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, g) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction: exp(trainer - engine log-probs) of the sampled
    tokens, per token or per completion (summed), outside [clip_min, clip_max] zeroed (`*_mask`)
    or clamped (`*_truncate`): [n, T] or [n, 1]."""
    diff = torch.nan_to_num((trainer - engine) * mask, nan=0.0)
    if g.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = g.vllm_importance_sampling_clip_min
    high = g.vllm_importance_sampling_clip_max
    if g.vllm_importance_sampling_mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    return ratio.masked_fill(
        (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high)), 0.0
    )


def token_terms(
    logps: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    g,
    is_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per token: (loss, KL or None, low-clipped, high-clipped), as TRL's _compute_loss for `g`'s
    loss_type and importance_sampling_level (`g`: a GRPOSpec). The clip flags are per completion,
    [n, 1], at sequence level (TRL counts completions there), and 0 where the loss has no such clip
    (sapo; cispo's one clip is `high`)."""
    log_ratio = logps - old
    if g.importance_sampling_level == "sequence":  # GSPO: one ratio a completion, from its tokens' mean log-ratio
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    a = adv[:, None]
    none = torch.zeros_like(coef_1)
    if g.loss_type == "cispo":  # the log-prob itself, weighted by the ratio clipped above and held constant
        loss = -torch.clamp(coef_1, max=g.high).detach() * a * logps
        low, high = none, ((coef_1 > g.high) & (a > 0)).to(coef_1.dtype)
    elif g.loss_type == "sapo":  # a sigmoid gate around ratio 1 instead of the clip, steeper for negative advantages
        temperatures = torch.where(a > 0, g.sapo_temperature_pos, g.sapo_temperature_neg)
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * a
        low = high = none
    else:
        coef_2 = torch.clamp(coef_1, 1 - g.epsilon, 1 + g.high)
        loss = -torch.min(coef_1 * a, coef_2 * a)
        low = ((coef_1 < 1 - g.epsilon) & (a < 0)).to(coef_1.dtype)
        high = ((coef_1 > 1 + g.high) & (a > 0)).to(coef_1.dtype)
    loss = loss.expand_as(logps)  # a completion's one value on each of its tokens (sequence level)
    if is_ratio is not None:  # engine: vllm's correction, before the KL term (TRL's order)
        loss = loss * is_ratio
    kl = None
    if g.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + g.beta * kl
    return loss, kl, low, high


def summed_loss(loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's share of the loss before the division by the global units (`units_of`)."""
    if loss_type in ("grpo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    return (loss * mask).sum()


def units_of(loss_type: str, sequences: int, tokens: int, max_completion_length: int) -> int:
    return {"grpo": sequences, "sapo": sequences, "dr_grpo": sequences * max_completion_length}.get(loss_type, tokens)
