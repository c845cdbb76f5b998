"""What a LoRA job adapts: the one rule behind the workers' peft config (model/modeling.py), validate's
target check, its audit and the memory estimate, read from names and shapes alone so that pre-flight
applies it to a model's weights without torch.

Two kinds of target. Linear layers by module name (`target_modules`, peft's `lora.Linear`), and
parameters by name (`target_parameters`, peft's `ParamWrapper`: a parametrization that adds the
low-rank update to the weight at forward time), which is how an MoE's experts are adapted: transformers 5
fuses them into 3-D parameters ([experts, out, in]) no module name reaches, and `ParamWrapper` gives
each expert its own rank-r factors. An MoE job adapts its experts by default (`training.lora.experts`);
its router stays frozen unless named.

What peft does on its own. peft 0.21.2 rewrites old-style targets on the model families whose weights
transformers converts (Mixtral's, and the Qwen MoE family's: qwen3_moe, olmoe, deepseek_v3, ...):
`gate_proj`/`up_proj`/`down_proj` (`w1`-`w3`) become the experts' `gate_up_proj`/`down_proj`
parameters, `gate` the router's weight, and `gate_up_proj`'s rank and alpha are doubled (two
projections fused). `peft_rewrite` predicts it (tests/test_moe.py checks it against peft), raytrain's
defaults avoid it there, and the audit is read from what peft built (modeling.audit), not from what was
asked.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from raytrain.model import moe

# Linear layers LoRA adapts by default, by the names architectures use for them: attention
# and MLP projections (QLoRA's finding: adapting all of them matters).
DEFAULT_LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",  # llama, mistral, qwen, gemma
    "c_attn",
    "c_proj",
    "c_fc",  # gpt2
    "query_key_value",
    "dense",
    "dense_h_to_4h",
    "dense_4h_to_h",  # gpt-neox, falcon
    "Wqkv",
    "out_proj",
    "fc1",
    "fc2",  # mpt, phi, opt
    "qkv_proj",
    "gate_up_proj",  # phi-3 (its o_proj and down_proj are above)
)
# peft 0.21.2's rewrite (utils/transformers_weight_conversion.py: _MOE_TARGET_MODULE_MAPPING, _MOE_FUSED_TARGETS,
# and the families transformers' conversion_mapping sends to them): old target -> the parameter it becomes.
PEFT_REWRITES = {
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {
        "gate": "gate.weight",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    },
}
PEFT_FUSED = {"mixtral": ("w1", "w3"), "qwen2_moe": ("gate_proj", "up_proj")}  # both together double the rank
PEFT_FAMILIES = {"mixtral": "mixtral", "minimax": "mixtral", "minimax_m2": "mixtral", "qwen2_moe": "qwen2_moe"} | {
    t: "qwen2_moe"
    for t in (
        "afmoe beam cohere2_moe deepseek_v2 deepseek_v3 deepseek_v32 dots1 ernie4_5_moe exaone_moe flex_olmo glm4_moe "
        "glm4_moe_lite glm4v_moe glm_moe_dsa hunyuan_v1_moe longcat_flash mellum olmoe qwen3_moe qwen3_next "
        "qwen3_omni_moe qwen3_omni_moe_text qwen3_omni_moe_thinker solar_open"
    ).split()
}
GROUPS = ("attention", "dense MLP", "experts", "router", "embeddings", "output layer", "norms and other")


def matches(target: str, name: str) -> bool:
    """Whether one target entry names a module or parameter (peft's rule: the whole dotted name or its suffix)."""
    return name == target or name.endswith("." + target)


# Cached: a model's names come back at every decision, and each is up to seven regex searches (the
# combinations' covering set made 1.1M calls, 22 s, uncached).
@functools.lru_cache(maxsize=1 << 16)
def group_of(name: str) -> str:
    """Which of GROUPS a parameter or module (the base model's dotted name) belongs to."""
    leaf_module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if re.search(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_in|embed_positions)(\.|$)", name):
        return "embeddings"
    if re.search(r"(^|\.)(lm_head|embed_out|score|classifier)(\.|$)", name):
        return "output layer"
    if "norm" in leaf_module or leaf_module.startswith("ln"):
        return "norms and other"
    if re.search(r"\.experts\.", name):
        return "experts"
    if re.search(r"\.(router|gate|shared_expert_gate)(\.|$)", name):
        return "router"
    if re.search(r"\.(self_attn|attention|attn)\.", name):
        return "attention"
    if re.search(r"\.(mlp|feed_forward|ffn)\.", name):
        return "dense MLP"
    return "norms and other"


@dataclass(frozen=True)
class Adapters:
    """What a LoRA job hands peft, and what peft will make of it (`peft_rewrite`)."""

    modules: tuple[str, ...]  # target_modules as peft keeps them
    parameters: tuple[str, ...]  # target_parameters as peft keeps them
    ranks: dict = field(default_factory=dict)  # parameter leaf -> rank where peft changes it (a fused pair: 2r)
    rewritten: tuple[str, ...] = ()  # the asked module names peft turns into parameters
    asked: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # (target_modules, target_parameters) handed to peft


def default_parameters(parameters: Iterable[str]) -> list[str]:
    """An MoE's experts as `target_parameters`: each fused 3-D weight under `experts.` (not biases)."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in parameters if re.search(r"\.experts\.[^.]+$", n)})
    return [f"experts.{leaf}" for leaf in leaves if not leaf.endswith("_bias")]


def peft_rewrite(model_type: str, modules: list[str], parameters: list[str], rank: int) -> Adapters:
    """peft's own rewrite of old-style targets for `model_type`, as peft 0.21.2 applies it in
    `inject_adapter`: (modules left, parameters, ranks changed, names rewritten)."""
    family = PEFT_FAMILIES.get(model_type)
    asked = (tuple(modules), tuple(parameters))
    if family is None:
        return Adapters(tuple(modules), tuple(parameters), asked=asked)
    mapping, kept, params, moved = PEFT_REWRITES[family], [], list(parameters), []
    for t in modules:
        old = next((o for o in mapping if matches(o, t)), None)
        if old is None:
            kept.append(t)
            continue
        moved.append(t)
        if mapping[old] not in params:
            params.append(mapping[old])
    fused = PEFT_FUSED[family]
    both = all(any(matches(o, t) for t in moved) for o in fused)
    ranks = {mapping[fused[0]]: 2 * rank} if both else {}
    return Adapters(tuple(kept), tuple(params), ranks, tuple(moved), asked)


def decide(spec, modules: Iterable[str], parameters: Iterable[str], config: dict) -> Adapters:
    """The job's targets for a model with these linear `modules` and `parameters` (dotted names, the
    model's own): `training.lora`'s lists as given, else the default linear layers, and an MoE's
    experts unless `training.lora.experts` is false; then what peft makes of them."""
    lora, modules, parameters = spec.training.lora, list(modules), list(parameters)
    model_type = moe.text_config(config).get("model_type", "")
    asked = list(lora.target_modules) if lora.target_modules else None
    if asked is None:
        rewritten_here = set(PEFT_REWRITES.get(PEFT_FAMILIES.get(model_type, ""), {}))
        # On a family peft rewrites, a dense MLP's gate/up/down would become the experts' parameters
        # (at twice the rank): the defaults leave them out there (the audit shows the dense MLP frozen).
        asked = [
            t
            for t in DEFAULT_LORA_TARGETS
            if t not in rewritten_here and any(matches(t, m) for m in modules if group_of(m) != "experts")
        ]
    params = list(lora.target_parameters) if lora.target_parameters is not None else []
    if lora.target_parameters is None and lora.experts and moe.is_moe(config):
        params = default_parameters(parameters)
    return peft_rewrite(model_type, asked, params, lora.rank)


def unmatched(adapters: Adapters, modules: Iterable[str], parameters: Iterable[str]) -> list[str]:
    """Targets that name nothing in the model."""
    modules, parameters = list(modules), list(parameters)
    return [t for t in adapters.modules if not any(matches(t, m) for m in modules)] + [
        t for t in adapters.parameters if not any(matches(t, p) for p in parameters)
    ]


def expert_problems(spec, adapters: Adapters, parameters: Iterable[str]) -> list[tuple[str, str, str]]:
    """(field, value, why and the fix) for each LoRA option peft's ParamWrapper refuses while parameters
    (an MoE's experts) are adapted, and for asking experts frozen while peft adapts them anyway. (QLoRA
    takes them: its NF4 weights are the adapted linear layers', and the experts stay as loaded.)"""
    lora = spec.training.lora
    if not adapters.parameters:
        return []
    out, what = [], f"the adapted parameters ({', '.join(adapters.parameters)})"
    off = "set training.lora.experts: false (and no target_parameters)"
    if lora.dropout:
        out.append(
            (
                "training.lora.dropout",
                f"{lora.dropout:g}",
                f"peft's ParamWrapper, which adapts {what}, cannot apply dropout to a weight's input: set "
                f"training.lora.dropout: 0, or {off}",
            )
        )
    if lora.use_dora:
        out.append(
            (
                "training.lora.use_dora",
                "true",
                f"peft's ParamWrapper, which adapts {what}, has no DoRA: remove use_dora, or {off}",
            )
        )
    experts = [p for p in parameters if group_of(p) == "experts" and any(matches(a, p) for a in adapters.parameters)]
    if not lora.experts and experts:
        why = (
            f"peft 0.21 turns target_modules {', '.join(adapters.rewritten)} into the experts' parameters on "
            "this model family"
            if adapters.rewritten
            else "training.lora.target_parameters names them"
        )
        out.append(
            (
                "training.lora.experts",
                "false",
                f"the experts would be adapted anyway: {why}; remove those targets, or set training.lora.experts: true",
            )
        )
    return out


def lora_counts(adapters: Adapters, rank: int, shapes: dict[str, tuple[int, ...]], dora: bool = False) -> list:
    """(name, leaf, rank, experts, parameters) of each adapted module or parameter of a model whose
    parameter shapes are `shapes` (the model's names): what peft would create (`Adapters`)."""
    out = []
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2:
            module = name[: -len(".weight")]
            if any(matches(t, module) for t in adapters.modules):
                out.append((module, module.rsplit(".", 1)[-1], rank, 1, rank * sum(shape) + dora * shape[0]))
                continue
        if any(matches(t, name) for t in adapters.parameters) and len(shape) in (2, 3):
            leaf = name.rsplit(".", 1)[-1]
            r = adapters.ranks.get(leaf, rank)
            experts = shape[0] if len(shape) == 3 else 1
            out.append((name, leaf, r, experts, r * experts * sum(shape[-2:])))
    return out


def audit(counts: list, shapes: dict[str, tuple[int, ...]], full: bool) -> str:
    """Per group: what is adapted (LoRA: its targets, rank, experts) or trained, and the trainable
    parameter count; then the total. `counts`: `lora_counts`' rows, or the model's (modeling.audit);
    `shapes`: every parameter's, for which groups the model has."""
    have: dict[str, int] = {}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        have[group_of(name)] = have.get(group_of(name), 0) + n
    parts, total = [], 0
    for group in GROUPS:
        if group not in have:  # the model has none (no experts in a dense model)
            continue
        if full:
            parts.append(f"{group} trained ({have[group]:,})")
            total += have[group]
            continue
        mine = [c for c in counts if group_of(c[0]) == group]
        if not mine:
            parts.append(f"{group} frozen")
            continue
        n = sum(c[4] for c in mine)
        total += n
        leaves = sorted({(c[1], c[2], c[3]) for c in mine})
        named = ", ".join(
            f"{leaf} r={r}" + (f" x {experts} experts" if experts > 1 else "") for leaf, r, experts in leaves
        )
        parts.append(f"{group} LoRA {named} ({n:,})")
    return "; ".join(parts) + f"; trainable {total:,} params"
