"""The decoder families users start from, at the demo model's toy size (2 layers, hidden 64, 4 heads
of 16, 2 KV heads where the family has grouped keys, the demo tokenizer's vocabulary), each with
what makes it differ from the Llama the demo is:

    llama          untied output layer, GQA (Llama 3.1 8B, Mistral 7B v0.1's block)
    qwen2 tied     tied output layer, GQA, biased q/k/v (Qwen2.5 0.5B-3B)
    mistral window tied, every layer attending 16 tokens back (rows are 64): masks for windows
    phi3           fused qkv_proj and gate_up_proj (Phi-3, Phi-3.5 mini)
    gemma          tied, embeddings scaled by sqrt(hidden), head_dim apart from hidden/heads, GeGLU
    gpt-neox       fused query_key_value, parallel residual, partial rotary, no KV groups (Pythia)

Built with transformers' own configs and `from_config`, saved beside the demo tokenizer: loaded
through the same `from_pretrained` path a hub id takes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FAMILIES = ("llama", "qwen2 tied", "mistral window", "phi3", "gemma", "gpt-neox")
TIED = {"qwen2 tied", "mistral window", "gemma"}


def config(family: str, demo: dict):
    """transformers' config of `family` at the demo model's sizes (`demo`: its config.json)."""
    from transformers import GemmaConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    size = {
        k: demo[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        )
    }
    tokens = {"eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None}
    gqa = {"num_key_value_heads": demo["num_key_value_heads"]}
    if family == "llama":
        return LlamaConfig(**size, **gqa, **tokens, tie_word_embeddings=False)
    if family == "qwen2 tied":
        return Qwen2Config(**size, **gqa, **tokens, tie_word_embeddings=True)
    if family == "mistral window":
        return MistralConfig(**size, **gqa, **tokens, sliding_window=16, tie_word_embeddings=True)
    if family == "phi3":
        return Phi3Config(**size, **gqa, **tokens, tie_word_embeddings=False)
    if family == "gemma":
        return GemmaConfig(
            **size,
            **gqa,
            **tokens,
            head_dim=demo["hidden_size"] // demo["num_attention_heads"],
            tie_word_embeddings=True,
        )
    if family == "gpt-neox":
        return GPTNeoXConfig(**size, **tokens, rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False)
    raise ValueError(family)


def build(family: str, assets: Path, out: Path) -> Path:
    """The family's toy model (seeded) and the demo tokenizer in `out`; returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    demo = json.loads((assets / "model" / "config.json").read_text())
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config(family, demo)).save_pretrained(str(out))
    for f in (assets / "model").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, out / f.name)
    return out
