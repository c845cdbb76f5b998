"""A signed checkpoint's files through torch's distributed checkpoint (DCP): each rank fetches and
verifies only the files its slices are in (SignedReader), writes its own shards apart from what
every rank reads (SplitWriter), and a refused file or a missing weight is one JobError on every
rank. FSDP2, DDP, the export and ZeRO-3's universal conversion use them."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.rundir.signing import SignedCheckpoint


def read_checkpoint(state: dict, checkpoint: SignedCheckpoint, reader: "SignedReader | None" = None) -> None:
    """dcp.load into `state` (resharding to this world size), each rank fetching only the files
    its slices are in; a weight the checkpoint lacks or a refused file is one clear JobError on
    every rank, not DCP's traceback. Pass one `reader` to many loads of one checkpoint."""
    try:
        dcp.load(state, storage_reader=reader or SignedReader(checkpoint))
    except CheckpointException as exc:  # each rank's error, wrapped (a BaseException, not an Exception)
        refused = [e for e, _ in exc.failures.values() if isinstance(e, JobError)]
        if refused:
            raise JobError(str(refused[0])) from None
        missing = re.search(r"Missing key in checkpoint state_dict: ([\w.-]+?)\.(?:\s|$)", str(exc))
        if missing is None:
            raise
        raise JobError(
            f"the checkpoint {checkpoint.where} has no value for {missing.group(1)}: it was written for "
            f"another model or its keys were renamed. Point model.path at the model it was trained from"
        ) from None


class SignedReader(FileSystemReader):
    """DCP's file reader over a signed checkpoint: the metadata, then the files this rank's load
    plan reads, are fetched and verified first (`SignedCheckpoint.fetch`); nothing else is read.
    The metadata (every tensor's chunks on every rank) is unpickled once per reader, however many
    loads it serves: an export reads a checkpoint in many small loads."""

    def __init__(self, checkpoint: SignedCheckpoint):
        super().__init__(checkpoint.fetch(".metadata"))  # a pickle: verified before DCP unpickles it
        self.checkpoint = checkpoint
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan, planner):
        self.checkpoint.fetch(*sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}))
        return super().read_data(plan, planner)


class SplitWriter(FileSystemWriter):
    """DCP's file writer with a rank's own shards apart from its share of what DCP writes once for
    all ranks (replicated tensors: DDP's weights, AdamW's step counters; pickled values such as
    the param groups), and the model's apart from the optimizer's: `__<rank>_0.distcp` (model
    shards), `__<rank>_optim0.distcp`, `__<rank>_shared0.distcp`, `__<rank>_sharedoptim0.distcp`.
    Files are fetched and verified whole, so what a reader needs apart is written apart: every
    rank needs the replicated items (beside the shards, a rank would fetch every other rank's
    shards for a few scalars), and an export needs the model only (beside the optimizer, it
    would fetch the model's bytes twice again)."""

    def write_data(self, plan, planner):
        prefix, results = plan.storage_data.prefix, []
        groups: dict[str, list] = {}
        for item in plan.items:
            kind = "" if item.type == WriteItemType.SHARD else "shared"
            groups.setdefault(prefix + kind + ("optim" if item.index.fqn.startswith("optim.") else ""), []).append(item)
        for name, items in groups.items():
            part = dataclasses.replace(plan, items=items, storage_data=private_apis.storage_prefix(name))
            results += super().write_data(part, planner).wait()
        done = torch.futures.Future()
        done.set_result(results)
        return done


def fetch_on_every_rank(checkpoint: SignedCheckpoint, files: list[str]) -> str:
    """Collective: fetch this rank's `files`; a file refused on any rank is refused on all (no rank
    waits in a collective for one that stopped). Returns the local folder."""
    try:
        error, folder = None, checkpoint.fetch(*files)
    except JobError as exc:
        error, folder = str(exc), ""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise JobError(next(e for e in errors if e))
    return folder
