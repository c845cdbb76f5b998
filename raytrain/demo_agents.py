"""Offline stand-ins for an agent: a tiny Llama with a tokenizer whose chat template renders tools
(a compact Qwen-like format: `<tool_call>{json}</tool_call>`, tool results as a `tool` turn) and a
response template that parses them back; a calculator tool; a guessing game environment (TRL's
environment_factory shape); arithmetic prompts and the SFT rows of whole tool episodes that teach
the call format. demo_assets.make_all builds them beside the other demo assets (`model-tools`)."""

from __future__ import annotations

import ast
import json
import operator
import random
from pathlib import Path

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:"
    "{%- for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties | list | join(', ') }})"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RESPONSE_TEMPLATE = {  # transformers' parse_response: calls, then the text up to the end of the turn
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# Of the SFT's sums, one in four is guessed without the calculator: the SFT'd agent calls it on about 0.83 of
# the sums it is asked and guesses the rest (right about 1 in 180), so GRPO has a choice to learn (to ~0.97 in
# 20 steps of jobs/grpo-tools.yaml).
GUESS_EVERY = 4


def calculator(expression: str) -> str:
    """Computes an arithmetic expression of whole numbers.

    Args:
        expression: whole numbers joined by +, - or *, e.g. "23 + 58"
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an arithmetic expression of whole numbers: {expression!r}")

    return str(value(ast.parse(expression, mode="eval").body))


class GuessingGame:
    """Guess the row's secret number from 1 to 9: each guess is answered higher, lower or correct."""

    def reset(self, secret: int, episode_key: int = 0, **row) -> str:
        self.secret, self.tries, self.solved = int(secret), 0, False
        return " (from 1 to 9)"

    def guess(self, number: int) -> str:
        """Guesses the secret number.

        Args:
            number: a whole number from 1 to 9
        """
        self.tries += 1
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        """1 for a first-try solve, a quarter less for each further guess, 0 unsolved."""
        return max(0.0, 1.0 - 0.25 * (self.tries - 1)) if self.solved else 0.0


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompts a tiny model cannot answer alone, and the calculator can: `what is a + b?`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f'what is "{a} + {b}"?'}], "solution": str(a + b)})
    return rows


def game_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": "guess my number"}], "secret": rng.randint(1, 9)} for _ in range(n)]


def _call(name: str, **arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def _episodes(rng: random.Random, n: int) -> list[tuple[list[dict], str]]:
    """Whole tool episodes as (messages, the tool they use): two in three are sums, one in three a game
    played by halving. Of the sums, GUESS_EVERY-th are guessed without the calculator, the rest call it and
    copy its result."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            secret, low, high = rng.randint(1, 9), 1, 9
            turns = [{"role": "user", "content": "guess my number (from 1 to 9)"}]
            while True:
                guess = (low + high) // 2
                answer = "correct" if guess == secret else "higher" if guess < secret else "lower"
                turns += [_call("guess", number=guess), {"role": "tool", "name": "guess", "content": answer}]
                if answer == "correct":
                    break
                low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
            out.append((turns + [{"role": "assistant", "content": "got it"}], "guess"))
            continue
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = {"role": "user", "content": f'what is "{a} + {b}"?'}
        if (i // 3) % GUESS_EVERY == GUESS_EVERY - 1:
            out.append(([question, {"role": "assistant", "content": str(rng.randint(20, 198))}], "calculator"))
            continue
        result = str(a + b)
        call = _call("calculator", expression=f"{a} + {b}")
        tool = {"role": "tool", "name": "calculator", "content": result}
        out.append(([question, call, tool, {"role": "assistant", "content": result}], "calculator"))
    return out


def schemas() -> dict[str, dict]:
    from transformers.utils import get_json_schema

    return {"calculator": get_json_schema(calculator), "guess": get_json_schema(GuessingGame.guess)}


def sft_rows(tok, n: int, seed: int = 0) -> list[dict]:
    """Chat rows (role, content) that render exactly as the tool episodes would: the template's own
    text for the tools' system turn and each call, so SFT teaches the format GRPO samples in."""
    rng, tools, rows = random.Random(seed), schemas(), []
    for messages, tool in _episodes(rng, n):
        text = tok.apply_chat_template(messages, tools=[tools[tool]], tokenize=False)
        turns = []
        for chunk in text.split("<|im_start|>")[1:]:
            role, _, content = chunk.partition("\n")
            turns.append({"role": role, "content": content.removesuffix("\n").removesuffix("<|im_end|>")})
        rows.append({"messages": turns})
    return rows


def make_tokenizer(out: Path, vocab_size: int = 640):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(3)
    corpus = [json.dumps(m) for e, _ in _episodes(rng, 4000) for m in e] + [str(i) for i in range(200)] * 20
    corpus += ["tools: calculator(expression) guess(number) system user assistant tool what is"] * 200
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TOOLS_TEMPLATE
    fast.response_template = RESPONSE_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def make_all(root: Path, rows: int, make_model, write_jsonl) -> None:
    """root/model-tools (model + tokenizer; head_dim 64, for vLLM's CPU attention too),
    root/arithmetic.jsonl, root/games.jsonl, root/tool-sft.jsonl; idempotent. demo_assets.make_all calls
    it with its own model and file writers (this module imports nothing of raytrain: a leaf)."""
    if (root / "tool-sft.jsonl").exists():
        return
    tok = make_tokenizer(root / "model-tools")
    make_model(  # its turns end at <|im_end|>
        root / "model-tools", len(tok), hidden=128, heads=2, kv_heads=1, eos=tok.eos_token_id, pad=tok.pad_token_id
    )
    write_jsonl(root / "arithmetic.jsonl", arithmetic_rows(rows // 8, seed=4))
    write_jsonl(root / "games.jsonl", game_rows(rows // 8, seed=5))
    write_jsonl(root / "tool-sft.jsonl", sft_rows(tok, rows, seed=6))  # 300 SFT steps of 16 see each ~once
