"""Parallelism strategies behind one interface; `build_strategy` picks one by the job's field.

Importing the package does not import torch: `deepspeed_config` is pure and the driver's
`raytrain validate` uses it; `Strategy` and `build_strategy` load torch when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import RunPlan

if TYPE_CHECKING:
    import torch

    from ..config import JobSpec
    from .base import Strategy


def __getattr__(name: str):
    if name == "Strategy":
        from .base import Strategy

        return Strategy
    raise AttributeError(name)


def build_strategy(spec: JobSpec, device: torch.device, plan: RunPlan | None = None, on_phase=None) -> Strategy:
    """The strategy the plan names, set up. Without a driver's plan (tests, benchmarks, the GPU
    suite) the job's own: `RunPlan.of(spec)`. `on_phase("loaded")` is called once the trained
    model's weights are in place, before the optimizer and anything else (the start-up record)."""
    plan = plan or RunPlan.of(spec)
    name = spec.training.strategy
    if name == "fsdp2":
        from .fsdp2 import FSDP2Strategy as cls
    elif name == "ddp":
        from .ddp import DDPStrategy as cls
    else:
        from .zero3 import Zero3Strategy as cls
    strategy = cls(spec, device, plan)
    if on_phase is not None:
        strategy.on_phase = on_phase
    strategy.setup()
    return strategy


__all__ = ["Strategy", "build_strategy"]
