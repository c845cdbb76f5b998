"""Per-step telemetry: where the time goes, peak memory, and model FLOPs utilization.

FLOPs per token follow torchtitan's `get_num_flop_per_token`: 6·N for the dense matmuls
(forward 2N, backward 4N) plus the attention term 12·L·H·Dh·T. LoRA skips the weight
gradients of frozen weights, so its dense cost is 4·N_frozen + 6·N_trainable; both are
reported (mfu uses what was actually computed). DPO adds its reference model's forward
(2·N + a third of the attention term) per token. MFU needs the device's peak FLOP/s, taken
from a table of dense bf16 figures; on CPU raytrain reports throughput only.
"""

from __future__ import annotations

import resource
import sys

import torch

from raytrain.job import objectives

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "V100": 125e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


def flops_per_token(
    config, n_params: int, n_trainable: int, seq_len: int, lora: bool, extra_forwards: int = 0
) -> dict[str, float]:
    """`extra_forwards`: forwards without backward a trained token also pays (DPO's reference;
    KTO's reference and the two of its KL sequence)."""
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // max(1, heads))
    attention = 12 * layers * heads * head_dim * seq_len
    full = 6 * n_params + attention
    actual = (4 * (n_params - n_trainable) + 6 * n_trainable + attention) if lora else full
    if extra_forwards:
        extra = extra_forwards * (2 * n_params + attention / 3)
        full, actual = full + extra, actual + extra
    return {"flops_per_token": float(actual), "flops_per_token_full_ft": float(full)}  # host: Python numbers


def peak_flops(device: torch.device) -> float | None:
    if device.type == "cpu":
        return None
    name = torch.get_device_module(device).get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated by this rank (no host sync: the allocator's count); on
    CPU the process's peak RSS."""
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class StepFlops:
    """Tokens/s -> achieved FLOP/s and MFU for one rank's model."""

    def __init__(self, model: torch.nn.Module, spec, device: torch.device):
        # Global sizes: a DTensor's numel() is already global; ZeRO-3 keeps it in ds_numel.
        sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in model.parameters()]
        n = sum(size for size, _ in sizes)
        trainable = sum(size for size, grad in sizes if grad)
        base = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", model)
        config = getattr(base, "config", None) or getattr(getattr(base, "module", base), "config", None)
        self.per_token = flops_per_token(
            config,
            n,
            trainable,
            spec.data.seq_len,
            spec.training.adapters,
            extra_forwards=objectives.extra_forwards(spec),
        )
        self.peak = peak_flops(device)

    def metrics(self, tokens_per_s: float, world: int) -> dict[str, float]:
        out = {"tflops_per_s": tokens_per_s * self.per_token["flops_per_token"] / 1e12}
        if self.peak:
            out["mfu"] = out["tflops_per_s"] * 1e12 / (self.peak * world)
        return out
