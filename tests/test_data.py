"""The data path's pure parts: token/label construction and packing (the store, the
global order and the per-rank reads are in test_store.py)."""

from __future__ import annotations

import pytest
from conftest import make_job

from raytrain.data import IGNORE, encode_chat, encode_text, pack, pad_rows
from raytrain.model.hub import load_tokenizer
from raytrain.train.loop import lr_at


@pytest.fixture(scope="module")
def spec(assets, tmp_path_factory):
    return make_job(assets, tmp_path_factory.mktemp("s"), data={"format": "chat", "seq_len": 64})


@pytest.fixture(scope="module")
def tok(spec):
    return load_tokenizer(spec)


FOX = [
    {"role": "system", "content": "answer briefly."},
    {"role": "user", "content": "what color is the fox?"},
    {"role": "assistant", "content": "the fox is red."},
]


def trained_text(tok, ids, labels) -> list[str]:
    """The labelled tokens, as the runs of consecutive labelled text."""
    runs, current = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i
            current.append(i)
        elif current:
            runs, current = runs + [tok.decode(current)], []
    return runs + ([tok.decode(current)] if current else [])


def test_chat_trains_on_assistant_content_and_end_of_turn_only(tok):
    two_turns = FOX + [
        {"role": "user", "content": "and the owl?"},
        {"role": "assistant", "content": "the owl is white."},
    ]
    ids, labels = encode_chat(tok, two_turns)
    assert tok.decode(ids) == tok.apply_chat_template(two_turns, tokenize=False)
    # Hand-computed: each assistant turn's content and its <|im_end|>; no role header, no user text.
    assert trained_text(tok, ids, labels) == ["the fox is red.<|im_end|>", "the owl is white.<|im_end|>"]
    ids, labels = encode_chat(tok, two_turns, train_on_inputs=True)
    assert labels == ids


def test_a_template_that_injects_text_keeps_labels_exact(tok):
    # A template that writes a dated default system prompt and rewrites user turns: the assistant
    # spans are found in the one rendering, so the labels cannot shift.
    from copy import copy

    dated = copy(tok)
    dated.chat_template = (
        "<|im_start|>system\nToday is 2026-11-22.<|im_end|>\n{% for m in messages %}<|im_start|>"
        "{{ m['role'] }}\n{{ m['content'] | upper if m['role'] == 'user' else m['content'] }}"
        "<|im_end|>\n{% endfor %}"
    )
    ids, labels = encode_chat(dated, FOX)
    assert trained_text(dated, ids, labels) == ["the fox is red.<|im_end|>"]


def test_a_template_that_rewrites_an_earlier_assistant_turn_refuses_the_row(tok):
    from copy import copy

    stripping = copy(tok)  # like Qwen3: reasoning is dropped from assistant turns before the last one
    stripping.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
        "not loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
    )
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>greet</think>hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "<think>part</think>goodbye"},
    ]
    with pytest.raises(ValueError, match="does not render assistant turn 1 as written"):
        encode_chat(stripping, turns)


def test_alpaca_and_sharegpt_rows_become_the_same_conversation(assets, tmp_path):
    from raytrain.data import check_record

    alpaca = make_job(assets, tmp_path, data={"format": "alpaca"}).data
    row = {
        "instruction": "what color is the fox?",
        "input": "",
        "output": "the fox is red.",
        "system": "answer briefly.",
        "history": [["hi", "hello"]],
    }
    sharegpt = make_job(assets, tmp_path, data={"format": "sharegpt"}).data
    share = {
        "system": "answer briefly.",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "what color is the fox?"},
            {"from": "gpt", "value": "the fox is red."},
        ],
    }
    assert (
        check_record(alpaca, row)
        == check_record(sharegpt, share)
        == [
            {"role": "system", "content": "answer briefly."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
        + FOX[1:]
    )
    assert check_record(alpaca, {**row, "input": "in one word"})[-2]["content"] == "what color is the fox?\nin one word"
    mapped = make_job(
        assets,
        tmp_path,
        data={
            "format": "sharegpt",
            "columns": {"messages": "turns"},
            "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "q", "assistant_tag": "a"},
        },
    ).data
    assert check_record(mapped, {"turns": [{"speaker": "q", "text": "hi"}, {"speaker": "a", "text": "hello"}]}) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def test_text_ends_with_eos_and_trains_every_token(tok):
    ids, labels = encode_text(tok, "the red fox jumps over the wall.")
    assert ids[-1] == tok.eos_token_id and labels == ids


@pytest.mark.parametrize("bad", [None, 3, "", "   "])
def test_bad_text_is_a_row_error(tok, bad):
    with pytest.raises(ValueError, match="text"):
        encode_text(tok, bad)


def _mixed_rows() -> dict[str, list]:
    """Rows of each format as the sources give them (raw JSON Lines bytes, or decoded objects):
    good ones, bad ones of every kind, and one longer than seq_len."""
    import json

    def raw(value) -> bytes:
        return json.dumps(value).encode()

    long = " ".join(["the red fox jumps over the wall."] * 30)
    bad = [b"", b"{not json", raw(["a", "list"]), b'{"text": "caf\xe9"}']
    return {
        "text": [
            raw({"text": "the red fox jumps."}),
            raw({"text": 5}),
            raw({"text": "   "}),
            raw({"text": long}),
            {"text": "a row decoded from parquet"},
            raw({"text": "a lone \ud800 surrogate"}),
            *bad,
        ],
        "chat": [
            raw({"messages": FOX}),
            raw({"messages": FOX[:2]}),
            raw({"messages": [{"role": "bot", "content": "x"}]}),
            raw(
                {
                    "messages": FOX
                    + [{"role": "user", "content": "and the owl?"}, {"role": "assistant", "content": "white."}]
                }
            ),
            raw({"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": long}]}),
            *bad,
        ],
        "alpaca": [
            raw(
                {
                    "instruction": "what color is the fox?",
                    "input": "",
                    "output": "the fox is red.",
                    "system": "be brief.",
                }
            ),
            raw({"instruction": "q", "input": "in one word", "output": "a", "history": [["hi", "hello"]]}),
            raw({"instruction": 3, "output": "a"}),
            raw({"instruction": long, "output": long}),
            *bad,
        ],
        "sharegpt": [
            raw({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
            raw({"conversations": [{"from": "alien", "value": "hi"}]}),
            raw({"conversations": []}),
            *bad,
        ],
        "pairs text": [
            raw({"prompt": "the red fox", "chosen": " jumps.", "rejected": " runs."}),
            raw({"prompt": "p", "chosen": "", "rejected": "x"}),
            raw({"prompt": "p", "chosen": "a"}),
            raw({"prompt": long, "chosen": "a", "rejected": "b"}),
            raw({"prompt": "", "chosen": "a", "rejected": "c"}),
            *bad,
        ],
        "pairs chat": [
            raw({"prompt": FOX[:2], "chosen": [FOX[2]], "rejected": "the fox is blue."}),
            raw({"chosen": FOX, "rejected": FOX[:2] + [{"role": "assistant", "content": "blue."}]}),
            raw({"prompt": FOX, "chosen": "a", "rejected": "b"}),
            raw({"prompt": FOX[:2], "chosen": "   ", "rejected": "b"}),
            raw({"prompt": FOX[1:2], "chosen": long, "rejected": "b"}),
            *bad,
        ],
    }


@pytest.mark.parametrize("pack", [False, True])
def test_a_batch_gives_each_row_exactly_what_encoding_it_alone_gives(tok, pack):
    # The prepare step tokenizes BATCH_ROWS rows per call; each row's ids, labels or ValueError
    # must be what encode_row / encode_pair give it alone, whatever the batch around it.
    from copy import copy

    from raytrain.data import encode_row
    from raytrain.data.pairs import encode_pair, encode_pairs
    from raytrain.data.records import encode_rows
    from raytrain.job.spec import DataSpec

    stripping = copy(tok)  # rewrites an earlier assistant turn: that row is refused, the others not
    stripping.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if loop.last or "
        "m['role'] != 'assistant' else 'x' }}<|im_end|>\n{% endfor %}"
    )
    refusals = []
    for name, rows in _mixed_rows().items():
        pairs, fmt = name.startswith("pairs"), name.split()[-1]
        for t, train_on_inputs in [(tok, False), (tok, True)] + [(stripping, False)] * (fmt == "chat"):
            if pairs and (pack or train_on_inputs):
                continue
            d = DataSpec(path="x", format=fmt, seq_len=48, pack=pack, train_on_inputs=train_on_inputs)
            alone = []
            for row in rows:
                try:
                    alone.append((encode_pair if pairs else encode_row)(t, d, row))
                except ValueError as why:
                    alone.append(f"ValueError: {why}")
            for size in (1, 3, len(rows)):
                batched = [
                    r
                    for i in range(0, len(rows), size)
                    for r in (encode_pairs if pairs else encode_rows)(t, d, rows[i : i + size])
                ]
                assert [f"ValueError: {r}" if isinstance(r, ValueError) else r for r in batched] == alone, (name, size)
            assert any(not isinstance(r, str) for r in alone), name  # good rows too
            refusals += [r for r in alone if isinstance(r, str)]
    # The mix holds every kind of refusal, the over-long rows included.
    kinds = [
        "not valid JSON",
        "empty line",
        "expected a JSON object",
        "not UTF-8",
        "not valid Unicode text (a lone surrogate",
        "column 'text' is empty",
        "must be a string, got int",
        "no assistant message",
        "does not render assistant turn",
    ]
    kinds += [] if pack else ["longer than data.seq_len=48 (raise seq_len", "(pairs are never truncated"]
    assert [k for k in kinds if not any(k in r for r in refusals)] == []


def test_pack_keeps_every_token_pads_only_the_tail_and_restarts_positions_per_document():
    docs = [([1, 2, 3], [1, 2, 3]), ([4, 5], [IGNORE, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])]
    ids, labels, positions = pack(docs, seq_len=4, pad=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert labels.tolist() == [[1, 2, 3, IGNORE], [5, 6, 7, 8], [9, IGNORE, IGNORE, IGNORE]]
    # A document runs on into the next row; padding continues the last document (never one of its own).
    assert positions.tolist() == [[0, 1, 2, 0], [1, 0, 1, 2], [3, 4, 5, 6]]
    ids, labels, positions = pad_rows(docs[:2], seq_len=4, pad=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]] and labels[1].tolist() == [IGNORE, 5, IGNORE, IGNORE]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_a_packed_document_sees_only_itself(assets, tok):
    # Its logits inside a packed row equal its logits alone: attention never crosses documents.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"), attn_implementation="sdpa").eval()
    model.config.use_cache = False  # as raytrain trains (transformers reads packing only without a KV cache)
    docs = [encode_text(tok, t) for t in ("the red fox jumps over the wall.", "a blue owl flies.", "the cat runs.")]
    ids, _, positions = pack(docs, seq_len=64, pad=0)
    with torch.no_grad():
        packed = model(input_ids=torch.tensor(ids).long(), position_ids=torch.tensor(positions).long()).logits[0]
        start = 0
        for doc, _ in docs:
            alone = model(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc)
        # Without the positions the second document attends to the first: the check can fail.
        plain = model(input_ids=torch.tensor(ids).long()).logits[0]
        assert not torch.allclose(
            plain[len(docs[0][0]) : len(docs[0][0]) + 3], packed[len(docs[0][0]) : len(docs[0][0]) + 3], atol=1e-4
        )


def test_lr_warmup_then_cosine_to_floor(assets, tmp_path):
    spec = make_job(
        assets, tmp_path, optimizer={"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1}, training={"max_steps": 20}
    )
    assert [lr_at(s, spec) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # Steps 0..19 are trained: the first after warmup runs at the peak, the last one trained at the floor.
    assert lr_at(4, spec) == pytest.approx(1.0) and lr_at(19, spec) == pytest.approx(0.1)
    assert lr_at(18, spec) > 0.1 and all(lr_at(s, spec) > lr_at(s + 1, spec) for s in range(4, 19))
