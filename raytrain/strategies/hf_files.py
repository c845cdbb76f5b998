"""The final model as plain Hugging Face files: a full model's safetensors written one tensor at a
time by every rank, a LoRA adapter by rank 0, and what goes beside them.

`from_pretrained` reads a folder of `model-0000i-of-0000N.safetensors` files and the
`model.safetensors.index.json` that maps each weight to its file. Here each rank owns one of
those files: every file's header (names, shapes, byte offsets) is laid out in advance from the
shapes alone, identically on every rank, and the model's tensors are then gathered one at a time
(a collective per tensor under FSDP2 / ZeRO-3) and written by the rank that owns them at their
offset. No process ever holds more than its shards plus one gathered tensor (the largest: the
embedding), where rank 0 used to gather the whole model and then cast a second copy of it; under
FSDP2 a tensor is gathered to the rank that writes it only (`strategies.base.gather_to`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Iterable

import torch

from raytrain import private_apis
from raytrain.job.spec import JobSpec
from raytrain.model import hub, modeling

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes, by name and in its order: the parameters and persistent
    buffers, a tied weight once (under its first name)."""
    seen: set[int] = set()
    out = {}
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[key] = t
    return out


def file_owners(entries: list[tuple[str, tuple[int, ...], torch.dtype]], files: int) -> dict[str, int]:
    """{name: the file (and the rank writing it)}: tensors in `entries`' order, about equal bytes a
    file; file i takes the tensors whose bytes start in its share."""
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in entries]
    total, files = sum(sizes), max(1, min(files, len(entries)))
    owners, done = {}, 0
    for (name, _, _), size in zip(entries, sizes):
        owners[name] = min(files - 1, done * files // max(1, total))
        done += size
    return owners


class ShardedFiles:
    """The layout of an export over `files` safetensors files and this rank's writer of its own.

    `entries` is every tensor's (name, shape, dtype) in one order all ranks share. Tensors are
    spread over the files in that order, about equal bytes each; rank r writes file r."""

    def __init__(self, directory: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]], rank: int, files: int):
        self.file_of = file_owners(entries, files)
        files = max(1, min(files, len(entries)))
        # One file is `model.safetensors` with no index, as `save_pretrained` names a small model's.
        self.names = (
            [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
            if files > 1
            else ["model.safetensors"]
        )
        self.rank, self.directory = rank, Path(directory)
        self.offsets: dict[str, int] = {}
        self.handle = None
        if rank < files:
            header, data_start = self._header([e for e in entries if self.file_of[e[0]] == rank])
            self.path = self.directory / self.names[rank]
            self.directory.mkdir(parents=True, exist_ok=True)
            self.handle = open(self.path, "wb")
            self.handle.write(len(header).to_bytes(8, "little") + header)
            self.data_start = data_start
        self.entries = {name: (shape, dtype) for name, shape, dtype in entries}
        self.written: set[str] = set()

    def _header(self, mine) -> tuple[bytes, int]:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in mine:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.offsets[name] = offset
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        return raw, 8 + len(raw)

    def owns(self, name: str) -> bool:
        return self.file_of[name] == self.rank

    def put(self, name: str, tensor: torch.Tensor | None) -> None:
        """Write `tensor` (whole, on any device) as `name` if this rank owns it; otherwise nothing
        (a rank that does not write a tensor may be given None for it)."""
        if not self.owns(name):
            return
        shape, dtype = self.entries[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"export: {name} has shape {tuple(tensor.shape)}, its layout says {tuple(shape)}")
        host = tensor.detach().to("cpu", dtype=dtype).contiguous()  # one tensor in host memory at a time
        self.handle.seek(self.data_start + self.offsets[name])
        if host.numel():
            self.handle.write(memoryview(host.view(-1).view(torch.uint8).numpy()))  # host: a CPU copy
        self.written.add(name)

    def close(self) -> None:
        missing = [n for n in self.entries if self.owns(n) and n not in self.written]
        if missing:
            self.abandon()
            raise ValueError(f"export: no value was written for {missing[:3]}")
        if self.handle is not None:
            self.handle.close()

    def abandon(self) -> None:
        """No half-written file is left behind."""
        if self.handle is not None:
            self.handle.close()
            os.unlink(self.path)
            self.handle = None

    def write_index(self) -> None:
        """The index `from_pretrained` reads (any one rank writes it)."""
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.entries.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: self.names[self.file_of[name]] for name in self.entries},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_model(
    directory: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    rank: int,
    files: int,
) -> None:
    """Every rank: lay out `files` files, write the tensors this rank owns as `tensors` yields them
    (every rank iterates all of them: the gathers are collectives), and on rank 0 the index."""
    out = ShardedFiles(directory, entries, rank, files)
    try:
        for name, tensor in tensors:
            out.put(name, tensor)
    except BaseException:
        out.abandon()
        raise
    out.close()
    if rank == 0 and len(out.names) > 1:
        out.write_index()


def model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` makes a module's class `FSDP<Class>`, a subclass of
    FSDPModule and the class, and an exported config naming it is one vLLM and the Hub do not know."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def write_config(directory: str, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """What `save_pretrained` writes beside the weights: config.json (saying the dtype the weights
    are in), generation_config.json, and a remote-code model's own modules."""
    from transformers.dynamic_module_utils import custom_object_save

    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.architectures = [model_class(model).__name__]  # as save_pretrained says it (a reward model's: its own)
    Path(directory).mkdir(parents=True, exist_ok=True)
    if private_apis.has_remote_code_class(model):
        custom_object_save(model, directory, config=config)
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)


def export_entries(spec: JobSpec, tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, global shape, exported dtype) of each tensor: floating weights in `model.dtype` (the
    fp32 masters rounded as `from_pretrained` in that dtype would hold them), the rest as they are."""
    dtype = modeling.DTYPES[spec.model.dtype]
    return [
        (k, tuple(getattr(t, "ds_shape", None) or t.shape), dtype if t.is_floating_point() else t.dtype)
        for k, t in tensors.items()
    ]


def write_full_export(
    spec: JobSpec,
    hf_model: torch.nn.Module,
    tensors,
    entries: list,
    directory: str,
    tokenizer,
    rank: int,
    world_size: int,
) -> None:
    """A full fine-tune as a plain HF model folder: every rank writes its own weights file from
    the whole tensors `tensors` yields one at a time (`write_model`); rank 0 the rest."""
    write_model(directory, tensors, entries, rank, world_size)
    if rank == 0:
        write_config(directory, hf_model, modeling.DTYPES[spec.model.dtype])
        write_export_files(spec, directory, tokenizer)


def write_hf_export(spec: JobSpec, hf_model: torch.nn.Module, full_state: dict, directory: str, tokenizer) -> None:
    """In one process, save what plain transformers/peft load: an adapter folder for LoRA
    (`full_state` may hold the adapter only), a model folder for full."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if spec.training.adapters:
        from peft import get_peft_model_state_dict

        full_state = {k: v.detach().to("cpu").contiguous() for k, v in full_state.items()}
        adapter = get_peft_model_state_dict(hf_model, state_dict=full_state)
        save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        hf_model.peft_config["default"].save_pretrained(str(out))
        write_export_files(spec, directory, tokenizer)
    else:
        tensors = {k: full_state[k] for k in export_tensors(hf_model)}
        write_full_export(spec, hf_model, tensors.items(), export_entries(spec, tensors), directory, tokenizer, 0, 1)


def write_export_files(spec: JobSpec, directory: str, tokenizer) -> None:
    """The tokenizer and raytrain.json (what was trained, and for an adapter on which base files)."""
    out = Path(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    meta = {"job": spec.name, "finetune": spec.training.finetune, "base_model": spec.model.path}
    if spec.training.adapters:
        meta["base_files"] = hub.base_files(spec)  # the base this adapter was trained on, file by file
    (out / "raytrain.json").write_text(json.dumps(meta, indent=2))
