"""Sequence parallelism, DeepSpeed-Ulysses style: each of a group's sp ranks holds 1/sp of every
sequence (contiguous parts, in rank order) through the whole model, and attention, the one
layer that mixes positions, sees whole sequences by trading heads for positions: one all-to-all
before it (each rank gets all positions of 1/sp of the heads), one after (back to its positions
with all heads). Everything else (norms, MLP, the loss) is per token, so it runs on the rank's
part unchanged.

It wraps whatever attention the job names (eager, sdpa, flash): the model is loaded with it, then
its config names `ULYSSES`, registered here with transformers, whose function exchanges, calls the
named one on whole sequences, and exchanges back. The mask the model builds is for the rank's part
only, so it is skipped (`ULYSSES` has no mask function) and made here from the whole rows' position
ids, by transformers' own packing rule: a document starts where the position does not step by one.
Packed documents keep attending only to themselves; rotary embeddings use the part's own position
ids, which are the whole row's.

Model code stays free of torch.distributed: the group and the rows' positions reach the attention
through `SequenceSplit.attending`, a context the objective's forward enters.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

ULYSSES = "raytrain_ulysses"
_current: contextvars.ContextVar["_Forward | None"] = contextvars.ContextVar("raytrain_ulysses", default=None)


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
class _Forward:
    """One forward's whole rows, shared by its layers: what is derived from them is made once."""
    split: "SequenceSplit"
    positions: torch.Tensor  # the whole rows' position ids, [b, s], in host memory (the micro-batch's)
    documents: torch.Tensor  # each position's document number in its row, counted from 0
    packed: bool  # a row holds more than one document
    on_device: dict  # (what, device, dtype) -> the positions or mask there

    @classmethod
    def of(cls, split: "SequenceSplit", positions: torch.Tensor) -> "_Forward":
        # transformers' packing rule: a document starts where the position does not step by one.
        # Read from the host rows, so knowing whether they pack waits for no device.
        documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        return cls(split, positions, documents, bool((documents[:, -1] > 0).any()), {})  # host: the micro-batch's rows

    def get(self, what: str, device: torch.device, dtype: torch.dtype, make):
        key = (what, device, dtype)
        if key not in self.on_device:
            self.on_device[key] = make()
        return self.on_device[key]


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
        _register()
        return cls(mesh.sp, mesh.sp_rank(rank), mine, inner)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of [rows, s] (ids, positions, shifted labels)."""
        n = t.shape[1] // self.size
        return t[:, self.rank * n:(self.rank + 1) * n]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The group's sum of per-rank partial values (a sequence's log-prob), differentiably."""
        return _SumOverGroup.apply(t, self.group)

    @contextlib.contextmanager
    def attending(self, positions: torch.Tensor):
        """Forward passes inside attend over whole rows with these position ids."""
        token = _current.set(_Forward.of(self, positions))
        try:
            yield
        finally:
            _current.reset(token)

    def use_for(self, model: torch.nn.Module) -> None:
        """Route `model`'s attention through the exchange (its config is shared by its layers)."""
        model.config._attn_implementation = ULYSSES


def _mask(f: _Forward, query: torch.Tensor) -> torch.Tensor | None:
    """The whole rows' mask in the form the inner implementation takes: None (causal) for sdpa
    on unpacked rows (its causal kernel needs none, and an s×s one is s² bytes), a boolean one
    for sdpa on packed rows, an additive one for eager."""
    eager = f.split.inner == "eager"
    if not eager and not f.packed:
        return None

    def make() -> torch.Tensor:
        doc, s = f.documents.to(query.device), f.positions.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
        allowed = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        if not eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~allowed, torch.finfo(query.dtype).min)

    return f.get("mask", query.device, query.dtype, make)


def _attention(module, query, key, value, attention_mask, **kwargs):
    f = _current.get()
    if f is None:
        raise RuntimeError("sequence-parallel attention called outside SequenceSplit.attending")
    sp, group, inner = f.split.size, f.split.group, f.split.inner
    groups = module.num_key_value_groups
    if key.shape[1] % sp:  # fewer KV heads than ranks (validated: sp is a multiple): one each
        repeat = sp // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        groups = groups // repeat
    query, key, value = (heads_to_positions(t, sp, group) for t in (query, key, value))
    if inner.startswith("flash"):  # varlen from the whole rows' positions, no mask
        mask = None
        kwargs["position_ids"] = f.get("positions", query.device, None, lambda: f.positions.to(query.device))
    else:
        mask = _mask(f, query)
    function = _inner_function(module, inner)
    saved, module.num_key_value_groups = module.num_key_value_groups, groups
    try:
        out, _ = function(module, query, key, value, mask, **kwargs)
    finally:
        module.num_key_value_groups = saved
    return positions_to_heads(out, sp, group), None


def _inner_function(module, inner: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":  # each model's own, in its modeling module
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def _no_mask(*args, **kwargs):
    return None  # the model's mask would be for the rank's part: `_mask` makes the whole rows' one


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ULYSSES, _attention)
    AttentionMaskInterface.register(ULYSSES, _no_mask)
