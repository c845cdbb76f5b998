"""A mixture of experts' load-balancing loss (`training.router_aux_loss_coef`), added to the policy's loss as TRL
adds it, computed as transformers' `load_balancing_loss_func` computes it, on raytrain's footing.

transformers adds `coef x load_balancing_loss_func(router_logits, E, k, mask)` inside its own forward, over a
micro-batch: with every layer's logits, f_e = (top-k assignments to e) / (T·L) and P_e = (summed router
probabilities of e) / (T·L) over the micro-batch's T real tokens and L layers, the loss is E·Σ_e f_e·P_e. That is
a mean over whatever a micro-batch holds, so its gradient would depend on how the global batch is cut into
micro-batches and ranks. raytrain takes it per sequence (each sequence's real tokens: its padding is excluded,
and a packed row's documents are all real tokens, their boundaries changing nothing of a token's routing), and
the step's value is the mean over the global batch's sequences weighted by their real tokens, T_r / T_G: the same
at any worker count, micro-batch size or mesh. A sequence split over sequence-parallel ranks is one sequence: its
assignment counts (no gradient) are summed over the group, each rank adds its part's probabilities.

Only forwards that train (grad enabled) count: the policy's. References, KTO's KL rows and evaluation run under
no_grad. The model's own aux_loss (over every token, padding too) is not used.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from raytrain.data import IGNORE


def real_tokens(ids: torch.Tensor, labels: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """[b, s] bool, host: each sequence's tokens up to its last that is not padding (the store pads with
    `pad_id` and ignored labels after a row's last document; a labelled pad id is a real end-of-text)."""
    if pad_id is None:
        return torch.ones_like(ids, dtype=torch.bool)
    kept = (ids != pad_id) | (labels != IGNORE)
    at = torch.arange(ids.shape[1]).expand_as(ids)
    last = torch.where(kept, at, -1).max(-1, keepdim=True).values
    return at <= last


def balance_sum(router_logits: tuple, real: torch.Tensor, row_tokens: torch.Tensor, top_k: int, group=None):
    """Σ_r T_r·aux_r over this micro-batch's sequences r (this rank's part of each under sequence
    parallelism, `group` its sp group): the loop divides by T_G. `router_logits`: every layer's
    [b·s, E]; `real`: [b, s] this rank's positions (float); `row_tokens`: [b] whole sequences' T_r."""
    b, s = real.shape
    experts, layers = router_logits[0].shape[-1], len(router_logits)
    counts = torch.zeros(b, experts, device=real.device)
    probs = torch.zeros(b, experts, device=real.device)
    for logits in router_logits:  # transformers' accumulation, kept per sequence
        p = torch.softmax(logits.float(), dim=-1).view(b, s, experts)
        chosen = torch.topk(p, top_k, dim=-1).indices
        hit = torch.zeros_like(p).scatter_(-1, chosen, 1.0)
        counts = counts + (hit * real[..., None]).sum(1).detach()
        probs = probs + (p * real[..., None]).sum(1)
    if group is not None:  # a sequence's assignments over all of its parts (no gradient through counts)
        dist.all_reduce(counts, group=group)
    t = row_tokens.clamp(min=1)[:, None] * layers  # T_r·L
    return (experts * (counts / t) * (probs / t)).sum(-1).mul(row_tokens).sum()


def load_balancing(model) -> callable:
    """The model family's own `load_balancing_loss_func` (its modeling module's), the reference."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return sys.modules[type(base).__module__].load_balancing_loss_func
