"""Sequence parallelism, DeepSpeed-Ulysses style: each of a group's sp ranks holds 1/sp of every
sequence (contiguous parts, in rank order) through the whole model, and attention, the one
layer that mixes positions, sees whole sequences by trading heads for positions: one all-to-all
before it (each rank gets all positions of 1/sp of the heads), one after (back to its positions
with all heads). Everything else (norms, MLP, the loss) is per token, so it runs on the rank's
part unchanged.

It wraps whatever attention the job names (eager, sdpa, flash): raytrain's attention
(attention.py) calls `gather_positions` and `scatter_positions` around the named implementation.
The boundaries it is given (a mask, or flash's varlen segments) are the whole rows', made from
the whole rows' positions before they are split (`objectives.forward`); rotary embeddings use the
part's own position ids, which are the whole row's. They reach each layer as the model's keyword
arguments, so activation checkpointing's recomputation in backward sees them too.

Model code stays free of torch.distributed: the group reaches the attention through
`attention.install`, which the strategy calls with this rank's split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from raytrain.model import attention


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 (part j goes to rank j); its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # a permuted view here: empty_like would keep its strides, and
        out = torch.empty_like(grad)  # the exchange writes its output as contiguous memory
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) whose gradient is also summed over the group: every rank's copy of the sum
    feeds its own loss, so each part's gradient is the sum of what the copies send back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def heads_to_positions(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """[b, h, s/sp, d] (all heads, my positions) -> [b, h/sp, s, d] (my heads, all positions)."""
    b, h, s, d = x.shape
    x = _AllToAll.apply(x.reshape(b, sp, h // sp, s, d).transpose(0, 1).contiguous(), group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)  # rank j's positions come j-th


def positions_to_heads(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """[b, s, h/sp, d] (attention's output layout) -> [b, s/sp, h, d]."""
    b, s, h, d = x.shape
    x = _AllToAll.apply(x.reshape(b, sp, s // sp, h, d).transpose(0, 1).contiguous(), group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)  # rank j's heads come j-th


@dataclass
class SequenceSplit:
    """This rank's place in its sequence-parallel group, and what the objective does with it."""

    size: int
    rank: int  # 0..size-1: which part of each sequence this rank holds
    group: object
    inner: str  # the attention implementation the job named

    @classmethod
    def create(cls, mesh, rank: int, inner: str) -> "SequenceSplit | None":
        """Collective (every rank makes every group): the sp groups of `mesh` (`plan.Mesh`)."""
        if mesh.sp == 1:
            return None
        mine, _ = dist.new_subgroups_by_enumeration(mesh.sp_groups())
        return cls(mesh.sp, mesh.sp_rank(rank), mine, inner)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of [rows, s] (ids, positions, shifted labels)."""
        n = t.shape[1] // self.size
        return t[:, self.rank * n : (self.rank + 1) * n]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The group's sum of per-rank partial values (a sequence's log-prob), differentiably."""
        return _SumOverGroup.apply(t, self.group)

    def gather_positions(self, query, key, value, groups: int):
        """[b, heads, s/sp, d] each -> [b, heads/sp, s, d]: this rank's heads over whole sequences.
        KV heads fewer than sp (validated: sp is a multiple of them) are repeated, one a rank;
        returns the key/value groups per query head that the rank's heads keep."""
        if key.shape[1] % self.size:
            repeat = self.size // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
            groups = groups // repeat
        query, key, value = (heads_to_positions(t, self.size, self.group) for t in (query, key, value))
        return query, key, value, groups

    def scatter_positions(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [b, s, heads/sp, d] -> [b, s/sp, heads, d]: back to this rank's part."""
        return positions_to_heads(out, self.size, self.group)

    def use_for(self, model: torch.nn.Module) -> None:
        """Route `model`'s attention through the exchange (its config is shared by its layers)."""
        attention.install(model, self.inner, self)
