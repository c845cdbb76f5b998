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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_ROWS = 64


@dataclass
class DataPosition:
    """Where the run stands in the stream: `epoch` and rows of it consumed, and the store
    those rows come from (a resume against another store is refused)."""

    epoch: int = 0
    offset: int = 0
    store: str = ""

    def advanced(self, rows: int, epoch_rows: int) -> "DataPosition":
        p = self.epoch * epoch_rows + self.offset + rows
        return DataPosition(p // epoch_rows, p % epoch_rows, self.store)

    def position(self, epoch_rows: int) -> int:
        return self.epoch * epoch_rows + self.offset


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
        for i, (epoch, q) in enumerate(zip(epochs.tolist(), within.tolist())):
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
