"""Which of a model's modules a LoRA job adapts: the one rule behind the workers' peft config
(model/modeling.py), validate's target check and the memory estimate, read from module names
alone so that pre-flight applies it to a model's weight names without torch."""

from __future__ import annotations

from collections.abc import Iterable

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


def matches(target: str, module: str) -> bool:
    """Whether one `target_modules` entry names `module` (peft's rule: the whole dotted name or its suffix)."""
    return module == target or module.endswith("." + target)


def lora_targets(spec, modules: Iterable[str]) -> list[str]:
    """`training.lora.target_modules` as the job gives them, else the default targets among `modules`
    (the dotted names of the model's linear layers)."""
    given = spec.training.lora.target_modules
    if given:
        return list(given)
    modules = list(modules)
    return [t for t in DEFAULT_LORA_TARGETS if any(matches(t, m) for m in modules)]
