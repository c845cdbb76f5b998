"""This rank's micro-batches of each global batch, read straight from the token store.

Rank r of N reads only its slice of each global batch (`order.rank_slice`): ceil(G/N) or
floor(G/N) rows, nothing else. Every rank runs the same number of micro-batches per step
(`JobSpec.accumulation_steps`), so FSDP's and ZeRO-3's collectives stay matched when the
slices differ by a row; a rank with fewer rows than micro-batches gets a padding row whose
labels are all ignored (it adds nothing to the loss, which is the token mean over the whole
global batch). The next step's rows are read in a background thread while this one trains.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import JobSpec
from .order import DataPosition, GlobalOrder, rank_slice
from .records import IGNORE
from .store import TokenStore


@dataclass
class StepBatch:
    micro_batches: list[dict]  # this rank's micro-batches: input_ids, labels, position_ids (torch.long)
    sample_ids: list[tuple[int, int]] = field(default_factory=list)  # (epoch, store row) of this rank's rows


class GlobalBatches:
    def __init__(self, store: TokenStore, spec: JobSpec, rank: int, world_size: int, position: DataPosition):
        t = spec.training
        self.store, self.global_batch = store, t.global_batch_size
        self.micro = spec.accumulation_steps(world_size)
        self.order = GlobalOrder(store.rows, t.seed, spec.data.shuffle, spec.data.shuffle_window)
        self.start, self.stop = rank_slice(t.global_batch_size, world_size, rank)
        self.position = DataPosition(position.epoch, position.offset, store.key)
        self._pad = int(store.manifest.get("pad_id", 0))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-prefetch")
        self._next = self._pool.submit(self._read, self.position)

    def _read(self, position: DataPosition):
        first = position.position(self.store.rows)
        epochs, rows = self.order.rows_at(np.arange(first + self.start, first + self.stop))
        return (epochs, rows, *self.store.read(rows))

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        epochs, rows, ids, labels, positions = self._next.result()
        self.position = self.position.advanced(self.global_batch, self.store.rows)
        self._next = self._pool.submit(self._read, self.position)
        micro = []
        for part in np.array_split(np.arange(len(rows)), self.micro):
            if len(part):
                micro.append({"input_ids": torch.from_numpy(ids[part]).long(), "labels": torch.from_numpy(labels[part]).long(),
                              "position_ids": torch.from_numpy(positions[part]).long()})
            else:  # keeps this rank's forward/backward count equal to the others'; trains nothing
                n = self.store.seq_len
                micro.append({"input_ids": torch.full((1, n), self._pad, dtype=torch.long),
                              "labels": torch.full((1, n), IGNORE, dtype=torch.long),
                              "position_ids": torch.arange(n, dtype=torch.long)[None]})
        return StepBatch(micro, list(zip(epochs.tolist(), rows.tolist())))

    def close(self) -> None:
        """Stop prefetching (the read in flight finishes)."""
        self._pool.shutdown(wait=True)
