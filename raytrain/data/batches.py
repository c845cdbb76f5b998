"""This rank's micro-batches of each global batch, read straight from the token stores; and its share of the evaluation
rows.

Data-parallel rank r of dp reads only its slice of each global batch (`order.rank_slice`): ceil(G/dp) or floor(G/dp)
rows, nothing else. dp = N / (sp x tp): the ranks that hold parts of the same sequences or of the same layers read the
same slice (`plan.Mesh`). Every rank runs the same number of micro-batches per step (`RunPlan.accumulation_steps`), so
FSDP's and ZeRO-3's collectives stay matched when the slices differ by a row; a rank with fewer rows than micro-batches
gets a padding row whose labels are all ignored (it adds nothing to the loss, which is the token mean over the whole
global batch). The next step's rows are read in a background thread while this one trains.

The evaluation rows (at most `data.eval.max_rows`, `order.EvalSet`) are read a micro-batch at a time, every evaluation:
nothing of them is held between evaluations or read before step 1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrain.data.order import EvalSet, HeldOut, Stream, rank_slice
from raytrain.data.records import IGNORE
from raytrain.data.store import PLANES, TokenStore
from raytrain.errors import JobError
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.rundir.checkpoints import DataPosition


@dataclass
class StepBatch:
    micro_batches: list[dict]  # this rank's micro-batches: input_ids, labels, position_ids (torch.long)
    sample_ids: list[tuple[int, int, int]] = field(default_factory=list)  # (source, epoch, row) of this rank's rows


def _open(uri: str) -> TokenStore:
    store = TokenStore.open(uri)
    if store is None:
        raise JobError(
            f"the token store {uri} is gone or incomplete; run the job again (or `raytrain prepare`) to rebuild it"
        )
    return store


def most_rows(largest_slice: int, count: int) -> list[int]:
    """The most rows any data-parallel rank's i-th micro-batch holds, i < `count`, from the largest
    slice's row count (rank 0's: `rank_slice` gives the first ranks the extra rows, and a part of
    np.array_split grows with what it splits): known on every rank's host, so the split vocabulary's
    collectives (strategies/vocab_parallel.py) size their buffers without asking the other ranks.
    An empty part is a padding row: 1."""
    return [max(1, b - a) for a, b in (rank_slice(largest_slice, count, i) for i in range(count))]


def micro_batches(
    stores: list[TokenStore], ids: list[tuple[int, int]], count: int, most: list[int] | None = None
) -> list[dict]:
    """Rows (source, row) in `count` micro-batches of near-equal size; an empty one is a padding row.
    A preference row is two sequences: a micro-batch of b pairs holds the b chosen sequences,
    then the b rejected ones (one forward for both, so every strategy's collectives match).
    `most` (`most_rows`): each micro-batch then carries `most_sequences`, the most sequences any
    rank's holds."""
    sources = np.array([s for s, _ in ids], dtype=np.int64)
    rows = np.array([r for _, r in ids], dtype=np.int64)
    n, width = stores[0].seq_len, stores[0].planes
    sequences = width // PLANES  # per row: 2 for a preference pair
    planes = np.empty((len(ids), width, n), dtype=np.int32)
    for i, store in enumerate(stores):
        mine = sources == i
        if mine.any():
            planes[mine] = store.read(rows[mine])
    out, pad = [], int(stores[0].manifest.get("pad_id", 0))  # (the balancing loss's real tokens read it)
    for i, part in enumerate(np.array_split(np.arange(len(ids)), count)):
        if len(part):
            t = torch.from_numpy(planes[part]).long()
            t = torch.cat(t.split(PLANES, dim=1))  # [rows, sequences x 3, n] -> [sequences x rows, 3, n]
            out.append({"input_ids": t[:, 0], "labels": t[:, 1], "position_ids": t[:, 2], "pad_id": pad})
        else:  # keeps this rank's forward/backward count equal to the others'; trains nothing
            out.append(
                {
                    "input_ids": torch.full((sequences, n), pad, dtype=torch.long),
                    "labels": torch.full((sequences, n), IGNORE, dtype=torch.long),
                    "position_ids": torch.arange(n, dtype=torch.long)[None].repeat(sequences, 1),
                    "pad_id": pad,
                }
            )
        if most is not None:
            out[-1]["most_sequences"] = most[i] * sequences
    return out


class GlobalBatches:
    def __init__(
        self,
        stores: list[TokenStore],
        stream: Stream,
        plan: RunPlan,
        rank: int,
        world_size: int,
        position: DataPosition,
        key: str,
    ):
        self.stores, self.stream, self.global_batch = stores, stream, plan.global_batch
        self.micro = plan.accumulation_steps(world_size)
        mesh = plan.mesh(world_size)  # a sequence's sp x tp ranks read the same slice
        self.start, self.stop = rank_slice(self.global_batch, mesh.dp, mesh.dp_rank(rank))
        first, last = rank_slice(self.global_batch, mesh.dp, 0)
        self.most = most_rows(last - first, self.micro)
        self.position = DataPosition(position.consumed, key)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-prefetch")
        self._next = self._pool.submit(self._read, self.position.consumed)

    def _read(self, consumed: int):
        sources, epochs, rows = self.stream.at(np.arange(consumed + self.start, consumed + self.stop))
        pairs = list(zip(sources.tolist(), rows.tolist()))  # host: numpy arrays
        micro = micro_batches(self.stores, pairs, self.micro, self.most)
        return micro, list(zip(sources.tolist(), epochs.tolist(), rows.tolist()))  # host: numpy arrays

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        micro, sample_ids = self._next.result()
        self.position = DataPosition(self.position.consumed + self.global_batch, self.position.store)
        self._next = self._pool.submit(self._read, self.position.consumed)
        return StepBatch(micro, sample_ids)

    def close(self) -> None:
        """Stop prefetching (the read in flight finishes)."""
        self._pool.shutdown(wait=True)


class EvalBatches:
    """This rank's evaluation micro-batches, read when iterated (once per evaluation).

    Rank r takes its balanced slice of the evaluation rows (`rank_slice`) in `count` micro-batches
    of near-equal size, the same count on every rank (`objectives.evaluate` is a collective): an
    empty one is a padding row, as in training. So each evaluation is the token mean over all the
    evaluation rows, whatever the worker count, with one micro-batch of rows in memory at a time."""

    def __init__(self, stores: list[TokenStore], rows: EvalSet, rank: int, world: int, micro_batch_size: int):
        self.stores, self.rows = stores, rows
        self.start, self.stop = rank_slice(rows.rows, world, rank)
        self.count = -(-(-(-rows.rows // world)) // micro_batch_size)  # the same on every rank
        first, last = rank_slice(rows.rows, world, 0)
        self.most = most_rows(last - first, self.count)

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for part in range(self.count):
            a, b = rank_slice(self.stop - self.start, self.count, part)  # np.array_split's parts
            sources, rows = self.rows.at(np.arange(self.start + a, self.start + b))
            pairs = list(zip(sources.tolist(), rows.tolist()))  # host: numpy arrays
            yield micro_batches(self.stores, pairs, 1, [self.most[part]])[0]


def open_data(spec: JobSpec, plan: RunPlan, rank: int, world: int, position: DataPosition):
    """(training batches, this rank's evaluation micro-batches (`EvalBatches`) or None, the data
    key) from the stores the driver prepared (`prepare.ensure_inputs`)."""
    prepared = plan.stores
    stores = [_open(uri) for uri in prepared["train"]]
    d, t = spec.data, spec.training
    fraction, key = d.eval.fraction if d.eval else None, prepared["key"]
    splits = [HeldOut(s.rows, fraction) if fraction else s.rows for s in stores]
    stream = Stream(splits, prepared["weights"], t.seed, d.shuffle, d.shuffle_window)
    batches = GlobalBatches(stores, stream, plan, rank, world, position, key)
    if d.eval is None:
        return batches, None, key
    if prepared.get("eval"):
        eval_stores = [_open(prepared["eval"])]
        rows = EvalSet([eval_stores[0].rows], d.eval.max_rows)
    else:
        eval_stores, rows = stores, EvalSet(splits, d.eval.max_rows)
    mesh = plan.mesh(world)
    return batches, EvalBatches(eval_stores, rows, mesh.dp_rank(rank), mesh.dp, t.micro_batch_size), key
