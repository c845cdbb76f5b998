"""Fill a model sharded on meta with the starting weights, without any process holding them all.

Each rank reads only the slices of its own shards from the model's safetensors files: DCP's
`HuggingFaceStorageReader` plans the reads from the files' headers, and safetensors reads a
slice's bytes and no others (torchtitan's way of loading HF weights). A model without
safetensors files, or whose parameter names are not its files' keys (a remote-code model that
renames them), falls back to rank 0 loading it whole and broadcasting, as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.futures import Future

from .. import modeling
from ..config import JobSpec

INDEX = "model.safetensors.index.json"
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def safetensors_folder(spec: JobSpec) -> Path | None:
    folder = modeling.model_folder(spec, download=True)
    return folder if folder and any(folder.glob("*.safetensors")) else None


def stored_keys(folder: Path) -> set[str]:
    """The weight names in the folder's safetensors files (the index, or each file's header)."""
    if (folder / INDEX).exists():
        return set(json.loads((folder / INDEX).read_text())["weight_map"])
    from safetensors import safe_open

    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def fill(spec: JobSpec, model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> str:
    """Load the starting weights into `model` (sharded by fully_shard, materialized, buffers
    computed), then its LoRA adapters' initial values (collective); returns how: "sharded" or
    "rank0"."""
    by_key = {modeling.base_name(n): p for n, p in model.named_parameters() if n not in adapters}
    persistent = {modeling.base_name(n): b for n, b in model.state_dict(keep_vars=True).items()
                  if not isinstance(b, torch.nn.Parameter) and n not in adapters}
    folder = safetensors_folder(spec)
    keys = stored_keys(folder) if folder else set()
    how = "sharded" if keys and by_key.keys() <= keys else "rank0"
    if how == "sharded":
        read_slices(folder, {**{k: b for k, b in persistent.items() if k in keys}, **by_key},
                    modeling.DTYPES[spec.model.dtype])
    else:
        broadcast_from_rank0(spec, model)
    for name, p in model.named_parameters():
        if name in adapters:
            copy_full(p, adapters[name])
    return how


class SliceReader(HuggingFaceStorageReader):
    """DCP's safetensors reader, reading each slice with plain file reads straight into the shard
    it fills. (safetensors' memory map would add every page a rank touches to its resident memory,
    on top of the shard: 2x the shard while loading, measured in benchmarks/ M1.) A slice that is
    not a run of whole rows goes through safetensors as before."""

    def read_data(self, plan, planner) -> Future:
        from safetensors import safe_open

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, items in per_file.items():
            with open(file_name, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header, start = json.loads(f.read(size)), 8 + size
                rest = []
                for req in items:
                    entry = header[req.storage_index.fqn]
                    dtype, shape = FILE_DTYPES.get(entry["dtype"]), entry["shape"]
                    whole_rows = list(req.storage_offsets[1:]) == [0] * (len(shape) - 1) and \
                        list(req.lengths[1:]) == shape[1:]
                    if dtype is None or not shape or not whole_rows:
                        rest.append(req)
                        continue
                    target = planner.resolve_tensor(req).detach()
                    row = math.prod(shape[1:]) * dtype.itemsize
                    buffer = target if target.dtype == dtype and target.is_contiguous() else \
                        torch.empty(target.shape, dtype=dtype)
                    f.seek(start + entry["data_offsets"][0] + req.storage_offsets[0] * row)
                    if buffer.numel() and f.readinto(buffer.view(-1).view(torch.uint8).numpy()) != req.lengths[0] * row:
                        raise OSError(f"{file_name}: short read of {req.storage_index.fqn}")
                    if buffer is not target:
                        target.copy_(buffer)
                    planner.commit_tensor(req, target)
            if rest:
                with safe_open(filename=file_name, framework="pt") as f:
                    for req in rest:
                        self._process_read_request(f, req, planner)
        done: Future = Future()
        done.set_result(None)
        return done


def read_slices(folder: Path, targets: dict[str, torch.Tensor], load_dtype: torch.dtype) -> None:
    """dcp.load each rank's slices straight into its shards. A weight trained in fp32 from a model
    loaded in bf16 goes through a bf16 shard first, so it is rounded exactly as `from_pretrained`
    in `model.dtype` would round it, then upcast."""
    staged = {k: like(t, load_dtype) for k, t in targets.items() if t.is_floating_point() and t.dtype != load_dtype}
    dcp.load({k: staged.get(k, t) for k, t in targets.items()}, storage_reader=SliceReader(str(folder)))
    with torch.no_grad():
        for k, t in staged.items():
            local(targets[k]).copy_(local(t))


def broadcast_from_rank0(spec: JobSpec, model: torch.nn.Module) -> None:
    full = modeling.load_model(spec).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))


def copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set a (sharded) parameter from a whole tensor every rank holds: no communication."""
    with torch.no_grad():
        if isinstance(p, DTensor):
            full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        local(p).copy_(local(full))


def like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(t, DTensor):
        return DTensor.from_local(torch.empty_like(t.to_local(), dtype=dtype), t.device_mesh, t.placements,
                                  shape=t.shape, stride=t.stride())
    return torch.empty_like(t, dtype=dtype)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
