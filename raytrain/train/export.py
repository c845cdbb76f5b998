"""`raytrain export RUN_DIR`: turn a committed checkpoint into a plain Hugging Face model (or
peft adapter) in one process, without Ray or a process group. A full FSDP2/DDP checkpoint is
converted one tensor at a time (its peak is the largest tensor, not the model); an adapter
names the exact base it was trained on by the sha256 of each of the base's weight files."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from raytrain.job.spec import JobSpec
from raytrain.model import hub, modeling
from raytrain.rundir import signing, storage
from raytrain.rundir.checkpoints import latest_checkpoint
from raytrain.rundir.job_file import read_job_file
from raytrain.strategies import hf_files, zero3
from raytrain.strategies.dcp_files import SignedReader, read_checkpoint
from raytrain.strategies.hf_files import export_entries, write_full_export, write_hf_export


def load_checkpoint_model(spec: JobSpec, checkpoint: signing.SignedCheckpoint) -> torch.nn.Module:
    """A plain single-process model with the checkpoint's weights (DCP reshards to one process);
    each file is verified as it is fetched, before anything reads it."""
    model = modeling.load_model(spec)
    trainable = modeling.trainable_names(model)
    full = model.state_dict()
    wanted = {k: v for k, v in full.items() if spec.training.finetune == "full" or k in trainable}
    if zero3.is_zero3_checkpoint(checkpoint.names):  # DeepSpeed's own layout: its consolidation, not DCP
        wanted = zero3.consolidated_state_dict(
            checkpoint.fetch(*checkpoint.names), trainable_only=spec.training.adapters
        )
    else:
        read_checkpoint({"model": wanted}, checkpoint)
    result = model.load_state_dict(wanted, strict=False)
    modeling.require_complete(
        model, result.missing_keys, result.unexpected_keys, spec.training.finetune, checkpoint.where
    )
    return model


# What one DCP load of an export reads into memory at most (or one larger tensor). Each tensor costs
# its target and DCP's deserialized copy on top: 256 MiB made a SmolLM2-shape export's peak 0.76x
# the model's bytes, 64 MiB 0.64x as one tensor a load does, and no slower (RESULTS, M5).
BATCH_BYTES = 64 << 20


def write_full_from_checkpoint(spec: JobSpec, checkpoint: signing.SignedCheckpoint, directory: str) -> None:
    """A full DCP checkpoint as a HF model folder in bounded memory: the model is built on meta
    (names and shapes, no weights) and the tensors are read from the checkpoint (DCP resharding
    whatever world size wrote it) in loads of BATCH_BYTES, straight into the file they go to.
    One reader serves every load, so the metadata is unpickled once (a load per tensor, each
    unpickling every tensor's chunks, made an export O(tensors²)); only the model's files are
    fetched (SplitWriter keeps the optimizer's apart)."""
    model = modeling.load_model(spec, on_meta=True)
    tensors = hf_files.export_tensors(model)
    entries = export_entries(spec, tensors)
    reader = SignedReader(checkpoint)

    def batches():
        batch: dict[str, torch.Tensor] = {}
        held = 0
        for i, (key, shape, dtype) in enumerate(entries):
            batch[key] = torch.empty(shape, dtype=dtype)  # read straight into the exported dtype: DCP's copy rounds
            held += batch[key].nbytes
            if i + 1 == len(entries) or held + _nbytes(entries[i + 1]) > BATCH_BYTES:
                read_checkpoint({"model": batch}, checkpoint, reader)  # names a missing key
                yield from batch.items()
                batch, held = {}, 0

    write_full_export(spec, model, batches(), entries, directory, hub.load_tokenizer(spec), rank=0, world_size=1)


def _nbytes(entry: tuple) -> int:
    _, shape, dtype = entry
    return math.prod(shape) * dtype.itemsize


def export_checkpoint(run_dir: str, out: str, checkpoint_dir: str | None = None) -> str:
    """A run directory's latest (or the given) committed checkpoint as a plain HF folder at
    `out`; either may be local or remote."""
    spec = read_job_file(run_dir)
    checkpoint_dir = checkpoint_dir or latest_checkpoint(run_dir)
    name = checkpoint_dir.rstrip("/").rsplit("/", 1)[-1]
    with (
        tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp,
        signing.SignedCheckpoint(checkpoint_dir, spec.run_dir, name) as checkpoint,
    ):
        if spec.training.finetune == "full" and not zero3.is_zero3_checkpoint(checkpoint.names):
            write_full_from_checkpoint(spec, checkpoint, str(Path(tmp, "model")))
        else:  # an adapter (small), or ZeRO-3's own layout (consolidated whole by DeepSpeed)
            model = load_checkpoint_model(spec, checkpoint)
            write_hf_export(spec, model, model.state_dict(), str(Path(tmp, "model")), hub.load_tokenizer(spec))
        storage.upload_dir(str(Path(tmp, "model")), out)
    return checkpoint_dir
