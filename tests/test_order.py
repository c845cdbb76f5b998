"""The data plane's pure parts at any size: the blend solved per position (the same schedule the
old sort laid out, exactly), the held-out split and the block order as keyed bijections, the
capped evaluation set, and each rank's evaluation micro-batches read lazily. No Ray, no store."""

from __future__ import annotations

import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

from raytrain.data.order import BLOCK_ROWS, Bijection, Blend, EvalSet, GlobalOrder, HeldOut, Stream


def sorted_schedule(weights: list[float], horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """The blend as raytrain laid it out before (order.Stream up to this change): every due time up
    to the horizon, sorted by due time then source; (source, k) of each position."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    due = [(np.arange(int(np.ceil(horizon * wi)) + 2) + 0.5) / wi for wi in w]
    source = np.concatenate([np.full(len(d), i, np.int8) for i, d in enumerate(due)])
    order = np.lexsort((source, np.concatenate(due)))[:horizon]  # by due time, ties by source
    source = source[order]
    index = np.empty(horizon, np.int64)  # k: this is source i's k-th row
    for i in range(len(weights)):
        mine = source == i
        index[mine] = np.arange(mine.sum())
    return source.astype(np.int64), index


WEIGHTS = [
    [1, 1],
    [3, 1, 1],
    [0.7, 0.2, 0.1],
    [2, 1],
    [5, 5, 1],
    [0.25, 0.25, 0.5],
    [1, 2, 3, 4],
    [0.1] * 10,
    [1e-3, 1, 7.3],
]


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_the_blend_solved_per_position_is_the_sorted_schedule_exactly(weights):
    source, k = sorted_schedule(weights, 20_000)
    got = Blend(weights).at(np.arange(20_000))
    assert np.array_equal(got[0], source) and np.array_equal(got[1], k)
    shuffled = np.random.default_rng(0).permutation(20_000)[:3000]  # any positions, in any order
    got = Blend(weights).at(shuffled)
    assert np.array_equal(got[0], source[shuffled]) and np.array_equal(got[1], k[shuffled])


@pytest.mark.parametrize("weights", [[3, 1, 1], [0.7, 0.2, 0.1]], ids=str)
def test_the_blend_matches_the_sorted_schedule_late_in_a_long_job(weights):
    source, k = sorted_schedule(weights, 2_000_000)
    got = Blend(weights).at(np.arange(1_995_000, 2_000_000))
    assert np.array_equal(got[0], source[-5000:]) and np.array_equal(got[1], k[-5000:])


def test_the_schedule_is_decided_by_its_float64_due_times_not_by_exact_fractions():
    """Why the closed form takes the due times in float64, as the sort did: with 0.7, 0.2, 0.1 the
    rounded due times order some near-ties otherwise than exact fractions of the same weights."""
    weights, n = [0.7, 0.2, 0.1], 20_000
    exact = sorted(((2 * k + 1) / Fraction(w), i) for i, w in enumerate(weights) for k in range(int(n * w) + 3))[:n]
    source, _ = sorted_schedule(weights, n)
    assert [i for _, i in exact] != source.tolist()
    assert np.array_equal(Blend(weights).at(np.arange(n))[0], source)


def test_a_position_far_past_any_horizon_is_solved_in_constant_memory():
    blend, start = Blend([5, 3, 2]), 10**12
    tracemalloc.start()
    source, k = blend.at(np.arange(start, start + 4096))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20, peak
    for i, share in enumerate([0.5, 0.3, 0.2]):
        mine = k[source == i]  # each source's rows come in turn, none skipped, none twice
        assert np.array_equal(mine, np.arange(mine[0], mine[0] + len(mine)))
        assert abs(mine[0] - start * share) <= 3 and abs(len(mine) - 4096 * share) <= 2


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 1000, 4097])
def test_a_bijection_is_a_permutation_with_its_inverse_and_depends_on_its_key(n):
    f = Bijection(n, 7, 1)
    image = f(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    assert np.array_equal(f(image, inverse=True), np.arange(n))
    if n >= 64:
        assert not np.array_equal(image, Bijection(n, 7, 2)(np.arange(n)))
        assert not np.array_equal(image, np.arange(n))
    with pytest.raises(IndexError, match=f"element {n} of a permutation of {n}"):
        f(np.array([n]))


@pytest.mark.parametrize("rows", [1, 2, 10, 64, 1000, 4097])
def test_the_held_out_rows_are_a_fixed_choice_disjoint_from_the_training_rows_and_together_every_row(rows):
    split = HeldOut(rows, 0.1)
    assert split.held == min(rows - 1, max(1, round(0.1 * rows))) and split.train == rows - split.held
    held, train = split.held_rows(np.arange(split.held)), split.train_rows(np.arange(split.train))
    assert sorted(held.tolist() + train.tolist()) == list(range(rows))
    again = HeldOut(rows, 0.1)  # another job on the same store: the same rows, whatever its seed
    assert np.array_equal(again.held_rows(np.arange(split.held)), held)
    if rows >= 1000:
        assert not np.array_equal(np.sort(held), np.arange(split.held))  # not just the first rows
    with pytest.raises(IndexError, match=f"training row {split.train} of {split.train}"):
        split.train_rows(np.array([split.train]))


@pytest.mark.parametrize("rows", [1, 5, 63, 64, 65, 1000, 4097])
def test_every_epoch_visits_every_row_once_and_a_seek_lands_on_the_same_rows(rows):
    order = GlobalOrder(rows, seed=3, shuffle=True, window_rows=2 * BLOCK_ROWS)
    epochs, got = order.rows_at(np.arange(3 * rows))
    for epoch in range(3):
        assert sorted(got[epochs == epoch].tolist()) == list(range(rows))
    fresh = GlobalOrder(rows, seed=3, shuffle=True, window_rows=2 * BLOCK_ROWS)  # a resume seeks, in any order
    starts = list(range(0, 3 * rows, 37))[::-1]
    chunks = {a: fresh.rows_at(np.arange(a, min(a + 37, 3 * rows)))[1] for a in starts}
    assert np.array_equal(np.concatenate([chunks[a] for a in sorted(chunks)]), got)


def test_the_block_order_mixes_blocks_and_shuffles_a_window_of_blocks_together():
    rows = 100 * BLOCK_ROWS
    got = GlobalOrder(rows, seed=5, shuffle=True, window_rows=4 * BLOCK_ROWS).rows_at(np.arange(rows))[1]
    first = got[: 4 * BLOCK_ROWS]
    blocks, sizes = np.unique(first // BLOCK_ROWS, return_counts=True)
    assert len(blocks) == 4 and (sizes == BLOCK_ROWS).all()  # the first window: four whole blocks...
    assert not np.array_equal(blocks, np.arange(4))  # ...from anywhere in the store...
    assert len(np.unique(first[:BLOCK_ROWS] // BLOCK_ROWS)) > 1  # ...and their rows shuffled together
    assert np.array_equal(GlobalOrder(rows, 5, False, 256).rows_at(np.arange(rows))[1], np.arange(rows))


def test_a_ranks_order_held_out_split_and_blend_take_the_same_memory_at_any_size_and_step():
    def peak(rows: int, position: int) -> int:
        tracemalloc.start()
        stream = Stream(
            [HeldOut(r, 0.01) for r in (rows, rows // 2, rows // 5)], [5, 3, 2], seed=1, shuffle=True, window_rows=1024
        )
        stream.at(np.arange(position, position + 512))
        evaluation = EvalSet(stream.rows, 2000)
        evaluation.at(np.arange(evaluation.rows))
        used = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return used

    peak(1000, 0)  # numpy's first-use allocations
    small, large = peak(10**6, 10**7), peak(10**11, 10**14)  # 10^5 x the rows, 10^7 x the step
    assert large < 1 << 20 and large <= 1.2 * small, (small, large)


def test_the_evaluation_set_is_capped_in_proportion_and_each_source_keeps_its_first_held_out_rows():
    splits = [HeldOut(r, 0.1) for r in (30_000, 10_000, 500)]  # 3000, 1000 and 50 held out
    capped = EvalSet(splits, 2000)
    assert capped.counts == [1481, 494, 25] and capped.rows == 2000  # 1481.5, 493.8, 24.7: the largest remainders
    source, rows = capped.at(np.arange(2000))
    for i, split in enumerate(splits):  # each source: the first of its held-out rows, in their fixed order
        assert np.array_equal(rows[source == i], split.held_rows(np.arange(capped.counts[i])))
    everything = EvalSet(splits, 10_000)
    assert everything.counts == [3000, 1000, 50]
    assert EvalSet([5000], 2000).at(np.arange(2000))[1].tolist() == list(range(2000))  # data.eval.path: rows by number
    assert EvalSet([3, 4], 2000).counts == [3, 4]
    with pytest.raises(IndexError, match="evaluation row 2000 of 2000"):
        capped.at(np.array([2000]))


class CountingStore:
    """A stand-in token store: row r reads as tokens all `first + r` (labels the same); reads are kept."""

    seq_len, planes, manifest = 4, 3, {"pad_id": 0}

    def __init__(self, rows: int, first: int):
        self.rows, self.first, self.reads = rows, first, []

    def read(self, rows: np.ndarray) -> np.ndarray:
        self.reads += rows.tolist()
        tokens = (self.first + np.asarray(rows, np.int32))[:, None, None]
        out = np.repeat(tokens, 3, axis=1).repeat(self.seq_len, axis=2)
        out[:, 2] = np.arange(self.seq_len)
        return out


def labelled(micro_batches) -> list[int]:
    """The rows in micro-batches (their first label), padding rows left out."""
    return [int(t) for mb in micro_batches for t in mb["labels"][:, 0] if t != -100]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_evaluation_micro_batches_are_read_one_at_a_time_and_cover_the_set_once_over_ranks(world):
    from raytrain.data.batches import EvalBatches

    stores = [CountingStore(400, 0), CountingStore(90, 1000)]
    rows = EvalSet([HeldOut(400, 0.05), HeldOut(90, 0.1)], 25)  # 20 and 9 held out, 25 evaluated
    ranks = [EvalBatches(stores, rows, r, world, micro_batch_size=2) for r in range(world)]
    count = -(-(-(-25 // world)) // 2)
    assert [len(r) for r in ranks] == [count] * world  # the same forward count on every rank
    assert all(s.reads == [] for s in stores)  # nothing read before the first evaluation
    first = next(iter(ranks[0]))
    assert sum(len(s.reads) for s in stores) == len(labelled([first])) > 0  # that micro-batch's rows, no more
    seen = []
    for r in ranks:
        batches = list(r)
        assert len(batches) == count and all(len(mb["input_ids"]) <= 2 for mb in batches)
        # a padding row's labels are all ignored: it adds nothing to the loss
        assert all((mb["labels"] == -100).all() or (mb["labels"] != -100).all() for mb in batches)
        seen += labelled(batches)
    source, want = rows.at(np.arange(25))
    assert sorted(seen) == sorted((want + 1000 * source).tolist())  # every evaluation row once, over the ranks
    assert labelled(ranks[0]) == labelled(EvalBatches(stores, rows, 0, world, 2))  # the next evaluation: the same
