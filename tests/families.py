"""The decoder families users start from, at the demo model's toy size (2 layers, hidden 64, 4 heads
of 16, 2 KV heads where the family has grouped keys, the demo tokenizer's vocabulary), each with
what makes it differ from the Llama the demo is:

    llama          untied output layer, GQA (Llama 3.1 8B, Mistral 7B v0.1's block)
    qwen2 tied     tied output layer, GQA, biased q/k/v (Qwen2.5 0.5B-3B)
    mistral window tied, every layer attending 16 tokens back (rows are 64): masks for windows
    phi3           fused qkv_proj and gate_up_proj (Phi-3, Phi-3.5 mini)
    gemma          tied, embeddings scaled by sqrt(hidden), head_dim apart from hidden/heads, GeGLU
    gpt-neox       fused query_key_value, parallel residual, partial rotary, no KV groups (Pythia)
    qwen3 tied     tied, RMS norms on q and k (Qwen3 0.6B-4B)
    qwen3-moe      4 experts, 2 a token, fused expert weights (transformers 5's layout), a raw router
                   parameter (Qwen3-30B-A3B, -235B-A22B)
    gpt-oss        biased experts and router, attention sinks (no sdpa), a sliding window on every other
                   layer (gpt-oss-20b/120b)
    gemma3         tied, scaled embedding, q/k norms, a window on every other layer, query_pre_attn_scalar

Built with transformers' own configs and `from_config`, saved beside the demo tokenizer: loaded
through the same `from_pretrained` path a hub id takes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FAMILIES = (
    "llama",
    "qwen2 tied",
    "mistral window",
    "phi3",
    "gemma",
    "gpt-neox",
    "qwen3 tied",
    "qwen3-moe",
    "gpt-oss",
    "gemma3",
)
TIED = {"qwen2 tied", "mistral window", "gemma", "qwen3 tied", "gemma3"}
MOE = {"qwen3-moe", "gpt-oss"}  # experts as fused 3-D parameters, a router
NO_SDPA = {"gpt-oss"}  # classes without sdpa (attention sinks): eager on CPU (tests/test_moe.py reads the flags)


def config(family: str, demo: dict):
    """transformers' config of `family` at the demo model's sizes (`demo`: its config.json)."""
    from transformers import (
        Gemma3TextConfig,
        GemmaConfig,
        GPTNeoXConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

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
    head_dim = demo["hidden_size"] // demo["num_attention_heads"]
    # Experts: 4 of a quarter of the dense MLP's width, 2 a token (Qwen3-30B-A3B routes 8 of 128)
    experts = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
    if family == "qwen3 tied":
        return Qwen3Config(**size, **gqa, **tokens, head_dim=head_dim, tie_word_embeddings=True)
    if family == "qwen3-moe":
        return Qwen3MoeConfig(
            **size,
            **gqa,
            **tokens,
            **experts,
            head_dim=head_dim,
            num_experts=4,
            moe_intermediate_size=demo["intermediate_size"] // 4,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    if family == "gpt-oss":
        return GptOssConfig(
            **{**size, "intermediate_size": demo["intermediate_size"] // 4},
            **gqa,
            **tokens,
            **experts,
            head_dim=head_dim,
            num_local_experts=4,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (size["num_hidden_layers"] // 2),
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
            tie_word_embeddings=False,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            **size,
            **gqa,
            **tokens,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (size["num_hidden_layers"] // 2),
            tie_word_embeddings=True,
        )
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
