"""Parallelism strategies behind one interface (base.py's `Strategy`); `build_strategy` picks one by
the job's field and imports only that one's module (DeepSpeed only for zero3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain.job.plan import RunPlan

if TYPE_CHECKING:
    import torch

    from raytrain.job.spec import JobSpec
    from raytrain.strategies.base import Strategy


def build_strategy(spec: JobSpec, device: torch.device, plan: RunPlan | None = None, on_phase=None) -> Strategy:
    """The strategy the plan names, set up. Without a driver's plan (tests, benchmarks, the GPU
    suite) the job's own: `RunPlan.of(spec)`. `on_phase("loaded")` is called once the trained
    model's weights are in place, before the optimizer and anything else (the start-up record)."""
    plan = plan or RunPlan.of(spec)
    name = spec.training.strategy
    if name == "fsdp2":
        from raytrain.strategies.fsdp2 import FSDP2Strategy as cls
    elif name == "ddp":
        from raytrain.strategies.ddp import DDPStrategy as cls
    else:
        from raytrain.strategies.zero3 import Zero3Strategy as cls
    strategy = cls(spec, device, plan)
    if on_phase is not None:
        strategy.on_phase = on_phase
    strategy.setup()
    return strategy
