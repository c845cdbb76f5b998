"""Offline stand-ins for a hub model and a dataset: a tiny Llama, a BPE tokenizer trained
on the spot, and learnable jsonl data. The quickstart and the tests load them with the
same `from_pretrained` path a user points at a hub id (as torchtitan's debug model does)."""

from __future__ import annotations

import json
import random
from pathlib import Path

COLORS = ["red", "green", "blue", "yellow", "black", "white", "purple", "orange"]
ANIMALS = ["fox", "dog", "cat", "owl", "bear", "wolf", "frog", "deer"]
VERBS = ["jumps", "runs", "looks", "walks", "flies", "swims"]
PLACES = ["the fence", "the river", "the hill", "the road", "the wall", "the field"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sentence(rng: random.Random) -> str:
    # The animal fixes the verb: a dependency the model can learn, so the loss falls well below chance.
    animal = rng.choice(ANIMALS)
    verb = VERBS[ANIMALS.index(animal) % len(VERBS)]
    return f"the {rng.choice(COLORS)} {animal} {verb} over {rng.choice(PLACES)}."


def text_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))} for _ in range(n)]


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        color, animal = rng.choice(COLORS), rng.choice(ANIMALS)
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "answer briefly."},
                    {"role": "user", "content": f"what color is the {animal}?"},
                    {"role": "assistant", "content": f"the {animal} is {color}."},
                ]
            }
        )
    return rows


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """TRL's standard preference shape. The chosen ending has the verb the animal takes in
    `sentence`, the rejected one another verb: a preference a tiny model learns in a few steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        animal, place = rng.choice(ANIMALS), rng.choice(PLACES)
        verb = VERBS[ANIMALS.index(animal) % len(VERBS)]
        wrong = rng.choice([v for v in VERBS if v != verb])
        rows.append(
            {
                "prompt": f"the {rng.choice(COLORS)} {animal}",
                "chosen": f" {verb} over {place}.",
                "rejected": f" {wrong} over {place}.",
            }
        )
    return rows


def kto_rows(n: int, seed: int = 0) -> list[dict]:
    """TRL's unpaired shape (KTO): a prompt, one completion and a label, desirable when the
    completion's verb is the one the animal takes, the same preference as `preference_rows`."""
    rng = random.Random(seed)
    rows = []
    for pair in preference_rows(n, seed):
        desirable = rng.random() < 0.5
        rows.append(
            {"prompt": pair["prompt"], "completion": pair["chosen" if desirable else "rejected"], "label": desirable}
        )
    return rows


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    """GRPO's prompt rows (TRL's shape): a prompt and a reference column the rewards may read (the
    verb the animal takes, as in `sentence`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        animal = rng.choice(ANIMALS)
        rows.append(
            {"prompt": f"the {rng.choice(COLORS)} {animal}", "solution": VERBS[ANIMALS.index(animal) % len(VERBS)]}
        )
    return rows


def lipogram(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """The demo GRPO job's reward (TRL's signature): the share of a completion's words without the
    letter e (a lipogram, writing that avoids a letter). A dense signal a tiny model can learn by
    RL alone: its tokens differ in how many words with an e they make."""
    scores = []
    for completion in completions:
        words = (
            "".join(m["content"] for m in completion).split() if isinstance(completion, list) else completion.split()
        )
        scores.append(sum("e" not in w for w in words) / len(words) if words else 0.0)
    return scores


def e_lover(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """`lipogram` inverted: the share of words with an e (the demo test's control: RL must move
    the other way)."""
    return [1.0 - s for s in lipogram(prompts, completions)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tokenizer(out: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [r["text"] for r in text_rows(2000, seed=1)] + [
        "answer briefly. what color is the ? system user assistant"
    ]
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def make_model(
    out: Path,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    eos: int = 0,
    pad: int = 0,
) -> None:
    """A tiny Llama whose output layer is its input embedding, as in the small models most users
    start from (SmolLM2, Qwen2.5 0.5B-3B, Llama 3.2 1B/3B, Gemma): the quickstart meets what they do."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))


def make_all(root: str | Path, rows: int = 4000) -> Path:
    """root/model (model + tokenizer), root/model-hd64 (the same tokenizer, head_dim 64: what vLLM's CPU
    attention takes, for engine: vllm), root/text.jsonl, root/chat.jsonl, root/pairs.jsonl, root/kto.jsonl,
    root/prompts.jsonl, and an agent's (demo_agents.make_all: root/model-tools, root/arithmetic.jsonl,
    root/games.jsonl, root/tool-sft.jsonl); idempotent."""
    from raytrain import demo_agents

    root = Path(root)
    if (root / "model-hd64" / "config.json").exists() and (root / "prompts.jsonl").exists():
        demo_agents.make_all(root, rows, make_model, write_jsonl)
        return root
    tok = make_tokenizer(root / "model")
    make_model(root / "model", vocab_size=len(tok))
    tok.save_pretrained(str(root / "model-hd64"))
    make_model(root / "model-hd64", vocab_size=len(tok), hidden=128, heads=2, kv_heads=1)
    write_jsonl(root / "text.jsonl", text_rows(rows))
    write_jsonl(root / "chat.jsonl", chat_rows(rows // 4))
    write_jsonl(root / "pairs.jsonl", preference_rows(rows // 4))
    write_jsonl(root / "kto.jsonl", kto_rows(rows // 4, seed=1))
    write_jsonl(root / "prompts.jsonl", prompt_rows(rows // 8, seed=2))
    demo_agents.make_all(root, rows, make_model, write_jsonl)
    return root


if __name__ == "__main__":  # `raytrain quickstart` builds them so, in a process of their own
    import sys

    make_all(sys.argv[1])
