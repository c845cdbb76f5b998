"""Load a Hugging Face causal LM and tokenizer, and apply LoRA. No torch.distributed here:
parallelism is the strategies' business (torchtitan's split)."""

from __future__ import annotations

import torch
from torch import nn

from .config import DEFAULT_LORA_TARGETS, JobSpec  # targets live torch-free: pre-flight checks them too
from .errors import JobError
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(spec: JobSpec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.model.tokenizer or spec.model.path, trust_remote_code=spec.model.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def linear_module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def lora_targets(spec: JobSpec, model: nn.Module) -> list[str]:
    if spec.training.lora.target_modules:
        return list(spec.training.lora.target_modules)
    present = linear_module_names(model)
    targets = [name for name in DEFAULT_LORA_TARGETS if name in present]
    if not targets:
        raise ValueError(f"no default LoRA targets in {type(model).__name__}; set training.lora.target_modules (linear layers: {sorted(present)})")
    return targets


def load_model(spec: JobSpec, *, on_meta: bool = False) -> nn.Module:
    """The model as `from_pretrained` gives it, with LoRA applied if asked.

    on_meta builds the same module tree without weights (no memory, no disk read):
    sharded strategies build on meta everywhere but rank 0 and broadcast rank 0's weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(dtype=DTYPES[spec.model.dtype], trust_remote_code=spec.model.trust_remote_code,
                  attn_implementation=spec.model.attn_implementation)
    if on_meta:
        config = AutoConfig.from_pretrained(spec.model.path, trust_remote_code=spec.model.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.model.path, **kwargs)
    model.config.use_cache = False  # the KV cache only costs memory in training
    if spec.training.finetune == "lora":
        model = apply_lora(spec, model)
    return model


def apply_lora(spec: JobSpec, model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = spec.training.lora
    torch.manual_seed(spec.training.seed)  # same adapter init on every rank and every restart
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora_targets(spec, model), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the class names HF marks as unsplittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:  # fall back to the longest ModuleList (the layer stack in every HF decoder)
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = list(max(lists, key=len)) if lists else []
    return blocks


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def require_complete(model: nn.Module, missing: list[str], unexpected: list[str], finetune: str, where: str) -> None:
    """A checkpoint must give every weight it trained. With LoRA the frozen base is the one
    expected absence (it comes from model.path); any other weight left at its initial value,
    or a saved weight this model does not have (a renamed key), is refused: a silent
    mismatch would train on, or export, weights nobody trained."""
    frozen = set() if finetune == "full" else {n for n, p in model.named_parameters() if not p.requires_grad}
    frozen |= {n for n, _ in model.named_buffers()}
    absent = sorted(k for k in missing if k not in frozen)
    if absent or unexpected:
        parts = ([f"no saved value for {len(absent)} weight(s) of the model, e.g. {absent[:3]}"] if absent else []) + \
                ([f"{len(unexpected)} saved weight(s) the model does not have, e.g. {sorted(unexpected)[:3]}"] if unexpected else [])
        raise JobError(f"the checkpoint {where} does not match model.path ({'; '.join(parts)}): it was written for "
                       f"another model or its keys were renamed. Point model.path at the model it was trained from")
