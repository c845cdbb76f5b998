"""AdamW's step at a rank's share of a real model: torch's default kernel (what a CPU worker got before
2026-11-27, and what a hand-rolled script gets) against the fused one `strategies.base.adamw` uses.

    python -m benchmarks.optimizer_kernel            # SmolLM2-135M's tensors, one rank of 2; 1 thread

The parameters are the shapes of one rank's FSDP2 shards of SmolLM2-135M (`benchmarks.memory.SMOLLM2`:
hidden 576, 30 layers, vocabulary 49152, tied embeddings; 135M parameters, half a rank), fp32, with
random gradients; one torch thread, as raytrain's CPU workers run. Prints the median step of each kernel (after a first
step that creates AdamW's state), their ratio, and how far the two kernels' weights are apart after
10 steps of the same gradients (the same update, to rounding)."""

from __future__ import annotations

import statistics
import time

import torch

from .memory import SMOLLM2

WORLD = 2


def shapes() -> list[tuple[int, ...]]:
    """One rank's shards (dim 0 split in two, as FSDP2's Shard(0)) of the model's parameters (the
    tied embedding once), read from the model transformers builds, on the meta device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2))
    return [((p.shape[0] + WORLD - 1) // WORLD, *p.shape[1:]) for p in model.parameters()]


def run(
    shards: list[tuple[int, ...]], fused: bool, steps: int, seed: int = 0
) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shards]
    optimizer = torch.optim.AdamW(
        params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True if fused else None
    )
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[1:], [p.detach() for p in params]


def main() -> None:
    torch.set_num_threads(1)
    shards = shapes()
    n = sum(torch.Size(s).numel() for s in shards)
    print(f"AdamW step, one rank's share of SmolLM2-135M: {n / 1e6:.1f}M fp32 parameters, 1 torch thread", flush=True)
    default_t, default_w = run(shards, False, 11)
    fused_t, fused_w = run(shards, True, 11)
    d, f = statistics.median(default_t), statistics.median(fused_t)
    apart = max((a - b).abs().max().item() for a, b in zip(default_w, fused_w))
    print(f"default kernel: median {d:.4f} s ({min(default_t):.4f}..{max(default_t):.4f}, n={len(default_t)})")
    print(f"fused kernel:   median {f:.4f} s ({min(fused_t):.4f}..{max(fused_t):.4f}, n={len(fused_t)})")
    print(f"SUMMARY optimizer: default / fused = {d / f:.2f}; weights after 10 steps at most {apart:.1e} apart")


if __name__ == "__main__":
    main()
