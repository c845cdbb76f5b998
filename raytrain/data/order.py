"""The global order of a token store's rows: a pure function of (seed, epoch, rows).

Megatron's sample index and MosaicML streaming's canonical order, reduced to what
fine-tuning needs. The run is one stream of positions 0, 1, 2, ... over all epochs;
position p is row `order(p mod rows)` of epoch `p div rows`. Within an epoch:
- rows are grouped into fixed blocks of `BLOCK_ROWS` (by row number: the store's own
  layout does not matter, reads are per row);
- the blocks are permuted (seeded by seed and epoch), so the whole dataset mixes;
- rows are shuffled inside windows of consecutive permuted blocks (seeded by seed, epoch
  and window), so neighbours in the file do not stay neighbours in a batch.
Nothing is laid out per row, per block or per step: the block permutation is a keyed
bijection computed per element (`Bijection`), the window in hand is the only array, and any
position is found without walking to it (a resume seeks). A rank's memory for the order is
the same at 10^3 rows and 10^10, at step 1 and step 10^6.

Global batch b is positions [b*G, (b+1)*G). Rank r of N takes a contiguous, balanced slice
of it (`rank_slice`): ceil(G/N) or floor(G/N) rows, whatever N is, so any worker count in
an elastic range trains the same global batches.

A blend of sources (`Stream`) interleaves them by weight as Megatron's blended datasets do:
the k-th row of source i is due at time (k + 1/2) / w_i, and the stream takes rows in order
of due time, ties by source index, so after any p positions each source has had p * w_i / sum(w)
rows, give or take one. Position p's source and k are solved for (`Blend`), not laid out up to
a horizon. Each source then runs through its own order and epochs. A held-out evaluation set
is a fixed choice of rows per source (`HeldOut`) that the training order never visits; the
evaluation rows (`EvalSet`) are at most `data.eval.max_rows` of them.
"""

from __future__ import annotations

import numpy as np

BLOCK_ROWS = 64
HELD_OUT_SEED = 0x5EED  # every job on a store holds out the same rows, whatever its training.seed


def rank_slice(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's rows within a global batch: the first G mod N ranks get one more."""
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a well-spread 64-bit hash of each uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


class Bijection:
    """A keyed pseudo-random permutation of [0, n), computed per element in O(1) memory: a
    balanced Feistel network over the smallest even number of bits that covers n, cycle-walked
    back into [0, n) (Black and Rogaway): a bijection of the padded range is one of [0, n) when
    every image outside it is stepped on until it falls inside (under 4 steps expected)."""

    ROUNDS = 6

    def __init__(self, n: int, *seed: int):
        if n <= 0:
            raise ValueError("a permutation of nothing")
        self.n = n
        self.half = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence(list(seed)).generate_state(self.ROUNDS, np.uint64)

    def _rounds(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        if inverse:
            for key in self.keys[::-1]:
                left, right = right ^ (_mix(left ^ key) & self.mask), left
        else:
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        x = np.asarray(x, dtype=np.int64)
        if len(x) and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"element {x.max() if x.max() >= self.n else x.min()} of a permutation of {self.n}")
        y = self._rounds(x.astype(np.uint64), inverse)
        while (out := y >= self.n).any():  # cycle-walk: the cycle through x comes back inside
            y[out] = self._rounds(y[out], inverse)
        return y.astype(np.int64)


class GlobalOrder:
    def __init__(self, rows: int, seed: int, shuffle: bool, window_rows: int):
        if rows <= 0:
            raise ValueError("the order of an empty store")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.n_blocks = -(-rows // BLOCK_ROWS)
        self.short = self.n_blocks * BLOCK_ROWS - rows  # rows the last block lacks
        self.window_blocks = max(1, window_rows // BLOCK_ROWS)
        self._epoch: int | None = None
        self._windows: dict[tuple[int, int], tuple[np.ndarray, int]] = {}

    def rows_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, row) of each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.rows)
        if not self.shuffle:
            return epochs, within
        rows = np.empty_like(within)
        for epoch in np.unique(epochs).tolist():  # host: a batch spans one epoch, at most two
            mine = epochs == epoch
            rows[mine] = self._epoch_rows(epoch, within[mine])
        return epochs, rows

    # --- one epoch's shuffled order ---
    def _blocks(self, epoch: int) -> tuple[Bijection, int]:
        """The epoch's block permutation (slot -> block) and the slot of the last, short block."""
        if self._epoch != epoch:
            self._perm = Bijection(self.n_blocks, self.seed, epoch, 0)
            self._short_slot = int(self._perm(np.array([self.n_blocks - 1]), inverse=True)[0])
            self._epoch, self._windows = epoch, {}
        return self._perm, self._short_slot

    def _slot_start(self, slot: int) -> int:
        """The first epoch offset of a permuted slot: every block is full but the short one."""
        return slot * BLOCK_ROWS - (self.short if slot > self._short_slot else 0)

    def _epoch_rows(self, epoch: int, q: np.ndarray) -> np.ndarray:
        _, short_slot = self._blocks(epoch)
        end_of_short = short_slot * BLOCK_ROWS + BLOCK_ROWS - self.short  # offsets after it are shifted
        slots = np.where(q < end_of_short, q // BLOCK_ROWS, (q + self.short) // BLOCK_ROWS)
        windows = slots // self.window_blocks
        out = np.empty_like(q)
        for w in np.unique(windows).tolist():  # host: a batch spans a couple of windows
            mine = windows == w
            rows, start = self._window(epoch, w)
            out[mine] = rows[q[mine] - start]
        return out

    def _window(self, epoch: int, w: int) -> tuple[np.ndarray, int]:
        """Window w's rows in their shuffled order, and its first epoch offset."""
        window = self._windows.get((epoch, w))
        if window is None:
            perm, _ = self._blocks(epoch)
            first = w * self.window_blocks
            blocks = perm(np.arange(first, min(first + self.window_blocks, self.n_blocks)))
            rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).ravel()
            rows = rows[rows < self.rows]  # the short block's missing rows
            shuffled = rows[np.random.default_rng([self.seed, epoch, 1, w]).permutation(len(rows))]
            window = shuffled, self._slot_start(first)
            if len(self._windows) > 4:  # a global batch spans at most a couple of windows
                self._windows.clear()
            self._windows[(epoch, w)] = window
        return window


class HeldOut:
    """A store's rows split into a held-out evaluation set and the training rows: a fixed,
    seed-independent choice (a bijection of the rows keyed by `HELD_OUT_SEED`), so every job on
    the same store holds out the same rows. Held-out row i is the bijection's image of i; training
    row j that of held + j: disjoint, together every row, each found per index with no table."""

    def __init__(self, rows: int, fraction: float):
        if rows <= 0:
            raise ValueError("held-out rows of an empty store")
        self.rows = rows
        self.held = min(rows - 1, max(1, round(fraction * rows)))
        self.train = rows - self.held
        self._order = Bijection(rows, HELD_OUT_SEED)

    def held_rows(self, i: np.ndarray) -> np.ndarray:
        """Store rows of held-out indexes i, 0 <= i < held (the first n: the evaluation set capped at n)."""
        i = np.asarray(i, dtype=np.int64)
        if len(i) and i.max() >= self.held:
            raise IndexError(f"held-out row {i.max()} of {self.held}")
        return self._order(i)

    def train_rows(self, j: np.ndarray) -> np.ndarray:
        """Store rows of training indexes j, 0 <= j < train."""
        j = np.asarray(j, dtype=np.int64)
        if len(j) and j.max() >= self.train:
            raise IndexError(f"training row {j.max()} of {self.train}")
        return self._order(j + self.held)


class Blend:
    """Position p -> (source i, k): the p-th row of the blend is source i's k-th row.

    The schedule, as defined: source i's k-th row is due at (k + 1/2) / w_i, the due times taken
    in float64 with the weights normalized in float64, in order of due time, ties (equal floats)
    by source index. Nothing is laid out: a position is solved for. The rows before (i, k) are
    k of source i's, and of each other source j its rows due earlier (and those due at the same
    time when j < i); that rank grows with k and is within a few rows of (k + 1/2) / w_i - 1/2,
    so a short bisection over k per source finds the one source whose rank is exactly p. The
    same float64 due times as a sort of them, so the same order, exactly, with no horizon."""

    def __init__(self, weights: list[float]):
        w = np.asarray(weights, dtype=np.float64)
        self.w = w / w.sum()
        self.margin = 2 * len(w) + 2  # the rank's distance from (k + 1/2) / w_i - 1/2 is under 1.5 per source

    def _due(self, i: int, k: np.ndarray) -> np.ndarray:
        return (k.astype(np.float64) + 0.5) / self.w[i]

    def _count(self, j: int, t: np.ndarray, inclusive: bool) -> np.ndarray:
        """Rows of source j due before t (or at t): from the exact estimate, corrected for rounding."""
        before = np.less_equal if inclusive else np.less
        m = np.maximum(np.ceil(t * self.w[j] - 0.5), 0).astype(np.int64)
        while (fix := (m > 0) & ~before(self._due(j, m - 1), t)).any():
            m[fix] -= 1
        while (fix := before(self._due(j, m), t)).any():
            m[fix] += 1
        return m

    def _rank(self, i: int, k: np.ndarray) -> np.ndarray:
        """Rows of the blend before source i's k-th row."""
        t, rank = self._due(i, k), k.copy()
        for j in range(len(self.w)):
            if j != i:
                rank += self._count(j, t, inclusive=j < i)
        return rank

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(positions, dtype=np.int64)
        source, k = np.full(len(p), -1, np.int64), np.zeros(len(p), np.int64)
        pf = p.astype(np.float64) + 0.5
        for i, wi in enumerate(self.w):
            lo = np.maximum(np.floor((pf - self.margin) * wi - 0.5), 0).astype(np.int64)
            hi = np.ceil((pf + self.margin) * wi - 0.5).astype(np.int64) + 1
            while (open_ := lo < hi).any():  # the first k whose rank reaches p
                mid = (lo + hi) // 2
                short = self._rank(i, mid) < p
                lo = np.where(open_ & short, mid + 1, lo)
                hi = np.where(open_ & ~short, mid, hi)
            hit = self._rank(i, lo) == p
            if (source[hit] >= 0).any():
                raise RuntimeError(f"the blend's schedule put two rows at one position ({p[hit & (source >= 0)][0]})")
            source[hit], k[hit] = i, lo[hit]
        if (source < 0).any():
            raise RuntimeError(f"the blend's schedule left position {p[source < 0][0]} empty")
        return source, k


class Stream:
    """Stream positions -> (source, epoch, row) over one or several sources.

    `rows[i]` are the rows of source i the training order may use: a count (all rows of the
    store) or a `HeldOut` split (its training rows). Any position, however late: nothing here
    depends on how many steps the job runs."""

    def __init__(self, rows: list[int | HeldOut], weights: list[float], seed: int, shuffle: bool, window_rows: int):
        self.rows = rows
        self.orders = [
            GlobalOrder(r if isinstance(r, int) else r.train, seed + 7919 * i, shuffle, window_rows)
            for i, r in enumerate(rows)
        ]
        self.blend = Blend(weights) if len(rows) > 1 else None

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        if self.blend is None:
            source, k = np.zeros(len(positions), np.int64), positions
        else:
            source, k = self.blend.at(positions)
        epochs, rows = np.empty_like(k), np.empty_like(k)
        for i, order in enumerate(self.orders):
            mine = source == i
            if mine.any():
                e, r = order.rows_at(k[mine])
                epochs[mine], rows[mine] = e, (r if isinstance(self.rows[i], int) else self.rows[i].train_rows(r))
        return source, epochs, rows


class EvalSet:
    """The evaluation rows, at most `max_rows`: `sources[i]` is a store's row count (its rows by
    row number: an evaluation set of its own) or a `HeldOut` split (its held-out rows in their
    fixed order). Over the cap, each source keeps its first rows, in proportion to what it has
    (largest remainders, ties to the lower source). Index e -> (source, row), sources in turn."""

    def __init__(self, sources: list[int | HeldOut], max_rows: int):
        self.sources = sources
        have = [s if isinstance(s, int) else s.held for s in sources]
        total = sum(have)
        if total <= max_rows:
            take = have
        else:
            shares = [divmod(max_rows * h, total) for h in have]
            take = [q for q, _ in shares]
            extra = sorted(range(len(have)), key=lambda i: (-shares[i][1], i))[: max_rows - sum(take)]
            take = [t + (i in extra) for i, t in enumerate(take)]
        self.counts = take
        self.first = np.cumsum([0, *take])
        self.rows = int(self.first[-1])

    def at(self, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        e = np.asarray(e, dtype=np.int64)
        if len(e) and (e.min() < 0 or e.max() >= self.rows):
            raise IndexError(f"evaluation row {e.max()} of {self.rows}")
        source = np.searchsorted(self.first, e, side="right") - 1
        rows = e - self.first[source]
        for i, s in enumerate(self.sources):
            mine = source == i
            if mine.any() and not isinstance(s, int):
                rows[mine] = s.held_rows(rows[mine])
        return source, rows
