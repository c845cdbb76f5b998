"""DDP: every worker holds the whole model; gradients are all-reduced on the last micro-batch.
The baseline for models that fit on one device."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from raytrain.strategies.base import TorchStrategy, to_fp32_master


class DDPStrategy(TorchStrategy):
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        to_fp32_master(model)  # trained weights in fp32; bf16 compute through autocast
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)  # broadcasts rank 0's weights

    def autocast(self):
        if self.compute_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        with contextlib.nullcontext() if sync or self.plan.sync_every_micro_batch else self.model.no_sync():
            loss.backward()
