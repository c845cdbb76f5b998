"""DDP: every worker holds the whole model; gradients are all-reduced on the last micro-batch.
The baseline for models that fit on one device."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from .base import TorchStrategy


class DDPStrategy(TorchStrategy):
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)  # broadcasts rank 0's weights

    def autocast(self):
        if self.compute_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        with contextlib.nullcontext() if sync else self.model.no_sync():
            loss.backward()
