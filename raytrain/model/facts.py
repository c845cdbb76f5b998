"""What pre-flight knows of a model without torch: its config and its parameters' names and
shapes as transformers 5 builds the model, from the safetensors headers (a few KB read per file;
a mixture of experts' per-expert weights fused as transformers fuses them on load, model/moe.py)
or, when only config.json is at hand (a hub id in the local Hugging Face cache), from its
dimensions with a Llama-style layout assumed (fused experts and a router where the config has
them). memory.py estimates from these; preflight.py checks LoRA targets against them."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from raytrain.model import moe
from raytrain.model.targets import matches

# What transformers calls the head of a decoder's ...ForSequenceClassification (Llama, Qwen, Mistral,
# Gemma, GPT-NeoX), which a reward model trains; other architectures' classifier heads read alike.
SCORE_HEAD = "score"
SCORE_HEADS = (SCORE_HEAD, "classifier")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QK_NORMS = ("qwen3", "gemma3")  # families whose attention normalizes q and k per head (Qwen3, Qwen3-MoE, Gemma 3)
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass
class ModelFacts:
    """What pre-flight knows of a model: its config and its parameter names and shapes."""

    config: dict
    shapes: dict[str, tuple[int, ...]]
    source: str  # where the shapes came from, shown with the estimate
    exact_names: bool  # the model's own weight names (headers), not a layout assumed from config.json
    _lora_sizes: dict = field(default_factory=dict, repr=False)

    @cached_property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    @cached_property
    def layer_params(self) -> int:
        """The largest decoder block: what an all-gather materializes at once."""
        blocks: dict[str, int] = {}
        for name, shape in self.shapes.items():
            m = _LAYER.search(name)
            if m:
                blocks[m.group(1)] = blocks.get(m.group(1), 0) + math.prod(shape)
        return max(blocks.values(), default=self.n_params)

    @cached_property
    def modules(self) -> dict[str, tuple[int, ...]]:
        """Modules with a 2-D weight (linear layers, embeddings): what LoRA can adapt."""
        return {n[: -len(".weight")]: s for n, s in self.shapes.items() if n.endswith(".weight") and len(s) == 2}

    def matching(self, target: str) -> list[str]:
        """Modules peft would adapt for one `target_modules` entry (exact name or dotted suffix)."""
        return [m for m in self.modules if matches(target, m)]

    def lora_params(self, targets: list[str] | tuple[str, ...], rank: int) -> int:
        key = tuple(sorted(targets))
        if key not in self._lora_sizes:  # the fix search asks again and again
            mods = self.modules
            self._lora_sizes[key] = sum(mods[m][0] + mods[m][1] for m in {m for t in key for m in self.matching(t)})
        return rank * self._lora_sizes[key]

    def magnitude_params(self, targets: list[str] | tuple[str, ...]) -> int:
        """DoRA's magnitudes: one per output row of each adapted module."""
        return sum(self.modules[m][0] for m in {m for t in targets for m in self.matching(t)})

    def dim(self, *keys: str, default: int | None = None) -> int | None:
        for key in keys:
            if isinstance(self.config.get(key), int):
                return self.config[key]
        return default


def read_safetensors_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from a safetensors file: 8 bytes of header length, then JSON."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 256 * 2**20:
            raise ValueError(f"{file.name}: not a safetensors file (header length {size})")
        header = json.loads(f.read(size))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def layout_from_config(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-style decoder (GQA attention, gated MLP, optional experts)."""
    d = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    n_layers = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    vocab, heads = config.get("vocab_size"), config.get("num_attention_heads") or config.get("n_head")
    if not all(isinstance(x, int) for x in (d, n_layers, vocab, heads)):
        return {}  # not a layout this estimate knows (nested text_config, ...): no estimate rather than a wrong one
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or d // heads
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size") or config.get("n_inner") or 4 * d
    experts = moe.experts(config)
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * hd, d),
                p + "self_attn.k_proj.weight": (kv * hd, d),
                p + "self_attn.v_proj.weight": (kv * hd, d),
                p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
        if str(config.get("model_type", "")).startswith(QK_NORMS):  # RMS norms of each head's query and key
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if experts > 1:  # transformers 5's fused experts and the router (Qwen3-MoE's names)
            shapes.update(
                {
                    p + "mlp.experts.gate_up_proj": (experts, 2 * inter, d),
                    p + "mlp.experts.down_proj": (experts, d, inter),
                    p + "mlp.gate.weight": (experts, d),
                }
            )
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (inter, d),
                    p + "mlp.up_proj.weight": (inter, d),
                    p + "mlp.down_proj.weight": (d, inter),
                }
            )
    if not config.get("tie_word_embeddings", False):  # absent: count lm_head (an over- rather than under-estimate)
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def read_facts(folder: Path) -> ModelFacts:
    """Facts from a model folder (or a cache snapshot): headers when the weights are there."""
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("adapter_"))
    if files and all(f.is_file() for f in files):
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            shapes.update(read_safetensors_header(f))
        where = f"safetensors headers ({len(files)} file{'s' * (len(files) > 1)})"
        return ModelFacts(config, moe.model_shapes(shapes), where, True)
    return ModelFacts(config, layout_from_config(config), "config.json dimensions (Llama-style layout assumed)", False)
