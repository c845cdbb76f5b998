"""A frozen vocabulary table split by rows over the data-parallel ranks, used so at both ends.

Under LoRA (QLoRA, DoRA) the output layer does not train, and on a tied model (SmolLM2, Qwen2.5 up
to 3B, Llama 3.2 1B/3B) it is the input embedding too. As one of FSDP2's units it would be gathered
from the first forward to the last backward, through an all-gather buffer as large; kept whole on
every rank it costs each the other ranks' rows (a tied SmolLM2's table is 42% of the model). Here
each rank keeps only rows [lo, lo + n) (torch.chunk's cut, a DTensor Shard(0) outside FSDP2, so the
weight files fill just those rows), and no rank ever holds the whole table:

- the lookup: every rank's token ids are gathered; each rank looks up those that fall in its rows
  (zeros for the rest), and a reduce-scatter sums the parts back to each rank's own tokens;
- the loss (objectives/tokens.py's fused hook, in Liger's calling convention): every rank's last
  hidden states are gathered; each rank computes its rows' logits for all of them, a chunk of tokens
  at a time; the log-sum-exp and the target's logit are summed over ranks; the backward recomputes
  each chunk and reduce-scatters the hidden states' gradients back to their ranks.

That is Megatron's vocabulary-parallel embedding and cross-entropy over the data-parallel group
instead of a tensor-parallel one. A rank holds as many logits as before (every rank's tokens x its
rows) and 1/N of the table, but every rank's hidden states and their fp32 gradient, N x its tokens
x hidden: `plan.splits_vocabulary` splits only where that is less than the rows it saves. Every rank
calls the lookup and the loss the same number of times with the same number of chunks (the gathered
tokens are padded to the longest rank's), as their collectives need. How long the longest is, the
host knows (data/batches.most_rows: every rank's slice of a global batch is a function of the batch
size and the rank count), so the lookup and the loss are told it (`sized_lookup`, `Loss.sized`)
instead of asking the ranks (`most_rows`, a small all-gather read on the host, twice a micro-batch:
left for callers that do not know it). `plan.splits_vocabulary` is the job's rule (memory.py's estimate reads it too),
`tables` the model's; `split` runs on meta before FSDP2 shards the rest.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from raytrain.data import IGNORE
from raytrain.model import modeling


def tables(model: nn.Module) -> list[nn.Embedding | nn.Linear]:
    """The modules whose frozen table is split: the output layer (no bias) and the input embedding
    when it is a plain lookup, tied to the output layer or frozen on its own; [] where the model's
    output layer is not such a table (then FSDP2Strategy keeps it whole, as before)."""
    head, lookup = model.get_output_embeddings(), model.get_input_embeddings()
    weight = modeling.frozen_output_weight(model)
    if weight is None or getattr(head, "bias", None) is not None or weight.dim() != 2:
        return []
    if type(lookup) is not nn.Embedding or lookup.max_norm is not None:  # a scaled or normed lookup: its own math
        return [] if modeling.tied(model) else [head]
    return [head] if lookup.weight.requires_grad else [lookup, head]


def rows(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s part of a `vocab`-row table, as torch.chunk (and Shard(0)) cut it."""
    per = math.ceil(vocab / ranks)
    first = min(vocab, per * rank)
    return first, min(vocab, first + per) - first


def split(model: nn.Module, mesh) -> set[nn.Parameter]:
    """Replace the tables of `tables(model)` (on meta) by row-split DTensors over `mesh` (1-D), one
    Parameter where they were tied; returns the new parameters, for FSDP2 to leave alone (none where
    the model declines). The lookup's forward becomes `lookup`; the loss is `Loss`."""
    new: dict[int, nn.Parameter] = {}
    for module in tables(model):
        w = module.weight
        if id(w) not in new:
            _, n = rows(w.shape[0], mesh.size(), mesh.get_local_rank())
            local = torch.empty(n, w.shape[1], dtype=w.dtype, device="meta")
            new[id(w)] = nn.Parameter(
                DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()),
                requires_grad=False,
            )
        module.weight = new[id(w)]
        module.vocab_split = True
        if isinstance(module, nn.Embedding):
            module.forward = functools.partial(lookup, module)
    return set(new.values())


def is_split(model: nn.Module) -> bool:
    """Whether `split` split this model's output layer (its module keeps the mark through to_empty)."""
    return getattr(model.get_output_embeddings(), "vocab_split", False)


def _local(weight: DTensor) -> tuple[torch.Tensor, int, dist.ProcessGroup]:
    """(this rank's rows, the first one's index, the group the table is split over)."""
    mesh = weight.device_mesh
    first, _ = rows(weight.shape[0], mesh.size(), mesh.get_local_rank())
    return weight.to_local(), first, mesh.get_group()


# torch 2.13 renamed the single-tensor collectives (the old names warn); the GPU image's 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def most_rows(n: int, device: torch.device, group) -> int:
    """The most rows any rank has (this rank has `n`): one small all-gather, read on the host."""
    count = torch.tensor([n], device=device)
    sizes = torch.empty(dist.get_world_size(group), dtype=count.dtype, device=device)
    _all_gather(sizes, count, group=group)
    return int(sizes.max().item())  # host: the padded length sizes the next tensors (once a lookup, once a loss)


def _gather(x: torch.Tensor, longest: int, group, pad_value=0) -> torch.Tensor:
    """Every rank's `x` (rows of dim 0) stacked rank by rank, each padded to `longest` rows."""
    padded = (
        F.pad(x, (0, 0) * (x.dim() - 1) + (0, longest - x.shape[0]), value=pad_value) if longest > x.shape[0] else x
    )
    out = x.new_empty((longest * dist.get_world_size(group), *x.shape[1:]))
    _all_gather(out, padded.contiguous(), group=group)
    return out


def _scatter_sum(parts: torch.Tensor, longest: int, own: int, group) -> torch.Tensor:
    """Sum every rank's `parts` (rank-by-rank blocks of `longest` rows) and keep this rank's block."""
    out = parts.new_empty((longest, *parts.shape[1:]))
    _reduce_scatter(out, parts.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out[:own]


def _longest(given: int | None, n: int, device: torch.device, group) -> int:
    """The padded length of this collective: the host-known one (`given`), else asked of the ranks."""
    if given is None:
        return most_rows(n, device, group)
    if n > given:
        raise RuntimeError(f"this rank holds {n} tokens, more than the {given} its micro-batch said any rank holds")
    return given


@contextlib.contextmanager
def sized_lookup(model: nn.Module, longest: int | None):
    """The split lookup's padded length for the forwards inside (the most tokens any rank looks up)."""
    found = getattr(model, "module", model)  # DDP's wrapper
    found = found.get_input_embeddings() if longest is not None and hasattr(found, "get_input_embeddings") else None
    if found is None or not getattr(found, "vocab_split", False):
        yield
        return
    found.longest = longest
    try:
        yield
    finally:
        found.longest = None


def lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of `ids` from rows split over the ranks (a collective: every rank calls it)."""
    table, first, group = _local(module.weight)
    ids_ = ids.reshape(-1)
    most = _longest(getattr(module, "longest", None), len(ids_), ids.device, group)
    every = _gather(ids_, most, group, pad_value=-1)
    inside = (every >= first) & (every < first + table.shape[0])
    index = torch.where(inside, every - first, 0)
    found = F.embedding(index, table) if table.shape[0] else table.new_zeros(len(every), table.shape[1])
    found = found * inside.unsqueeze(-1).to(found.dtype)
    return _scatter_sum(found, most, len(ids_), group).view(*ids.shape, table.shape[1])


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of this rank's hidden states against the whole vocabulary, from
    rows split over the ranks (a collective in forward and in backward)."""

    @staticmethod
    def forward(ctx, states, weight, labels, chunk, longest=None):
        table, first, group = _local(weight)
        most, own = _longest(longest, len(states), states.device, group), len(states)
        every, every_labels = _gather(states.detach(), most, group), _gather(labels, most, group, pad_value=IGNORE)
        chunk = chunk * dist.get_world_size(group) if chunk else len(every)  # as many logits a chunk as unsplit
        lse = torch.empty(len(every), dtype=torch.float32, device=states.device)
        target = torch.empty_like(lse)
        for i in range(0, len(every), chunk):
            logits = _logits(every[i : i + chunk], table)
            top = logits.amax(-1) if table.shape[0] else logits.new_full((len(logits),), -math.inf)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # every row is some rank's: finite
            mine, index = _own_labels(every_labels[i : i + chunk], first, table.shape[0])
            picked = logits.gather(-1, index[:, None]).squeeze(-1) if table.shape[0] else top
            sums = torch.stack([(logits - top[:, None]).exp().sum(-1), torch.where(mine, picked, 0.0)])
            dist.all_reduce(sums, group=group)
            lse[i : i + chunk], target[i : i + chunk] = sums[0].log() + top, sums[1]
        # One chunk (training.chunked_loss off): keep its softmax for the backward, as the whole
        # logits' cross-entropy keeps its own, instead of computing the logits again there.
        ctx.probs = logits.sub_(lse[:, None]).exp_() if chunk >= len(every) and ctx.needs_input_grad[0] else None
        loss = torch.where(every_labels == IGNORE, 0.0, lse - target)
        ctx.save_for_backward(every, every_labels, lse)
        ctx.weight, ctx.chunk, ctx.longest, ctx.own = weight, chunk, most, own
        start = dist.get_rank(group) * most
        return loss[start : start + own]

    @staticmethod
    def backward(ctx, grad):
        every, every_labels, lse = ctx.saved_tensors
        table, first, group = _local(ctx.weight)
        grads = _gather(grad.float().contiguous(), ctx.longest, group)
        grads = torch.where(every_labels == IGNORE, 0.0, grads)
        d_states = torch.zeros(every.shape, dtype=torch.float32, device=every.device)
        if table.shape[0]:
            for i in range(0, len(every), ctx.chunk):
                probs = (
                    ctx.probs
                    if ctx.probs is not None
                    else (_logits(every[i : i + ctx.chunk], table) - lse[i : i + ctx.chunk, None]).exp()
                )
                mine, index = _own_labels(every_labels[i : i + ctx.chunk], first, table.shape[0])
                probs[mine, index[mine]] -= 1.0
                d_states[i : i + ctx.chunk] = (
                    (probs * grads[i : i + ctx.chunk, None]).to(table.dtype).matmul(table).float()
                )
        ctx.probs = None
        own = _scatter_sum(d_states, ctx.longest, ctx.own, group)
        return own.to(every.dtype), None, None, None, None


def _logits(states: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.linear(states.to(table.dtype), table).float()


def _own_labels(labels: torch.Tensor, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(which labels fall in this rank's rows, their index there; 0 elsewhere)."""
    mine = (labels >= first) & (labels < first + n)
    return mine, torch.where(mine, labels - first, 0)


class Loss:
    """objectives/tokens.py's fused loss hook (Liger's calling convention) over the split table:
    per-token cross-entropy; `chunk` (training.chunked_loss's tokens, 0: all at once) x N gathered
    tokens' logits a chunk, as many as `chunk` tokens' whole logits."""

    def __init__(self, chunk: int, longest: int | None = None):
        self.chunk, self.longest = chunk, longest

    def sized(self, longest: int | None) -> "Loss":
        """This loss with its padded length known on the host (the most tokens any rank scores)."""
        return Loss(self.chunk, longest)

    def __call__(self, states, weight, target, bias=None, ignore_index=IGNORE, reduction="none"):
        assert bias is None and ignore_index == IGNORE and reduction == "none"
        return _CrossEntropy.apply(states, weight, target, self.chunk, self.longest)
