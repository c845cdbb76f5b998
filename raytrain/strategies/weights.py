"""Fill a model sharded on meta with the starting weights, without any process holding them all.

Each rank reads only the slices of its own shards from the model's safetensors files: DCP's
`HuggingFaceStorageReader` plans the reads from the files' headers, and safetensors reads a
slice's bytes and no others (torchtitan's way of loading HF weights); a file key transformers renames
on load is read under the model's name (`file_keys`). A model without safetensors files, or whose
parameter names are not its files' keys (a remote-code model that renames them, a conversion that
merges tensors), falls back to rank 0 loading it whole and broadcasting, as before.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.futures import Future

from raytrain.errors import JobError
from raytrain.job.spec import JobSpec
from raytrain.model import hub, modeling, moe, qlora
from raytrain.strategies.hf_files import SAFETENSORS_DTYPES

# The floating dtypes a weight file's header may name, read as rows (the names are the writer's).
FILE_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items() if dtype.is_floating_point}


def safetensors_folder(spec: JobSpec) -> Path | None:
    folder = hub.model_folder(spec, download=True)
    return folder if folder and any(folder.glob("*.safetensors")) else None


READ_BUFFER_BYTES = 64 * 2**20  # the host buffer a weight bound for an accelerator is read through


class WeightFiles:
    """A model's safetensors files by weight name, read with plain file reads: a memory map would
    add every page a rank touches to its resident memory, on top of the tensor it fills (2x the
    shard while loading, measured in benchmarks/ M1).

    A host tensor of the file's dtype is read into directly. Anything else (an accelerator's
    shard, another dtype) is read through one reused host buffer of at most `READ_BUFFER_BYTES`
    (pinned when the target is on a GPU) and copied in, a chunk of rows at a time: never a
    whole-tensor host copy, never a host view of device memory."""

    def __init__(self, folder: Path):
        self.entries: dict[str, tuple[Path, dict, int]] = {}  # name -> (file, header entry, data start)
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            self.entries.update({k: (file, v, 8 + size) for k, v in header.items() if k != "__metadata__"})
        self.buffer: torch.Tensor | None = None

    def whole_rows(self, key: str, offsets, lengths) -> bool:
        """Whether a slice is rows of dim 0 in full, so its bytes are one run in the file."""
        _, entry, _ = self.entries[key]
        shape = entry["shape"]
        return (
            entry["dtype"] in FILE_DTYPES
            and bool(shape)
            and list(offsets[1:]) == [0] * (len(shape) - 1)
            and list(lengths[1:]) == shape[1:]
        )

    def read_rows(self, key: str, first: int, count: int, into: torch.Tensor) -> None:
        """Rows [first, first + count) of weight `key` into `into` (cast to its dtype)."""
        file, entry, start = self.entries[key]
        dtype, shape = FILE_DTYPES[entry["dtype"]], entry["shape"]
        row = math.prod(shape[1:]) * dtype.itemsize
        with open(file, "rb") as f:
            f.seek(start + entry["data_offsets"][0] + first * row)
            if into.device.type == "cpu" and into.dtype == dtype and into.is_contiguous():
                self._read(f, into.view(-1).view(torch.uint8), key)  # host memory: no staging
                return
            step = max(1, min(count, READ_BUFFER_BYTES // max(1, row)))
            buffer = self._host_buffer(step * row, pinned=into.device.type == "cuda")
            for done in range(0, count, step):
                n = min(step, count - done)
                chunk = buffer[: n * row]
                self._read(f, chunk, key)
                into.narrow(0, done, n).copy_(chunk.view(dtype).view(n, *shape[1:]))

    def _host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes or (pinned and not self.buffer.is_pinned()):
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
        return self.buffer

    @staticmethod
    def _read(f, into: torch.Tensor, key: str) -> None:
        if into.numel() and f.readinto(into.numpy()) != into.numel():  # host: a host buffer or host tensor
            raise OSError(f"{f.name}: short read of {key}")


def fill(spec: JobSpec, model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> str:
    """Load the starting weights into `model` (sharded by fully_shard, materialized, buffers
    computed), then its LoRA adapters' initial values (collective); returns how: "sharded" or
    "rank0"."""
    new = modeling.new_weights(spec, model)  # in no file: a reward model's score head
    nf4 = {id(p) for p in qlora.quantized_weights(spec, model)}
    by_key = {
        modeling.base_name(n): p
        for n, p in model.named_parameters()
        if n not in adapters and n not in new and id(p) not in nf4
    }
    quantized = {modeling.base_name(n): p for n, p in model.named_parameters() if id(p) in nf4}
    persistent = {
        modeling.base_name(n): b
        for n, b in model.state_dict(keep_vars=True).items()
        if not isinstance(b, torch.nn.Parameter) and n not in adapters
    }
    folder = safetensors_folder(spec)
    files = WeightFiles(folder) if folder else None
    key_in_file = file_keys(model, files.entries.keys() if files else ())  # the model's name -> the file's
    # An MoE's experts, one weight an expert in the files (the hub's layout), fused in the model: each
    # rank reads its own experts' weights into its shard (`read_fused`), never the whole layer.
    parts = moe.file_parts(files.entries.keys()) if files else {}
    fused = {k: p for k, p in by_key.items() if k not in key_in_file and k in parts}
    by_key = {k: p for k, p in by_key.items() if k not in fused}
    how = "sharded" if key_in_file and (by_key.keys() | quantized.keys()) <= key_in_file.keys() else "rank0"
    if quantized and how != "sharded":
        raise JobError(
            f"training.finetune: qlora quantizes each rank's rows as it reads them from the model's "
            f"safetensors files, and {spec.model.path!r} has none whose weight names match the model's: "
            "save the model with save_pretrained (safetensors), or use training.finetune: lora"
        )
    if how == "sharded":
        read_slices(
            folder,
            {key_in_file[k]: t for k, t in {**persistent, **by_key}.items() if k in key_in_file},
            modeling.DTYPES[spec.model.dtype],
        )
        qlora.fill(quantized, lambda key, first, into: files.read_rows(key_in_file[key], first, into.shape[0], into))
        read_fused(files, fused, parts, modeling.DTYPES[spec.model.dtype])
    else:
        broadcast_from_rank0(spec, model)
    for name, p in model.named_parameters():
        if name in new or name in adapters:
            copy_full(p, new[name] if name in new else adapters[name])
    init_dora_magnitudes(model)
    return how


@torch.no_grad()
def read_fused(files: WeightFiles, targets: dict[str, torch.Tensor], parts: dict, load_dtype: torch.dtype) -> None:
    """Fill each fused expert parameter's shard ([experts, rows, cols], FSDP2's Shard(0): whole experts a
    rank, ceil(E/W) of them, the last ranks' fewer or none) from the files' per-expert weights (moe.file_parts),
    each read through `model.dtype` as from_pretrained rounds it, then cast to the shard's dtype."""
    for name, p in targets.items():
        shard, mesh = local(p), getattr(p, "device_mesh", None)
        first = mesh.get_coordinate()[-1] * -(-p.shape[0] // mesh.size(mesh.ndim - 1)) if mesh is not None else 0
        for i in range(shard.shape[0]):
            row = 0
            for key in parts[name][first + i]:
                shape = files.entries[key][1]["shape"]
                staged = torch.empty(shape, dtype=load_dtype)
                files.read_rows(key, 0, shape[0], staged)
                shard[i, row : row + shape[0]].copy_(staged)
                row += shape[0]


@torch.no_grad()
def init_dora_magnitudes(model: torch.nn.Module) -> None:
    """DoRA's initial magnitudes from the loaded weights. peft computes each as the norm of its base
    weight's rows when it adds the adapter, and here the adapters were added to a model on meta
    (no weights yet). A row is whole on the rank holding it (FSDP2 shards rows, and the magnitude
    of an out_features-long weight the same way), so each rank computes its own rows as peft does
    (the adapter's B is 0: the weight is the base's)."""
    for module, base, magnitudes in _dora_layers(model):
        if getattr(module, "fan_in_fan_out", False):
            raise JobError(
                "training.lora.use_dora on a model whose linear layers store (in, out) weights (GPT-2's "
                "Conv1D) is not supported under fsdp2: use training.strategy: ddp, or remove use_dora"
            )
        for layer in magnitudes:
            local(layer.weight).copy_(_row_norms(local(base)))


def _dora_layers(model: torch.nn.Module):
    """(module, its base weight, its DoRA magnitude layers) of each DoRA-adapted module."""
    for module in model.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if magnitudes:
            yield module, module.get_base_layer().weight, list(magnitudes.values())


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    return torch.linalg.norm(weight, dim=1).to(weight.dtype)  # peft's DoraLinearLayer.get_weight_norm, B = 0


class SliceReader(HuggingFaceStorageReader):
    """DCP's safetensors reader, reading each slice that is whole rows with `WeightFiles` straight
    into the shard it fills; any other slice goes through safetensors as before."""

    def read_data(self, plan, planner) -> Future:
        from safetensors import safe_open

        files = WeightFiles(Path(self.path))
        rest: dict[str, list] = {}
        for req in plan.items:
            key = req.storage_index.fqn
            if files.whole_rows(key, req.storage_offsets, req.lengths):
                target = planner.resolve_tensor(req).detach()
                files.read_rows(key, req.storage_offsets[0], req.lengths[0], target)
                planner.commit_tensor(req, target)
            else:
                rest.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for file_name, reqs in rest.items():
            with safe_open(filename=file_name, framework="pt") as f:
                for req in reqs:
                    self._process_read_request(f, req, planner)
        done: Future = Future()
        done.set_result(None)
        return done


def fill_partitioned(spec: JobSpec, model: torch.nn.Module) -> str:
    """ZeRO-3: fill a model built partitioned (`load_model(empty=True)` under zero.Init) one module
    at a time: rank 0 reads the module's weights from the files and DeepSpeed partitions them to
    every rank (GatheredParameters with modifier rank 0), so no process holds more than one
    module beyond its partitions. Returns "sharded", or "" if the files do not fit the model
    (then the caller loads with from_pretrained)."""
    import deepspeed

    folder = safetensors_folder(spec)
    files = WeightFiles(folder) if folder else None
    named = dict(model.named_parameters())  # tied weights once
    new = modeling.new_weights(spec, model)  # in no file: a reward model's score head
    key_in_file = file_keys(model, files.entries.keys() if files else ())
    parts = moe.file_parts(files.entries.keys()) if files else {}  # an MoE's experts, one weight an expert
    base = {n: modeling.base_name(n) for n, p in named.items() if "lora_" not in n and n not in new}
    fused = {n: k for n, k in base.items() if k not in key_in_file and k in parts}
    base = {n: k for n, k in base.items() if n not in fused}
    if files is None or not set(base.values()) <= key_in_file.keys():
        return ""
    base = {n: key_in_file[k] for n, k in base.items()}
    rank, seen = dist.get_rank(), set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            own = {f"{prefix}.{n}" if prefix else n: p for n, p in module.named_parameters(recurse=False)}
            own = {n: p for n, p in own.items() if (n in base or n in fused) and id(p) not in seen}
            seen.update(id(p) for p in own.values())
            if own:
                with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0):
                    if rank == 0:
                        for n, p in own.items():
                            if n in fused:  # one layer's experts whole on rank 0, as every module is here
                                read_fused(files, {n: p.data}, {n: parts[fused[n]]}, p.dtype)
                            else:
                                files.read_rows(base[n], 0, p.shape[0], p.data)
        for n, buf in model.state_dict(keep_vars=True).items():  # persistent buffers, every rank
            if not isinstance(buf, torch.nn.Parameter) and modeling.base_name(n) in key_in_file:
                files.read_rows(key_in_file[modeling.base_name(n)], 0, buf.shape[0], buf)
        for n, value in new.items():
            with deepspeed.zero.GatheredParameters([named[n]], modifier_rank=0):
                if rank == 0 or not hasattr(named[n], "ds_id"):  # (a whole parameter: every rank sets it)
                    named[n].data.copy_(value)
        for module, base, magnitudes in _dora_layers(model):  # peft computed them from the unfilled weights
            with deepspeed.zero.GatheredParameters([base, *(m.weight for m in magnitudes)], modifier_rank=0):
                if rank == 0:
                    for layer in magnitudes:
                        layer.weight.data.copy_(_row_norms(base.data))
    return "sharded"


def file_keys(model: torch.nn.Module, keys) -> dict[str, str]:
    """{the model's name of a weight: its key in the files} for the files' `keys`. transformers 5
    renames some architectures' weights on load (GPT-NeoX's `embed_out` is its model's `lm_head`;
    `from_pretrained` applies the same list, `transformers.conversion_mapping`): a key is read under the
    name the plain renames give it. A conversion that merges or splits tensors is no rename: its
    weights keep their file keys, are missing from the model's names, and the model loads on rank 0."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    renames = [
        (re.compile(src), dst)
        for t in get_model_conversion_mapping(base)
        if type(t) is WeightRenaming
        for src, dst in zip(t.source_patterns, t.target_patterns)
    ]
    out = {}
    for key in keys:
        name = key
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        out[name] = key
    return out


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
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )


def copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set a (sharded) parameter from a whole tensor every rank holds: no communication."""
    with torch.no_grad():
        if isinstance(p, DTensor):
            full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        local(p).copy_(local(full))


def like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(t, DTensor):
        return DTensor.from_local(
            torch.empty_like(t.to_local(), dtype=dtype), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return torch.empty_like(t, dtype=dtype)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
