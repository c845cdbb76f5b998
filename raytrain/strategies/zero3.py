"""ZeRO-3: DeepSpeed shards parameters, gradients and optimizer state over the workers.

The loop is the same as for FSDP2 and DDP: it hands over a loss already normalized over the
whole global batch (times world size, since gradient reduction averages over ranks). DeepSpeed
would divide it again by its accumulation steps, so `backward` passes `scale_wrt_gas=False`
and says explicitly which micro-batch ends the step (`set_gradient_accumulation_boundary`):
the gradient DeepSpeed steps on is then the one FSDP2 and DDP step on, and the optimizer
(torch AdamW, unless optimizer state is offloaded on GPU) the same math.

Build: the DeepSpeed config is registered with transformers (`HfDeepSpeedConfig`), which then
creates every layer from the config under `deepspeed.zero.Init` (partitioned as it is built);
`weights.fill_partitioned` fills it one module at a time, rank 0 reading that module's weights
from the safetensors files and DeepSpeed partitioning them: no rank ever holds the whole model.
LoRA adapters are created after, whole, and partitioned by `deepspeed.initialize`.

Checkpoints are DeepSpeed's own `save_checkpoint` folders (tag `ds`), one file pair per rank,
merged by Ray like FSDP2's DCP shards. A checkpoint written at another world size is
converted to DeepSpeed's universal format first and loaded from that.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job import deepspeed_config
from raytrain.model import modeling
from raytrain.rundir.signing import SignedCheckpoint
from raytrain.strategies import hf_files, weights
from raytrain.strategies.base import Strategy, adamw, enable_activation_checkpointing
from raytrain.strategies.dcp_files import fetch_on_every_rank
from raytrain.strategies.hf_files import export_entries, write_full_export, write_hf_export

TAG = "ds"  # the checkpoint's subfolder; fixed, so every committed step_* folder has the same layout
SHM_OP = "deepspeed_shm_comm"


class Zero3Strategy(Strategy):
    def setup(self) -> None:
        init_deepspeed_comm()
        import deepspeed
        from transformers import AutoConfig
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        s = self.spec
        model_config = AutoConfig.from_pretrained(s.model.path, **s.model.hub_kwargs())
        hidden = model_config.get_text_config().hidden_size
        try:
            self.ds_config = deepspeed_config.build(s, self.world_size, hidden)
        except ValueError as exc:
            raise JobError(str(exc)) from None
        self.bf16 = self.ds_config["bf16"]["enabled"]
        self.lora = s.training.finetune == "lora"
        # While this object lives, transformers builds every model under zero.Init (a collective):
        # on for from_pretrained (and peft), off after, or rank 0's plain export copy would hang.
        hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        try:
            self.hf_model, self.loaded_by = load_partitioned(s)
            reference = load_partitioned(s)[0].requires_grad_(False).eval() if s.reference_copy else None
        finally:
            unset_hf_deepspeed_config()
            del hf_ds_config
        self.on_phase("loaded")
        self.with_block_kernels(enable_activation_checkpointing(s, self.hf_model))
        if reference is not None:
            self.with_block_kernels(reference)
        params = [p for p in self.hf_model.parameters() if p.requires_grad]
        optimizer = None
        if deepspeed_config.uses_client_optimizer(self.ds_config):
            optimizer = adamw(params, s)
        try:
            self.engine, *_ = deepspeed.initialize(
                model=self.hf_model, model_parameters=params, optimizer=optimizer, config=self.ds_config
            )
        except Exception as exc:
            if type(exc).__name__ == "ValidationError" and s.training.deepspeed:  # pydantic: a bad override key/value
                raise JobError(f"training.deepspeed: DeepSpeed rejected the merged config: {exc}") from None
            error = op_build_error(exc, "cpu_adam")  # an offloaded optimizer on GPU builds cpu_adam
            if error is None:
                raise
            raise error from exc
        self.model = self.engine
        if reference is not None:  # partitioned like the model; an engine with no optimizer gathers it per layer
            inference = {k: v for k, v in self.ds_config.items() if k not in ("optimizer", "scheduler")}
            self.reference_model, *_ = deepspeed.initialize(model=reference, config=inference)
            self.reference_model.eval()

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # The boundary flag decides whether ZeRO finalizes (and, offloaded, copies out) gradients.
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop's loss is already normalized

    def begin_update(self, lr: float) -> torch.Tensor:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        # Clips to gradient_clipping with the global norm, then steps; a non-finite norm is an
        # "overflow" to ZeRO-3 in every dtype, which skips the update itself (stage3.step).
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # a tensor or a float, by DeepSpeed's version and path
        return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float64).to(self.device)

    def end_update(self, apply: bool) -> bool:
        return apply  # DeepSpeed applied or skipped the step in begin_update, by the same norm

    # --- checkpoints: DeepSpeed's own layout, each rank writes its partition ---
    def save(self, directory: str) -> None:
        # LoRA: the frozen base comes from model.path again, as with FSDP2; only adapters are saved.
        self.engine.save_checkpoint(directory, tag=TAG, exclude_frozen_parameters=self.lora)

    def load(self, checkpoint: SignedCheckpoint) -> None:
        saved = saved_world_size(checkpoint)
        if saved == self.world_size:
            # DeepSpeed reads this rank's own partition files and the shared ones; nothing else is fetched.
            mine = [
                n
                for n in checkpoint.names
                if n.startswith(TAG + "/")  # DeepSpeed's folder: not raytrain's files
                and ("zero_pp_rank_" not in n or f"zero_pp_rank_{self.rank}_" in n)
            ]
            directory = fetch_on_every_rank(checkpoint, mine)
            path, _ = self.engine.load_checkpoint(
                directory, tag=TAG, load_module_strict=not self.lora, load_lr_scheduler_states=False
            )
            if path is None:
                raise JobError(f"could not load the DeepSpeed checkpoint in {checkpoint.where}")
        else:
            self._load_universal(checkpoint, saved)
        self._repartition_persistent()

    def _repartition_persistent(self) -> None:
        """Put the small parameters ZeRO-3 keeps whole back as a fresh engine has them (partitioned
        until the first forward fetches them). load_checkpoint gathers them itself, outside the forward's
        bookkeeping, and a recomputed forward (activation checkpointing) then found DoRA's lora_A
        partitioned (it reads the weight outside lora_A's own forward): an IndexError in the first
        backward after every restore of a zero3 DoRA job with activation checkpointing."""
        persistent = [p for p in self.hf_model.parameters() if getattr(p, "ds_persist", False)]
        if persistent:
            persistent[0].partition(param_list=persistent)

    def _load_universal(self, checkpoint: SignedCheckpoint, saved: int) -> None:
        """Another world size: convert to DeepSpeed's universal checkpoint, once per node (which
        fetches every file of the checkpoint there), and load that."""
        box = [tempfile.mkdtemp(prefix="raytrain-universal-") if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # the same path on every node; each node converts locally
        root = box[0]
        converter = int(os.environ.get("LOCAL_RANK", self.rank)) == 0  # Ray Train sets LOCAL_RANK
        directory = fetch_on_every_rank(checkpoint, checkpoint.names if converter else [])
        if converter:
            os.makedirs(root, exist_ok=True)  # exists on rank 0's node only
            if self.rank == 0:
                print(
                    f"[raytrain] zero3 checkpoint written by {saved} workers, loading with {self.world_size}: "
                    f"converting to a universal checkpoint",
                    file=sys.stdout,
                    flush=True,
                )
            to_universal(str(Path(directory, TAG)), str(Path(root, TAG)))
        dist.barrier()
        with private_apis.universal_checkpoint_load(self.engine):
            self.engine.load_checkpoint(root, tag=TAG, load_module_strict=not self.lora, load_lr_scheduler_states=False)
        dist.barrier()
        if converter:
            shutil.rmtree(root, ignore_errors=True)

    def full_parameters(self, trainable_only: bool = False):
        """Each parameter whole, gathered alone (collective) and released when the caller moves on."""
        import deepspeed

        for name, p in self.hf_model.named_parameters():
            if p.requires_grad or not trainable_only:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    yield name, p.detach()

    def export(self, directory: str, tokenizer) -> None:
        if self.lora:  # the adapter only, gathered on rank 0, in fp32 as it trained (as fsdp2 and ddp export it)
            full = gathered_state_dict(
                self.hf_model, self.rank, fp32_master=self.bf16, dtype=torch.float32, trainable_only=True
            )
            if self.rank == 0:
                write_hf_export(self.spec, self.hf_model, full, directory, tokenizer)
        else:  # every rank writes its file, one gathered tensor at a time (hf_files.py)
            tensors = hf_files.export_tensors(self.hf_model)
            write_full_export(
                self.spec,
                self.hf_model,
                self._whole(tensors),
                export_entries(self.spec, tensors),
                directory,
                tokenizer,
                self.rank,
                self.world_size,
            )
        dist.barrier()

    def _whole(self, tensors: dict[str, torch.Tensor]):
        """Each tensor whole on every rank, one at a time (collectives): a trained weight from its
        fp32 master partitions when training in bf16, so the export loses nothing to compute."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        for key, t in tensors.items():
            if not hasattr(t, "ds_id"):
                yield key, t
            elif self.bf16 and t.requires_grad:
                yield key, safe_get_full_fp32_param(t)
            else:
                with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                    yield key, t


def gathered_state_dict(
    model: torch.nn.Module, rank: int, fp32_master: bool, dtype: torch.dtype, trainable_only: bool = False
) -> dict:
    """The whole state dict on rank 0 (empty elsewhere), gathered one module at a time (collective);
    with `trainable_only`, the trained weights only (a LoRA adapter: the base is never gathered).

    With bf16 training the module holds bf16 copies; trainable weights then come from the fp32
    master partitions instead, so an export loses nothing to the compute precision.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    keys_of: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():  # tied weights: one tensor, two keys
        keys_of.setdefault(id(tensor), []).append(key)
    full: dict[str, torch.Tensor] = {}
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad or not trainable_only]
        buffers = [] if trainable_only else list(module.buffers(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for tensor in params + buffers:
                value = tensor
                if fp32_master and isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                    value = safe_get_full_fp32_param(tensor)  # collective too
                if rank == 0:
                    for key in keys_of.get(id(tensor), []):
                        full[key] = value.detach().to(
                            "cpu", dtype=dtype if value.is_floating_point() else None, copy=True
                        )
    return full


def load_partitioned(spec) -> tuple[torch.nn.Module, str]:
    """(model, how): built partitioned under zero.Init, then filled from the safetensors module by
    module ("sharded"); a model the files do not fit goes through from_pretrained ("rank0")."""
    model = modeling.load_model(spec, empty=True)
    if weights.fill_partitioned(spec, model):
        model.tie_weights()
        return model, "sharded"
    return modeling.load_model(spec), "rank0"


def is_zero3_checkpoint(names: list[str]) -> bool:
    return any(n.startswith(TAG + "/") for n in names)


def consolidated_state_dict(directory: str, trainable_only: bool) -> dict[str, torch.Tensor]:
    """fp32 weights of a committed zero3 checkpoint in one process, no process group (DeepSpeed's
    zero_to_fp32): what `raytrain export` needs. LoRA checkpoints hold the adapters only."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(directory, tag=TAG, exclude_frozen_parameters=trainable_only)


def saved_world_size(checkpoint: SignedCheckpoint) -> int:
    """How many data-parallel ranks wrote the checkpoint: one optimizer-state file each."""
    files = [n for n in checkpoint.names if re.fullmatch(rf"{TAG}/\w*zero_pp_rank_\d+_\w*optim_states\.pt", n)]
    if not files:
        raise JobError(
            f"{checkpoint.where} is not a zero3 checkpoint (no {TAG}/*optim_states.pt); was it written by "
            f"another training.strategy? A job resumes with the strategy that wrote its checkpoints"
        )
    return len(files)


def to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's ds_to_universal, in process, with one worker per stage (it is called per node)."""
    from deepspeed.checkpoint.ds_to_universal import main

    main(
        argparse.Namespace(
            input_folder=input_folder,
            output_folder=output_folder,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )


# --- DeepSpeed's native ops, compiled with the machine's C++ toolchain at first use ---
def init_deepspeed_comm() -> None:
    """Attach DeepSpeed to the process group Ray Train made; on CPU that builds `deepspeed_shm_comm`."""
    import deepspeed

    try:
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    except Exception as exc:
        error = op_build_error(exc, SHM_OP)
        if error is None:
            raise
        raise error from exc


def op_build_error(exc: BaseException, default_op: str) -> JobError | None:
    """A JobError naming what to install if `exc` is a failed JIT build of a DeepSpeed op
    (deepspeed_shm_comm on CPU; cpu_adam with optimizer offload on GPU), else None."""
    text = str(exc)
    if "Error building extension" not in text and "ninja" not in text.lower():
        return None
    match = re.search(r"Error building extension '([^']+)'", text)
    return JobError(
        op_build_message(match.group(1) if match else default_op, text.splitlines()[-1] if text else type(exc).__name__)
    )


def toolchain_problems(env: dict | None = None) -> list[str]:
    """What a JIT build of a DeepSpeed op needs and this machine lacks (empty: nothing missing)."""
    from torch.utils.cpp_extension import is_ninja_available

    env = os.environ if env is None else env
    path = env.get("PATH", "")
    compiler = env.get("CXX", "c++")
    missing = []
    if not shutil.which(compiler, path=path):
        missing.append(
            f"a C++ compiler (`{compiler}` not found): apt-get install g++ (Debian/Ubuntu) "
            f"or dnf install gcc-c++ (RHEL/Fedora)"
        )
    if not is_ninja_available():
        missing.append("ninja: pip install ninja")
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        missing.append(
            f"the Python headers (Python.h): apt-get install python{sys.version_info.major}."
            f"{sys.version_info.minor}-dev"
        )
    return missing


def op_build_message(op: str, error: str) -> str:
    missing = toolchain_problems()
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
    what = ("; missing: " + "; ".join(missing)) if missing else f" (the compiler is there; the build said: {error})"
    return (
        f"training.strategy zero3 needs DeepSpeed's {op} op, compiled on first use with the "
        f"machine's C++ toolchain, and the build failed{what}. Install what is missing on every node "
        f"(cluster/setup-local.sh checks), or use training.strategy: fsdp2. Built ops are cached in {cache}; "
        f"set TORCH_EXTENSIONS_DIR to a persistent folder to compile once"
    )
