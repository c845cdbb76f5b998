"""Tensor parallelism for FSDP2: each decoder block's projections split over the tp ranks of the
mesh (Megatron's layout, as torchtitan writes it for Llama), before FSDP2 shards what each rank
holds over the data-parallel ranks (a 2-D mesh of DTensors).

    q, k, v, gate, up   column-wise: each rank computes its own heads / hidden units
    o, down             row-wise: each rank's partial product, summed over the tp ranks

So attention and the MLP run on 1/tp of the heads and hidden units with two all-reduces a block
(one forward, one backward), and no rank ever gathers a whole layer. Everything else (embeddings,
norms, the output layer) is replicated over the tp ranks and sharded by FSDP2 over dp alone: the
output layer computes whole logits from whole hidden states on each rank, nothing is gathered for
the loss, and `training.chunked_loss` bounds them as without tp. Attention sees 1/tp of the heads
(`view(..., -1, head_dim)` in the supported families), which Ulysses then splits over sp.

LoRA: an adapter follows its base layer. Under a column-wise base its B is column-wise (its A,
replicated, sees the whole input); under a row-wise base its A is row-wise (it reads the rank's
part of the input, its output summed over tp) and its B replicated. So a rank holds 1/tp of the
adapters of split layers, and the adapter's output is laid out as the base layer's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def block_plan(block: torch.nn.Module) -> dict:
    """The parallelize_module plan of one decoder block, with or without peft's LoRA wrappers."""
    modules = dict(block.named_modules())
    plan = {}
    for names, style, adapter in ((COLUMNWISE, ColwiseParallel, "lora_B"), (ROWWISE, RowwiseParallel, "lora_A")):
        for name in names:
            if name not in modules:
                raise ValueError(
                    f"{type(block).__name__} has no {name}: the tensor-parallel plan is for Llama-style blocks"
                )
            if hasattr(modules[name], "base_layer"):  # peft's LoRA layer around the base
                plan[f"{name}.base_layer"] = style()
                for key in getattr(modules[name], adapter):  # a ModuleDict by adapter name
                    plan[f"{name}.{adapter}.{key}"] = style()
            else:
                plan[name] = style()
    return plan


def parallelize(blocks: list[torch.nn.Module], tp_mesh) -> None:
    """Split each block's projections over `tp_mesh` (in place, on meta or materialized)."""
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(block))


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients when parameters live on different meshes (2-D for the
    split layers, dp only for the replicated ones), which torch's clip_grad_norm_ cannot stack:
    each rank's squares, each element counted once by dividing by the ranks that hold its copy."""
    world = dist.get_world_size()
    total = None
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            split = 1
            for dim, placement in enumerate(g.placements):
                if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard over a tp split
                    split *= mesh.size(dim)
            copies = world // split
            g = g.to_local()
        else:
            copies = world
        part = g.detach().float().pow(2).sum() / copies
        total = part if total is None else total + part
    total = total if total is not None else torch.zeros((), device=params[0].device)
    dist.all_reduce(total)
    return total.sqrt()


def clip_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip every gradient by the global norm (`grad_norm`); returns the norm before clipping."""
    norm = grad_norm(params)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(coefficient.to(local.dtype))
    return norm
