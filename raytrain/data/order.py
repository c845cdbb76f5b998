"""The global order of a token store's rows: a pure function of (seed, epoch, rows).

Megatron's sample index and MosaicML streaming's canonical order, reduced to what
fine-tuning needs. The run is one stream of positions 0, 1, 2, ... over all epochs;
position p is row `order(p mod rows)` of epoch `p div rows`. Within an epoch:
- rows are grouped into fixed blocks of `BLOCK_ROWS` (by row number: the store's own
  layout does not matter, reads are per row);
- the blocks are permuted (seeded by seed and epoch), so the whole dataset mixes;
- rows are shuffled inside windows of consecutive permuted blocks (seeded by seed, epoch
  and window), so neighbours in the file do not stay neighbours in a batch.
Both are recomputed from the seed, never stored: memory is one int per block plus the
window in hand, and any position is found without walking to it (a resume seeks).

Global batch b is positions [b*G, (b+1)*G). Rank r of N takes a contiguous, balanced slice
of it (`rank_slice`): ceil(G/N) or floor(G/N) rows, whatever N is, so any worker count in
an elastic range trains the same global batches.

A blend of sources (`Stream`) interleaves them by weight as Megatron's blended datasets do:
the k-th row of source i is due at time (k + 1/2) / w_i, and the stream takes rows in order
of due time, so after any p positions each source has had p * w_i / sum(w) rows, give or take
one. Each source then runs through its own order and epochs. A held-out evaluation set is a
fixed choice of rows per source (`held_out`) that the training order never visits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_ROWS = 64


@dataclass
class DataPosition:
    """Where the run stands: rows of the stream consumed (over all epochs and sources), and
    the stores they come from (a resume against other stores is refused). One counter."""

    consumed: int = 0
    store: str = ""


def rank_slice(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's rows within a global batch: the first G mod N ranks get one more."""
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class GlobalOrder:
    def __init__(self, rows: int, seed: int, shuffle: bool, window_rows: int):
        if rows <= 0:
            raise ValueError("the order of an empty store")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.n_blocks = -(-rows // BLOCK_ROWS)
        self.window_blocks = max(1, window_rows // BLOCK_ROWS)
        self._epoch: int | None = None
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def rows_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, row) of each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.rows)
        if not self.shuffle:
            return epochs, within
        rows = np.empty_like(within)
        for i, (epoch, q) in enumerate(zip(epochs.tolist(), within.tolist())):  # host: numpy arrays
            rows[i] = self._row(epoch, q)
        return epochs, rows

    # --- one epoch's shuffled order ---
    def _blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block permutation and the first stream offset of each permuted block."""
        if self._epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch, 0]).permutation(self.n_blocks)
            sizes = np.minimum(BLOCK_ROWS, self.rows - perm * BLOCK_ROWS)
            self._perm, self._starts = perm, np.concatenate([[0], np.cumsum(sizes)[:-1]])
            self._epoch, self._windows = epoch, {}
        return self._perm, self._starts

    def _row(self, epoch: int, q: int) -> int:
        perm, starts = self._blocks(epoch)
        block = int(np.searchsorted(starts, q, side="right")) - 1
        w = block // self.window_blocks
        first = w * self.window_blocks
        window = self._windows.get((epoch, w))
        if window is None:
            members = perm[first:first + self.window_blocks]
            rows = np.concatenate([np.arange(b * BLOCK_ROWS, min((b + 1) * BLOCK_ROWS, self.rows)) for b in members])
            window = rows[np.random.default_rng([self.seed, epoch, 1, w]).permutation(len(rows))]
            if len(self._windows) > 4:  # a global batch spans at most a couple of windows
                self._windows.clear()
            self._windows[(epoch, w)] = window
        return int(window[q - starts[first]])


def held_out(rows: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, evaluation rows) of a store: a fixed, seed-independent choice, so every
    job on the same store holds out the same rows."""
    k = min(rows - 1, max(1, round(fraction * rows)))
    perm = np.random.default_rng(0x5EED).permutation(rows)
    return np.sort(perm[k:]), np.sort(perm[:k])


class Stream:
    """Stream positions -> (source, epoch, row) over one or several sources.

    `rows[i]` are the rows of source i the training order may use: a count (all rows of the
    store) or the row numbers a held-out evaluation set leaves; `horizon` is how many positions
    the job can consume (max_steps x global batch): a blend's schedule is laid out once up to it.
    """

    def __init__(self, rows: list[int | np.ndarray], weights: list[float], seed: int, shuffle: bool, window_rows: int,
                 horizon: int):
        self.rows = rows
        self.orders = [GlobalOrder(r if isinstance(r, int) else len(r), seed + 7919 * i, shuffle, window_rows)
                       for i, r in enumerate(rows)]
        if len(rows) == 1:
            self._source = self._index = None
            return
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        due = [(np.arange(int(np.ceil(horizon * wi)) + 2) + 0.5) / wi for wi in w]
        source = np.concatenate([np.full(len(d), i, np.int8) for i, d in enumerate(due)])
        order = np.lexsort((source, np.concatenate(due)))[:horizon]  # by due time, ties by source
        self._source = source[order]
        self._index = np.empty(horizon, np.int64)  # k: this is source i's k-th row
        for i in range(len(rows)):
            mine = self._source == i
            self._index[mine] = np.arange(mine.sum())

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        if self._source is None:
            source, k = np.zeros(len(positions), np.int64), positions
        else:
            if len(positions) and positions.max() >= len(self._source):
                raise IndexError(f"stream position {positions.max()} beyond the blend's horizon {len(self._source)}")
            source, k = self._source[positions].astype(np.int64), self._index[positions]
        epochs, rows = np.empty_like(k), np.empty_like(k)
        for i, order in enumerate(self.orders):
            mine = source == i
            if mine.any():
                e, r = order.rows_at(k[mine])
                epochs[mine], rows[mine] = e, (r if isinstance(self.rows[i], int) else self.rows[i][r])
        return source, epochs, rows
