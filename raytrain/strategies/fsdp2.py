"""FSDP2: `fully_shard` on every decoder block, then the root. The only place raytrain
shards a model with torch.

Built on meta everywhere but rank 0, sharded, then materialized and filled from rank 0's
weights by a broadcast, so a node holds one full copy of the model at most, not one per GPU.
Trained weights are fp32 shards (the master copy) whatever `model.dtype` loads, with bf16
compute through the MixedPrecisionPolicy on GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .. import modeling
from .base import TorchStrategy, needs_fp32_master, to_fp32_master


class FSDP2Strategy(TorchStrategy):
    def build_model(self) -> torch.nn.Module:
        self.hf_model = modeling.load_model(self.spec, on_meta=self.rank != 0)
        return self.hf_model

    def build_reference(self) -> torch.nn.Module:
        # Sharded like the model: each rank keeps 1/N of the frozen copy, gathered per block.
        return self.wrap(modeling.load_model(self.spec, on_meta=self.rank != 0).requires_grad_(False).eval())

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        full_state = model.state_dict() if self.rank == 0 else {}
        # fp32 master weights for what trains: cast on meta (free), so no rank ever holds a whole
        # fp32 copy; rank 0's loaded weights stay in full_state and fill the fp32 shards below.
        upcast = needs_fp32_master(model)
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if self.rank == 0 and upcast else {}
        if upcast:
            model.to("meta")
            to_fp32_master(model)
        offload = self.spec.training.offload
        # Offload moves shards from the accelerator to host memory; on a CPU worker they are there
        # already (and CPUOffloadPolicy needs an accelerator to move them back to).
        cpu_offload = (offload.params or offload.optimizer) and self.device.type != "cpu"
        kwargs = dict(
            mesh=init_device_mesh(self.device.type, (self.world_size,)),
            # bf16 compute with fp32 gradient reduction on GPU; fp32 throughout on CPU.
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.compute_bf16 else None,
                                           reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
        for block in modeling.decoder_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if self.rank != 0 or upcast:
            model.to_empty(device="cpu" if cpu_offload else self.device)
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])
        set_model_state_dict(model, full_state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # Non-persistent buffers (rotary frequencies) are in no state dict: broadcast them too.
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
        return model

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # Skipping the reduce-scatter before the last micro-batch keeps each parameter's whole fp32
        # gradient on every rank until the step: cheap for adapters, the model's size for full
        # fine-tuning, which therefore reduce-scatters every micro-batch (`JobSpec.sync_every_micro_batch`).
        self.model.set_requires_gradient_sync(sync or self.spec.sync_every_micro_batch)
        loss.backward()
