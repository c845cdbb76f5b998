"""What raytrain knows of a mixture-of-experts model without torch: whether its config makes it one,
its experts, how transformers 5 lays their weights out in the model (fused 3-D parameters) against
how its files may hold them (one 2-D weight an expert, the hub's layout), and the rules an MoE job
follows (the router's balancing loss, LoRA on the experts). validate and the workers read these
same functions.

The layout. transformers 5 holds an MoE layer's experts as `mlp.experts.gate_up_proj` [experts,
2·inter, hidden] and `mlp.experts.down_proj` [experts, hidden, inter] (gpt-oss transposed: [experts,
hidden, 2·inter] and [experts, inter, hidden], with biases), and converts the per-expert weights of a
file (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) on
load, by the conversions its `conversion_mapping` lists for the family. `FILE_TO_MODEL` is that list
for the families raytrain knows (tests/test_moe.py checks it against transformers' own models).
"""

from __future__ import annotations

import re

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# file pattern of one expert's weight -> (the model's fused parameter, which part of it: gate, up or whole)
FILE_TO_MODEL = (
    (re.compile(r"^(.*\.)experts\.(\d+)\.(gate_proj|w1)\.weight$"), "experts.gate_up_proj", 0),
    (re.compile(r"^(.*\.)experts\.(\d+)\.(up_proj|w3)\.weight$"), "experts.gate_up_proj", 1),
    (re.compile(r"^(.*\.)experts\.(\d+)\.(down_proj|w2)\.weight$"), "experts.down_proj", None),
)
RENAMES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),)  # Mixtral's module, renamed on load


def is_moe(config: dict) -> bool:
    """A model that routes tokens to experts and returns its router's logits (TRL's test: the config
    has `output_router_logits`), with more than one expert."""
    config = text_config(config)
    return "output_router_logits" in config and experts(config) > 1


def text_config(config: dict) -> dict:
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def experts(config: dict) -> int:
    config = text_config(config)
    return next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), 1)


def top_k(config: dict) -> int:
    return int(text_config(config).get("num_experts_per_tok") or 1)


def router_aux_coef(requested: float | None, config: dict) -> float:
    """`training.router_aux_loss_coef` as TRL resolves it: None takes the model config's coefficient
    (0 where it declares none), 0 turns the loss off."""
    if requested is not None:
        return requested
    coef = text_config(config).get("router_aux_loss_coef") or 0.0
    return coef * 1.0 if is_moe(config) else 0.0  # (a config.json number: no tensor, nothing read from a device)


def router_aux_problem(requested: float | None, config: dict) -> str | None:
    """Why `training.router_aux_loss_coef` cannot be set for this model (a dense one: nothing routes)."""
    if requested and not is_moe(config):
        kind = text_config(config).get("model_type", "this model")
        return (
            f"training.router_aux_loss_coef={requested:g}: {kind} is not a mixture of experts (its config has no "
            "router, output_router_logits), so there is no balancing loss to weight; remove "
            "training.router_aux_loss_coef"
        )
    return None


def model_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A model's parameter shapes as transformers 5 builds it from files holding `shapes`: one 2-D
    weight an expert fused into the layer's 3-D parameters; everything else as it is."""
    out: dict[str, tuple[int, ...]] = {}
    fused: dict[str, dict[int, list]] = {}  # model name -> expert -> [gate, up] or [whole] shapes
    for name, shape in shapes.items():
        for pattern, replacement in RENAMES:
            name = pattern.sub(replacement, name)
        for pattern, target, part in FILE_TO_MODEL:
            m = pattern.match(name)
            if m and len(shape) == 2:
                slots = fused.setdefault(m.group(1) + target, {}).setdefault(int(m.group(2)), [None, None])
                slots[part or 0] = shape
                break
        else:
            out[name] = shape
    for name, by_expert in fused.items():
        parts = [p for p in by_expert[min(by_expert)] if p is not None]
        rows = sum(p[0] for p in parts)  # gate and up stacked along the output rows (transformers' Concatenate)
        out[name] = (len(by_expert), rows, parts[0][1])
    return out


def fused_in_files(shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the files hold one weight an expert, which transformers fuses on load."""
    return any(p.match(n) for n in shapes for p, _, _ in FILE_TO_MODEL)


def file_parts(keys) -> dict[str, dict[int, list[str]]]:
    """{the model's fused parameter: {expert: [its file keys, in row order]}} for files holding one
    weight an expert (`FILE_TO_MODEL`): gate's rows first, up's after them, as transformers concatenates
    them (each part's rows are its file weight's first dimension)."""
    keys = list(keys)
    out: dict[str, dict[int, list]] = {}
    for key in keys:
        name = key
        for pattern, replacement in RENAMES:
            name = pattern.sub(replacement, name)
        for pattern, target, part in FILE_TO_MODEL:
            m = pattern.match(name)
            if m:
                out.setdefault(m.group(1) + target, {}).setdefault(int(m.group(2)), [None, None])[part or 0] = key
                break
    return {n: {e: [k for k in slots if k] for e, slots in by.items()} for n, by in out.items()}
