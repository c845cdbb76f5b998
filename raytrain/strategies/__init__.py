"""Parallelism strategies behind one interface; `build_strategy` picks one by the job's field."""

from __future__ import annotations

import torch

from ..config import JobSpec
from .base import Strategy


def build_strategy(spec: JobSpec, device: torch.device) -> Strategy:
    name = spec.training.strategy
    if name == "fsdp2":
        from .fsdp2 import FSDP2Strategy as cls
    elif name == "ddp":
        from .ddp import DDPStrategy as cls
    else:
        from .zero3 import Zero3Strategy as cls
    strategy = cls(spec, device)
    strategy.setup()
    return strategy


__all__ = ["Strategy", "build_strategy"]
