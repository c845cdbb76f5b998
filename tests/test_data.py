"""The data path's pure parts: token/label construction and packing (the store, the
global order and the per-rank reads are in test_store.py)."""

from __future__ import annotations

import pytest

from conftest import make_job
from raytrain.data import IGNORE, encode_chat, encode_text, pack, pad_rows
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


def test_lr_warmup_then_cosine_to_floor(assets, tmp_path):
    spec = make_job(assets, tmp_path, optimizer={"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1},
                    training={"max_steps": 20})
    assert [lr_at(s, spec) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, spec) == pytest.approx(1.0) and lr_at(20, spec) == pytest.approx(0.1)
    assert all(lr_at(s, spec) >= lr_at(s + 1, spec) for s in range(4, 20))


