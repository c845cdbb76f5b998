"""The data path: token/label construction, packing, and the deterministic global order
(world-size independent, resumable) on a real Ray Data iterator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_job
from raytrain.data import IGNORE, DataPosition, GlobalBatches, encode_chat, encode_text, pack, pad_rows, window_order
from raytrain.loop import lr_at
from raytrain.modeling import load_tokenizer


@pytest.fixture(scope="module")
def spec(assets, tmp_path_factory):
    return make_job(assets, tmp_path_factory.mktemp("s"), data={"format": "chat", "seq_len": 64})


def test_chat_loss_only_on_assistant_tokens(spec):
    tok = load_tokenizer(spec)
    messages = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "what color is the fox?"},
                {"role": "assistant", "content": "the fox is red."}]
    ids, labels = encode_chat(tok, messages, spec.data)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    assert trained == "<|im_start|>assistant\nthe fox is red.<|im_end|>\n"


def test_text_ends_with_eos_and_trains_every_token(spec):
    tok = load_tokenizer(spec)
    ids, labels = encode_text(tok, "the red fox jumps over the wall.", spec.data)
    assert ids[-1] == tok.eos_token_id and labels == ids


@pytest.mark.parametrize("bad", [None, 3, "", "   "])
def test_bad_text_is_a_row_error(spec, bad):
    with pytest.raises(ValueError, match="text"):
        encode_text(load_tokenizer(spec), bad, spec.data)


def test_pack_keeps_every_token_and_pads_only_the_tail():
    docs = [([1, 2, 3], [1, 2, 3]), ([4, 5], [IGNORE, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])]
    ids, labels = pack(docs, seq_len=4, pad=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert labels.tolist() == [[1, 2, 3, IGNORE], [5, 6, 7, 8], [9, IGNORE, IGNORE, IGNORE]]
    ids, labels = pad_rows(docs[:2], seq_len=4, pad=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]] and labels[1].tolist() == [IGNORE, 5, IGNORE, IGNORE]


def test_window_order_depends_on_seed_and_epoch_only():
    a = window_order(0, 0, 3, 100, True)
    assert np.array_equal(a, window_order(0, 0, 3, 100, True)) and sorted(a) == list(range(100))
    assert not np.array_equal(a, window_order(0, 1, 3, 100, True))
    assert not np.array_equal(a, window_order(1, 0, 3, 100, True))


def test_lr_warmup_then_cosine_to_floor(assets, tmp_path):
    spec = make_job(assets, tmp_path, optimizer={"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1},
                    training={"max_steps": 20})
    assert [lr_at(s, spec) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, spec) == pytest.approx(1.0) and lr_at(20, spec) == pytest.approx(0.1)
    assert all(lr_at(s, spec) >= lr_at(s + 1, spec) for s in range(4, 20))


def _global_batches(ds, spec, world: int, steps: int, start=DataPosition()):
    """Per step, the rows of all ranks concatenated in rank order (each rank iterates on its own)."""
    per_rank = [GlobalBatches(ds.iterator(), spec, r, world, start) for r in range(world)]
    out = []
    for _ in range(steps):
        parts = [next(b) for b in per_rank]
        out.append(([sid for p in parts for sid in p.sample_ids],
                    torch.cat([mb["input_ids"] for p in parts for mb in p.micro_batches])))
    return out, per_rank[0].position


def test_global_order_is_the_same_at_any_world_size_and_resumes_exactly(ray_address, assets, tmp_path):
    import ray.data

    spec = make_job(assets, tmp_path, data={"shuffle_window": 16, "seq_len": 8},
                    training={"global_batch_size": 8, "micro_batch_size": 2})
    rows = [{"input_ids": np.full(8, i, np.int32), "labels": np.full(8, i, np.int32), "bad_rows": 0} for i in range(40)]
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # as data.build_dataset sets it
    ds = ray.data.from_items(rows)
    one, _ = _global_batches(ds, spec, world=1, steps=7)  # 56 rows: crosses into epoch 1
    two, _ = _global_batches(ds, spec, world=2, steps=7)
    assert [ids for ids, _ in one] == [ids for ids, _ in two]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(one, two))
    epoch0 = [sid for ids, _ in one[:5] for sid in ids]
    assert sorted(epoch0) == [(0, i) for i in range(40)]  # every row of epoch 0 exactly once
    # Stop after 3 steps, resume (at another world size) from the saved position: same rows next.
    _, position = _global_batches(ds, spec, world=2, steps=3)
    resumed, _ = _global_batches(ds, spec, world=1, steps=4, start=position)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in one[3:]]
