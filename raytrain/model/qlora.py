"""QLoRA (`training.finetune: qlora`): the frozen base's adapted linear weights stored in NF4, the 4-bit NormalFloat of
the QLoRA paper, sharded by FSDP2, dequantized a layer at a time for compute; the adapters and their AdamW state stay
fp32, as under LoRA.

NF4 (Dettmers et al. 2023): the flattened weight in blocks of 64, each block divided by its absmax and every value
rounded to the nearest of 16 NormalFloat levels (4 bits); the blocks' absmax scales are themselves quantized ("double
quantization"): their mean subtracted, then int8 with one scale factor per group of scales. About 0.52 bytes a weight
against bf16's 2.

Why torchao's NF4Tensor: it implements FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather), so
FSDP2 shards and gathers the 4-bit codes themselves, as torchtune's distributed QLoRA does. bitsandbytes' Params4bit has
open FSDP2 defects (bitsandbytes #1945 "FSDP2 breaks Linear4bit"; accelerate #3874; accelerate #3987's loss 0 / grad
norm NaN).

Quantized on load, each rank its own rows: a block never crosses a row (in_features is a multiple of 64) and a group of
scales never crosses a row (the group is gcd(256, blocks a row)), so a shard of whole rows quantizes on its own, except
for the scales' mean, which is the whole weight's: one all-reduce for all weights. The bytes are those of quantizing the
whole weight and slicing it (tests/test_qlora.py holds them to torchao's own quantizer), for any number of ranks: a run
resized to another worker count rebuilds the same base. The base is never checkpointed.

torchao's NF4Tensor fields and its constructor are torchao's internals: used in this module only, with the version
checked (private_apis.TESTED, the one registry of tested versions). The layout rules (block, group, what shards) are
nf4_layout.py's, which validate reads without torch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job.nf4_layout import BLOCK, group_size

TESTED = private_apis.TESTED["torchao"]  # the torchao version whose NF4Tensor internals this module was tested with
LEVELS = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)  # the NF4 code book (torchao's, the QLoRA paper's rounded)


def nf4():
    """torchao's NF4 module, or a JobError saying what to install."""
    try:
        import torchao
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as exc:
        raise JobError(
            f"training.finetune: qlora needs torchao on every worker ({type(exc).__name__}: {exc}); "
            f"pip install 'torchao=={TESTED}.*' in the workers' image"
        ) from None
    if not torchao.__version__.startswith(TESTED + "."):
        raise JobError(
            f"training.finetune: qlora was tested with torchao {TESTED}, and the workers have "
            f"{torchao.__version__}: pip install 'torchao=={TESTED}.*'"
        )
    return nf4_tensor


def base_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers under peft's LoRA adapters: the weights QLoRA stores in NF4."""
    return {
        name: module.base_layer
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and isinstance(getattr(module, "base_layer", None), nn.Linear)
    }


def quantized_weights(spec, model: nn.Module) -> set[nn.Parameter]:
    """The parameters a job stores in NF4: its adapted layers' weights under qlora, else none."""
    if spec.training.finetune != "qlora":
        return set()
    return {layer.weight for layer in base_layers(model).values()}


def quantize_on_meta(model: nn.Module) -> None:
    """Make each adapted layer's frozen weight an empty NF4Tensor on meta (codes and scales
    sized, no values), so that fully_shard shards the 4-bit bytes; `fill` gives them values."""
    for layer in base_layers(model).values():
        w = layer.weight
        if w.device.type != "meta":
            raise RuntimeError("qlora.quantize_on_meta: the model must be on meta (built by load_model(on_meta=True))")
        layer.weight = nn.Parameter(empty(w.shape, w.dtype, w.device), requires_grad=False)


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An NF4Tensor of `shape` with uninitialized codes and scales."""
    m = nf4()
    rows, cols = shape
    n, group = rows * cols, group_size(cols)
    meta = m.SubclassTensorArgs(torch.Size(shape), (cols, 1), 0, dtype, torch.device(device), False)
    return m.NF4Tensor(
        meta,
        BLOCK,
        n // BLOCK,
        group,
        torch.empty(n // BLOCK, dtype=torch.int8, device=device),
        torch.empty(n // (BLOCK * group), dtype=dtype, device=device),
        torch.empty((), dtype=dtype, device=device),
        torch.empty(n // 2, dtype=torch.uint8, device=device),
        torch.tensor(LEVELS, dtype=dtype, device=device),
    )


@torch.no_grad()
def codes_and_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 4-bit codes, two a byte; each block's absmax) of whole rows, in their dtype."""
    levels = torch.tensor(LEVELS, dtype=rows.dtype, device=rows.device)
    codes = nf4().NF4Tensor.convert_to_norm_float_weight(rows, rows.numel() // BLOCK, BLOCK, levels)
    return codes, rows.reshape(-1, BLOCK).abs().amax(dim=1)


@torch.no_grad()
def quantize_scales(scales: torch.Tensor, mean: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 scales, a factor a group): the scales around the whole weight's `mean`, torchao's
    double quantization (`NF4Tensor.double_quantize_scalers`) with the mean given."""
    groups = (scales - mean).view(-1, group)
    factor = 256 / (2 * groups.abs().amax(dim=1))
    return (groups * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8), factor.contiguous()


@torch.no_grad()
def fill(weights: dict[str, torch.Tensor], read_rows) -> None:
    """Give the NF4 shards in `weights` (file key -> sharded parameter, after to_empty) their
    values: each rank reads and quantizes the rows it holds (`read_rows(key, first, into)`), then
    one all-reduce gives every weight's scale mean (collective). On HSDP's replicas every term is
    counted once a replica, so the mean is the same."""
    staged, sums = [], []
    for key, p in weights.items():
        shard = _local(p)
        first = _first_row(p, shard.shape[0])
        rows = torch.empty(shard.shape, dtype=shard.dtype, device=shard.quantized_data.device)
        read_rows(key, first, rows)
        codes, scales = codes_and_scales(rows)
        del rows
        shard.quantized_data.copy_(codes)
        staged.append((shard, scales))
        sums += [scales.double().sum(), torch.tensor(scales.numel(), dtype=torch.float64, device=scales.device)]
    if not staged:
        return
    totals = torch.stack(sums)
    dist.all_reduce(totals)
    for i, (shard, scales) in enumerate(staged):
        mean = (totals[2 * i] / totals[2 * i + 1]).to(shard.dtype)
        quantized, factor = quantize_scales(scales, mean, shard.scaler_block_size)
        shard.quantized_scalers.copy_(quantized)
        shard.quantization_factor.copy_(factor)
        # to_empty leaves an NF4Tensor's mean and code book on meta: FSDP2's all-gather reads these
        # two from the local shard itself (`fsdp_pre_all_gather`), so they are set on it.
        shard.scaler_mean = mean
        shard.nf4 = torch.tensor(LEVELS, dtype=shard.dtype, device=mean.device)


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of NF4 shards this rank holds, elements of the weights they are shards of)."""
    held = elements = 0
    for layer in base_layers(model).values():
        shard = _local(layer.weight)
        held += sum(
            t.numel() * t.element_size()
            for t in (shard.quantized_data, shard.quantized_scalers, shard.quantization_factor)
        )
        elements += layer.weight.numel()
    return held, elements


def _local(p: torch.Tensor):
    return private_apis.local_tensor(p)  # not `to_local()`: a view, which FSDP2 would never read


def _first_row(p: torch.Tensor, rows: int) -> int:
    """The first row of the weight this rank's shard holds (FSDP2: Shard(0) on the mesh's last dim,
    replicated on HSDP's first)."""
    mesh = getattr(p, "device_mesh", None)
    return 0 if mesh is None else mesh.get_coordinate()[-1] * rows
