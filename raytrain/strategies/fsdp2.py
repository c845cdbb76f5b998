"""FSDP2: `fully_shard` on every decoder block, on an untied input embedding, then the root.
The only place raytrain shards a model with torch.

The units as torchtitan lays them out (`apply_fsdp`), where a hook can gather them: a block is
gathered for its forward and again for its backward; an input embedding of its own (untied) is
one unit, gathered only at the first forward and the last backward, so its table is not held at
the loss, where a step's memory peaks. The root keeps what is used outside a module's own call:
the output layer (the chunked loss applies its weight after the model's forward, objectives/tokens)
and with it a tied table (the same weight at both ends), the last norm, and nothing else; a frozen
output layer (LoRA) is outside FSDP2 instead (`_ignored`): split by rows over the ranks with the
lookup tied to it (vocab_parallel.py), or whole on every rank where the job rules that out. On an
accelerator the last block stays gathered from its forward to its backward, which follows at once
(torchtitan's choice: FSDP would prefetch it straight back); on CPU workers, host memory is the
limit and it reshards as every block does.

Built on meta on every rank, sharded, materialized shard by shard, then filled from the
model's safetensors files, each rank reading only its slices (`weights.fill`): no process
holds the whole model at any point. Trained weights are fp32 shards (the master copy) whatever
`model.dtype` loads, with bf16 compute through the MixedPrecisionPolicy on GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from raytrain.job.plan import splits_vocabulary
from raytrain.model import modeling, qlora
from raytrain.strategies import tensor_parallel, vocab_parallel, weights
from raytrain.strategies.base import TorchStrategy, needs_fp32_master, to_fp32_master


class FSDP2Strategy(TorchStrategy):
    _gathered = False  # inside `gathered()`

    def __init__(self, *args, **kwargs):
        self._reshard: dict[torch.nn.Module, bool] = {}  # each unit's reshard_after_forward (`wrap`), for `gathered()`
        super().__init__(*args, **kwargs)

    def build_model(self) -> torch.nn.Module:
        self.hf_model = modeling.load_model(self.spec, on_meta=True)
        return self.hf_model

    def build_reference(self) -> torch.nn.Module:
        # Sharded like the model: each rank keeps 1/N of the frozen copy, gathered per block.
        return self.wrap(modeling.load_model(self.spec, on_meta=True).requires_grad_(False).eval())

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        adapters = modeling.take_adapters(model)
        if self.spec.training.finetune == "qlora":  # the frozen base in NF4: fully_shard shards its 4-bit codes
            qlora.quantize_on_meta(model)
        nf4 = qlora.quantized_weights(self.spec, model)
        # fp32 master weights for what trains: cast on meta (free), so no rank ever holds a whole
        # fp32 copy; `weights.fill` rounds them through model.dtype as from_pretrained would.
        if needs_fp32_master(model):
            to_fp32_master(model)
        offload = self.spec.training.offload
        # Offload moves shards from the accelerator to host memory; on a CPU worker they are there
        # already (and CPUOffloadPolicy needs an accelerator to move them back to).
        cpu_offload = (offload.params or offload.optimizer) and self.device.type != "cpu"
        dp_mesh, tp_mesh = self.device_meshes()
        if tp_mesh is not None:  # split each block's projections over tp first, then shard what each rank holds
            tensor_parallel.parallelize(modeling.decoder_blocks(model), tp_mesh)
        ignored, retie = self._ignored(model, nf4, dp_mesh, cpu_offload)
        kwargs = dict(
            mesh=dp_mesh,
            ignored_params=ignored or None,
            # bf16 compute with fp32 gradient reduction on GPU; fp32 throughout on CPU.
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if self.compute_bf16 else None, reduce_dtype=torch.float32
            ),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        )
        blocks = modeling.decoder_blocks(model)
        for block in blocks:
            self._reshard[block] = block is not blocks[-1] or self.device.type == "cpu"
            fully_shard(block, reshard_after_forward=self._reshard[block], **kwargs)
        embedding = modeling.untied_input_embedding(model)
        if embedding is not None and not getattr(embedding, "vocab_split", False):
            self._reshard[embedding] = True
            fully_shard(embedding, **kwargs)
        fully_shard(model, **kwargs)
        self._reshard[model] = False  # the root: fully_shard keeps its parameters from forward to backward
        model.to_empty(device="cpu" if cpu_offload else self.device)
        if retie:  # to_empty gave each end a table of its own (a meta tensor moves by a new Parameter)
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        modeling.init_buffers(model)
        self.loaded_by = weights.fill(self.spec, model, adapters)
        return model

    def _ignored(self, model: torch.nn.Module, nf4, dp_mesh, cpu_offload: bool) -> tuple[set, bool]:
        """The parameters FSDP2 leaves whole on every rank, and whether the output layer must be tied
        to the input embedding again once materialized (`to_empty` gives each end a table of its own:
        a meta tensor moves by a new Parameter).

        On one shard there is nothing to shard, and FSDP2 gathers a one-rank group's parameters as
        plain bytes, bypassing NF4's all-gather extension: the NF4 weights stay outside it there.
        A frozen output layer (LoRA; with a tied table, the lookup too) is whole too: in the root it
        would be gathered from the first forward to the last backward anyway, through an all-gather
        buffer as large again, each step; whole, it costs only the other ranks' rows (tied SmolLM2
        LoRA: a worker's peak 1,527 -> 1,331 MiB, benchmarks/RESULTS.md). Only in the dtype it
        computes in: FSDP2 casts what it manages, not what it ignores. Where the job allows
        (plan.splits_vocabulary) it is split by rows over the ranks instead, with the lookup tied to
        it or frozen beside it (vocab_parallel.py): 1/N of the table a rank, none of it gathered."""
        ignored = set(nf4) if dp_mesh.size(dp_mesh.ndim - 1) == 1 else set()
        head = modeling.frozen_output_weight(model)
        if head is None or head in ignored or cpu_offload or (self.compute_bf16 and head.dtype != torch.bfloat16):
            return ignored, False
        splits = splits_vocabulary(self.spec, self.world_size, model.config.to_dict())
        split = vocab_parallel.split(model, dp_mesh) if splits else set()
        return ignored | (split or {head}), modeling.tied(model)

    def device_meshes(self):
        """(FSDP2's mesh, the tp mesh or None) as `RunPlan.mesh_shape` lays the ranks out: one flat
        mesh or HSDP's replicate x shard, the sequence-parallel ranks inside shard (they hold one
        model and average gradients), x tp when tensor parallel (a 2-D/3-D mesh of DTensors)."""
        shape = self.plan.mesh_shape(self.world_size)
        names = ("replicate", "shard")[-len(shape) :]
        if self.layout.tp == 1:
            return init_device_mesh(self.device.type, shape, mesh_dim_names=names), None
        mesh = init_device_mesh(self.device.type, (*shape, self.layout.tp), mesh_dim_names=(*names, "tp"))
        return mesh[names], mesh["tp"]

    def full_parameters(self, trainable_only: bool = False):
        """Each parameter whole: a shard's all-gather (`full_tensor`) per parameter, or, inside
        `gathered` (GRPO's step), the unsharded parameter itself."""
        from torch.distributed.tensor import DTensor

        for name, p in self.hf_model.named_parameters():
            if p.requires_grad or not trainable_only:
                yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()

    @contextlib.contextmanager
    def gathered(self):
        """The whole model gathered once and kept until the context ends, then resharded: GRPO's pass over a step
        (loop.train_step: the rollout, then each micro-batch's forward and backward; regathered for each of
        num_iterations' updates, which change the shards) runs inside, so neither a decode step per token nor each
        forward and backward all-gathers the model again (RL1, benchmarks/RESULTS.md: a rollout 0.88-0.91x, a step's
        training half ~0.8x on 2 gloo ranks, 135M model; the same losses bit for bit). Gradients still reduce-scatter to
        their shards at the last backward. Each rank holds the whole model in the compute dtype meanwhile, as TRL's
        ds3_gather_for_generation and verl's hybrid engine do (memory.py counts it). Re-entrant: the rollout inside a
        gathered step gathers nothing more. Each unit's own setting is restored after (`wrap`)."""
        if self._gathered:
            yield
            return
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()
        self._gathered = True
        try:
            yield
        finally:
            self._gathered = False
            for m in units:
                m.reshard()
                m.set_reshard_after_forward(self._reshard.get(m, True), recurse=False)
                m.set_reshard_after_backward(True, recurse=False)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        if self.layout.tp == 1:
            return super().clip_gradients(max_norm)
        # Split and replicated weights live on different meshes: torch's clip cannot stack their norms.
        return tensor_parallel.clip_(self.params, max_norm)

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # Skipping the reduce-scatter before the last micro-batch keeps each parameter's whole fp32
        # gradient on every rank until the step: cheap for adapters, the model's size for full
        # fine-tuning, which therefore reduce-scatters every micro-batch (`RunPlan.sync_every_micro_batch`).
        self.model.set_requires_gradient_sync(sync or self.plan.sync_every_micro_batch)
        loss.backward()
