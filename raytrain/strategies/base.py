"""The one interface the training loop talks to, and the torch-native parts that FSDP2
and DDP share (AdamW over trainable parameters, clipping, DCP checkpoints through dcp_files.py, HF export).

A strategy owns everything that differs between parallelisms: how the model is built
and wrapped, how backward and accumulation sync, how state is saved, loaded and exported.
The loop owns the rest and has no `if strategy == ...` anywhere.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job import masks
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.model import attention, kernels, modeling, moe
from raytrain.rundir.signing import SignedCheckpoint
from raytrain.strategies import hf_files, ulysses, vocab_parallel
from raytrain.strategies.dcp_files import SplitWriter, read_checkpoint
from raytrain.strategies.hf_files import export_entries, write_full_export, write_hf_export


class Strategy(ABC):
    """Build, step, save, load and export one model on one worker of a process group."""

    def __init__(self, spec: JobSpec, device: torch.device, plan: RunPlan):
        # Why `model.attn_implementation: auto` chose what runs (the kernel line); then the job as its parts
        # read it, with the implementation resolved (every part of a worker reads the one it runs).
        self.attention_choice = attention.choice(spec)[1]
        spec = attention.resolve(spec)
        self.spec, self.plan = spec, plan  # the job as written; what the driver resolved it to
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.compute_bf16 = plan.bf16
        try:
            self.layout = plan.mesh(self.world_size)  # dp_replicate x dp_shard x sp x tp (`plan.Mesh`)
        except ValueError as exc:  # an elastic group of a size no whole number of sp x tp groups makes
            raise JobError(str(exc)) from None
        # This rank's part of each sequence (objectives.forward), None without sequence parallelism.
        self.sequence = ulysses.SequenceSplit.create(self.layout, self.rank, spec.model.attn_implementation)
        self.model: torch.nn.Module  # what the loop calls forward on
        self.loss_chunk = 0  # tokens per cross-entropy chunk (objectives/tokens.py); 0: the whole logits
        self.fused_loss = None  # Liger's fused linear cross-entropy where it runs (kernels.fused_loss)
        self.block_kernels = None  # Liger's block kernels' name where they run (kernels.block_kernels)
        self.on_phase = lambda phase: None  # build_strategy's: "loaded" once the weights are in place
        # Two gloo groups, made at first use, each for collectives of one background thread: DCP's
        # async save plans in its own thread (`_save_group`), train/checkpoint.py signs in Ray's upload
        # thread (`upload_group`). One group shared by two threads would pair one thread's call on
        # one rank with the other thread's on another.
        self._save_group = None
        self.upload_group = None

    @abstractmethod
    def setup(self) -> None:
        """Load and wrap the model, build the optimizer."""

    @functools.cached_property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The windows the model's layers attend within (masks.windows), for the masks each micro-batch needs."""
        config = self.hf_model.config
        return masks.windows(
            {k: getattr(config, k, None) for k in ("sliding_window", "layer_types", "use_sliding_window")},
            self.spec.data.seq_len,
        )

    @functools.cached_property
    def attention_kernel(self) -> str:
        """The kernel the model's attention runs here (kernels.attention_kernel): the job's
        implementation, or torch's varlen flash kernel for sdpa on a GPU."""
        return kernels.attention_kernel(
            self.spec.model.attn_implementation,
            self.device,
            torch.bfloat16 if self.compute_bf16 else torch.float32,
            self.hf_model.config.to_dict(),
            self.attention_windows,
        )

    @functools.cached_property
    def router_aux_coef(self) -> float:
        """`training.router_aux_loss_coef` resolved for the model (moe.router_aux_coef: TRL's meaning); 0: none."""
        config = self.hf_model.config.to_dict()
        problem = moe.router_aux_problem(self.spec.training.router_aux_loss_coef, config)
        if problem:  # validate refuses it first, from config.json
            raise JobError(problem)
        return moe.router_aux_coef(self.spec.training.router_aux_loss_coef, config)

    @functools.cached_property
    def router_top_k(self) -> int:
        return moe.top_k(self.hf_model.config.to_dict())

    def adapter_line(self) -> str:
        """What the job trains, per group (targets.audit of what peft built), for the start-up line and MLflow."""
        return modeling.audit(self.hf_model, full=not self.spec.training.adapters)

    def kernel_line(self) -> str:
        """What runs a step's hottest parts on this worker, for the start-up line and MLflow's tags."""
        loss = (
            "cross-entropy over the vocabulary's rows split across ranks"
            if isinstance(self.fused_loss, vocab_parallel.Loss)
            else "Liger's fused linear cross-entropy"
            if self.fused_loss is not None
            else f"cross-entropy in chunks of {self.loss_chunk} tokens"
            if self.loss_chunk
            else "cross-entropy"
        )
        note = "" if self.fused_loss is not None else kernels.fused_loss_note(self.spec, self.device)
        loss += f" ({note})" if note else ""
        blocks = "compiled" if self.plan.compile else f"eager ({self.block_kernels})" if self.block_kernels else "eager"
        chosen = f" ({self.attention_choice})" if self.attention_choice else ""
        experts = modeling.experts_kernel(self.spec, self.hf_model.config.to_dict())
        return f"attention {self.attention_kernel}{chosen}, loss {loss}, blocks {blocks}" + (
            f", experts {experts}" if experts else ""
        )

    def with_block_kernels(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with Liger's block kernels where they run here (kernels.block_kernels): the trained
        model and a reference copy alike, so both compute the same way."""
        self.block_kernels = kernels.block_kernels(self.spec, self.device, self.plan.compile, model)
        return model

    def autocast(self):
        """Context for forward passes (strategies that cast inside the wrapper return a no-op)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def reference(self):
        """DPO's frozen reference model, to call under no_grad: under LoRA the same sharded model
        with its adapter off (no second copy); under full fine-tuning the frozen copy that
        `setup` built, sharded like the model."""
        if self.spec.training.adapters:
            with self.hf_model.disable_adapter():
                yield self.model
        else:
            yield self.reference_model

    def gathered(self):
        """Context for GRPO's step (loop.train_step: its rollout and its forwards and backwards):
        whatever makes many forwards of one model cheap. Here nothing (DDP holds the whole model;
        ZeRO-3 gathers each layer per forward)."""
        return contextlib.nullcontext()

    def full_parameters(self, trainable_only: bool = False):
        """Each parameter whole, one at a time, as (name, tensor) on every rank, in the same order
        everywhere (a collective where it is sharded): the rollout engine's weight sync
        (rl/engine.py). Tied weights once. Here (DDP) every rank holds them whole."""
        for name, p in self.hf_model.named_parameters():
            if p.requires_grad or not trainable_only:
                yield name, p.detach()

    @abstractmethod
    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        """Accumulate gradients; `sync` is True on the last micro-batch of a step."""

    @abstractmethod
    def begin_update(self, lr: float) -> torch.Tensor:
        """Set learning rate `lr` and clip the gradients by their global norm; returns the norm
        before clipping, a 0-dim tensor the loop reads with the step's other values (no host sync)."""

    @abstractmethod
    def end_update(self, apply: bool) -> bool:
        """After the loop has read the norm: step the optimizer if `apply` (the norm was finite),
        then zero the gradients. Returns whether the weights changed."""

    @abstractmethod
    def save(self, directory: str) -> None:
        """Write this rank's part of the model and optimizer state into `directory` (collective)."""

    def save_async(self, directory: str) -> Callable[[], None]:
        """Start writing this rank's part into `directory` (collective); returns a function that
        blocks until the files are complete. Default: the write happens here, synchronously."""
        self.save(directory)
        return lambda: None

    @abstractmethod
    def load(self, checkpoint: SignedCheckpoint) -> None:
        """Restore from a committed checkpoint, at any world size, fetching only the files this
        rank needs (collective)."""

    @abstractmethod
    def export(self, directory: str, tokenizer) -> None:
        """Write a plain HF model (or peft adapter) to `directory` on rank 0 (collective)."""


class TorchStrategy(Strategy):
    """FSDP2 and DDP: torch AdamW, torch.distributed.checkpoint, one export path."""

    hf_model: torch.nn.Module  # the unwrapped (peft) model, for names and export
    reference_model: torch.nn.Module  # DPO under full fine-tuning only

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Return the parallel model."""

    def setup(self) -> None:
        hf_model = self.with_block_kernels(enable_activation_checkpointing(self.spec, self.build_model()))
        self.model = self.wrap(compile_blocks(self.plan.compile, hf_model, self.device))
        modeling.sparse_tied_lookup(self.hf_model, self.device)
        self.on_phase("loaded")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_chunk = self.spec.loss_chunk_tokens(self.hf_model.config.to_dict())
        self.fused_loss = (
            vocab_parallel.Loss(self.loss_chunk)
            if vocab_parallel.is_split(self.hf_model)
            else kernels.fused_loss(self.spec, self.device)
        )
        self.optimizer = adamw(self.params, self.spec)
        self.trainable = modeling.trainable_names(self.hf_model)
        if self.spec.reference_copy:
            self.reference_model = self.with_block_kernels(self.build_reference())
        if self.sequence:  # attention over whole sequences through the all-to-all
            self.sequence.use_for(self.hf_model)
            if self.spec.reference_copy:
                self.sequence.use_for(self.reference_model)

    def build_model(self) -> torch.nn.Module:
        self.hf_model = modeling.load_model(self.spec)
        return self.hf_model

    def build_reference(self) -> torch.nn.Module:
        """A frozen copy of the starting model; here whole on every rank, as DDP holds its model."""
        return modeling.load_model(self.spec).requires_grad_(False).eval().to(self.device)

    def begin_update(self, lr: float) -> torch.Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return self.clip_gradients(self.spec.training.grad_clip or math.inf)

    def end_update(self, apply: bool) -> bool:
        if apply:  # a non-finite step leaves the weights and AdamW's moments and counts as they were
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return apply

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global norm; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # --- checkpoints: DCP, each rank writes its shards; resharding on load is DCP's ---
    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.spec.training.adapters:  # frozen base weights come from model.path again
            model_sd = {k: v for k, v in model_sd.items() if k in self.trainable}
        return {"model": model_sd, "optim": optim_sd}

    def save(self, directory: str) -> None:
        dcp.save(self._state(), storage_writer=SplitWriter(directory))

    def save_async(self, directory: str) -> Callable[[], None]:
        # DCP copies the state into CPU memory (the next steps change the parameters), then a
        # background thread writes the files; its collectives run on a gloo group of their own,
        # since two threads on one group could interleave collectives.
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        future = dcp.async_save(self._state(), storage_writer=SplitWriter(directory), process_group=self._save_group)
        return future.result

    def load(self, checkpoint: SignedCheckpoint) -> None:
        state = self._state()
        read_checkpoint(state, checkpoint)
        result = set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False),
        )
        modeling.require_complete(
            self.model, result.missing_keys, result.unexpected_keys, self.spec.training.finetune, checkpoint.where
        )

    def export(self, directory: str, tokenizer) -> None:
        if self.spec.training.adapters:  # only the adapter is gathered, on rank 0
            adapter = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            )
            if self.rank == 0:
                write_hf_export(self.spec, self.hf_model, adapter, directory, tokenizer)
        else:  # every rank writes its file, each tensor gathered to its writer, one at a time (hf_files.py)
            tensors = hf_files.export_tensors(self.hf_model)
            entries = export_entries(self.spec, tensors)
            owner = hf_files.file_owners(entries, self.world_size)
            whole = ((k, gather_to(t, owner[k])) for k, t in tensors.items())
            write_full_export(
                self.spec, self.hf_model, whole, entries, directory, tokenizer, self.rank, self.world_size
            )
        dist.barrier()


@torch.no_grad()
def gather_to(t: torch.Tensor, dst: int) -> torch.Tensor | None:
    """`t` whole on global rank `dst` and None elsewhere (collective over `t`'s mesh): an FSDP2
    weight (one mesh dimension, rows sharded as torch.chunk cuts them: ceil(n/W) a rank, the last
    ones shorter or empty) is gathered to its writer only, W x less traffic and no whole copy
    on the other ranks. Any other layout (tensor parallel, HSDP) is gathered to every rank."""
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    if (
        mesh.ndim != 1
        or tuple(t.placements) != (Shard(0),)
        or not t.shape[0]
        or dst not in dist.get_process_group_ranks(mesh.get_group())
    ):
        return t.full_tensor()
    # Detached: a trained weight's shard requires grad, and NCCL's gather on one rank copies it into
    # `out`'s chunks (views) with autograd watching, which refuses an in-place write to such views.
    group, local, n = mesh.get_group(), t.to_local().detach(), t.shape[0]
    per = -(-n // mesh.size())
    padded = (
        local if local.shape[0] == per else torch.cat([local, local.new_zeros((per - local.shape[0], *t.shape[1:]))])
    )
    out = (
        torch.empty((per * mesh.size(), *t.shape[1:]), dtype=t.dtype, device=local.device)
        if dist.get_rank() == dst
        else None
    )
    dist.gather(padded.contiguous(), list(out.chunk(mesh.size())) if out is not None else None, dst=dst, group=group)
    return out[:n] if out is not None else None


def adamw(params: list, spec: JobSpec) -> torch.optim.AdamW:
    """The job's AdamW, on torch's fused kernel (as torchtitan's): one pass over each parameter's memory.
    The default on a CPU worker is a loop of ~6 tensor ops a parameter, with two temporaries of its size:
    3.4-3.8x the fused kernel's time at a SmolLM2-135M rank's share (benchmarks.optimizer_kernel). The same
    update to rounding."""
    o = spec.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)


def needs_fp32_master(model: torch.nn.Module) -> bool:
    return any(p.requires_grad and p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters())


def to_fp32_master(model: torch.nn.Module) -> None:
    """Trained weights in fp32, whatever dtype the model was loaded in, so AdamW steps fp32
    weights with fp32 state under every strategy (as ZeRO-3's bf16 mode does); compute casts
    to bf16 (FSDP2's MixedPrecisionPolicy, DDP's autocast). A tied weight stays one parameter."""
    cast: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                setattr(module, name, cast.setdefault(id(p), torch.nn.Parameter(p.detach().float())))


def enable_activation_checkpointing(spec: JobSpec, hf_model: torch.nn.Module) -> torch.nn.Module:
    """`training.activation_checkpointing`, the same under every strategy: transformers recomputes
    each decoder block in backward (non-reentrant: works under fully_shard, DDP and ZeRO-3)."""
    if spec.training.activation_checkpointing:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf_model


def compile_blocks(compile_: bool, hf_model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`training.compile` (as the plan resolves auto): torch.compile each decoder block in place, before
    it is sharded or wrapped (torchtitan's order), so FSDP2's per-block hooks stay outside the compiled graphs."""
    if compile_:
        if device.type == "cpu" and not shutil.which(os.environ.get("CXX", "c++")):
            raise JobError(
                "training.compile on CPU workers needs a C++ compiler (torch.compile builds its CPU "
                "kernels with it) and this node has none: install g++ on every node, or remove "
                "training.compile"
            )
        if device.type == "cpu":  # a node's ranks compile the same graphs: one compiles, the rest load it
            private_apis.one_inductor_compile_at_a_time()
        for block in modeling.decoder_blocks(hf_model):
            block.compile()
    return hf_model
