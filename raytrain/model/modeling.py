"""Load a Hugging Face causal LM and tokenizer, and apply LoRA. No torch.distributed here:
parallelism is the strategies' business (torchtitan's split)."""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job.implementations import choose_experts
from raytrain.job.spec import JobSpec
from raytrain.model import attention, hub, moe, targets
from raytrain.model.facts import SCORE_HEAD

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lora_targets(spec: JobSpec, model: nn.Module) -> targets.Adapters:
    """The job's LoRA targets on `model` (targets.decide, validate's rule), refused as validate refuses them."""
    linear = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    params = [name for name, _ in model.named_parameters()]
    chosen = targets.decide(spec, linear, params, model.config.to_dict())
    problems = targets.expert_problems(spec, chosen, params)
    if problems:  # validate refuses them first, from the weight names
        raise JobError("; ".join(f"{field}={value}: {why}" for field, value, why in problems))
    missing = targets.unmatched(chosen, linear, params)
    if missing or not (chosen.modules or chosen.parameters):
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise JobError(
            f"the LoRA target(s) {missing or 'chosen'} match nothing in {type(model).__name__}; set "
            f"training.lora.target_modules (its linear layers: {leaves}) or target_parameters"
        )
    return chosen


def audit(model: nn.Module, full: bool) -> str:
    """targets.audit of what peft built (not what was asked): each LoRA layer's rank and experts as peft made
    them, each trained weight outside one (a reward model's head), counted whole (DTensor and ZeRO-3 sizes)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    size = lambda p: getattr(p, "ds_numel", None) or p.numel()  # noqa: E731 - ZeRO-3 keeps the whole size apart
    shapes = {base_name(n): tuple(getattr(p, "ds_shape", None) or p.shape) for n, p in model.named_parameters()}
    shapes = {n: s for n, s in shapes.items() if ".lora_" not in n and "modules_to_save" not in n}
    counts, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.r:
            continue
        base = base_name(name).replace(".base_layer", "")
        parts = [getattr(module, k, {}) for k in ("lora_A", "lora_B", "lora_magnitude_vector")]
        own = [p for part in parts if "default" in part for p in part["default"].parameters()]
        seen.update(id(p) for p in own)
        if isinstance(module, ParamWrapper):
            target, leaf, experts = f"{base}.{module.parameter_name}", module.parameter_name, module.num_experts
        else:
            target, leaf, experts = base, base.rsplit(".", 1)[-1], 1
        counts.append((target, leaf, module.r["default"], experts, sum(size(p) for p in own)))
    for name, p in model.named_parameters():  # trained whole beside the adapters (peft's modules_to_save)
        if p.requires_grad and id(p) not in seen:
            clean = base_name(name).replace(".modules_to_save.default", "")
            counts.append((clean, clean.rsplit(".", 2)[-2] + " (whole)", 0, 1, size(p)))
    return targets.audit(counts, shapes, full)


def load_model(spec: JobSpec, *, on_meta: bool = False, empty: bool = False) -> nn.Module:
    """The model as `from_pretrained` gives it, with LoRA applied if asked.

    empty builds it from its config without reading a weight: under a live HfDeepSpeedConfig
    transformers creates it partitioned (zero.Init), for ZeRO-3 to fill module by module.

    on_meta builds the same module tree with no weight read or allocated, for the sharded
    strategies, which materialize only their shards and fill them from the model's files. LoRA
    adapters are the exception: they are in no file, so they are created real, from the job's
    seed, with exactly the values a loaded model's adapters get (see `meta_base`); the
    strategy takes them out with `take_adapters`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = attention.resolve(spec)  # `auto` as the model's class and the workers decide it
    kwargs = dict(
        dtype=DTYPES[spec.model.dtype],
        attn_implementation=spec.model.attn_implementation,
        trust_remote_code=spec.model.trust_remote_code,
    )
    auto, head = AutoModelForCausalLM, {}
    if spec.scores:  # a reward model: TRL's RewardTrainer's, read where transformers reads it (`objectives.Reward`)
        auto, head = (
            AutoModelForSequenceClassification,
            {"num_labels": 1, "pad_token_id": hub.load_tokenizer(spec).pad_token_id},
        )
    config = AutoConfig.from_pretrained(spec.model.path, **spec.model.hub_kwargs(), **head)
    experts = experts_kernel(spec, config.to_dict())
    if experts:  # chosen, not transformers' default taken silently (job/implementations.py)
        kwargs["experts_implementation"] = experts
    try:
        if on_meta or empty:
            with torch.device("meta") if on_meta else contextlib.nullcontext():
                model = auto.from_config(config, **kwargs)
        else:
            model = auto.from_pretrained(spec.model.path, revision=spec.model.revision, **kwargs, **head)
            new = new_weights(spec, model)  # transformers drew the score head from the global RNG
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in new:
                        p.copy_(new[name])
    except ImportError as exc:  # transformers' word that the kernels are not on this node
        if not spec.model.attn_implementation.startswith("flash"):
            raise
        raise JobError(
            f"model.attn_implementation {spec.model.attn_implementation} cannot run on this worker "
            f"({str(exc).splitlines()[0]}): flash-attn needs GPU workers with the flash-attn package in "
            "their image; install it there, or use model.attn_implementation: sdpa"
        ) from None
    model.config.use_cache = False  # the KV cache only costs memory in training
    # raytrain tells attention where each micro-batch's documents are (attention.py); the strategy
    # puts Ulysses' exchange around it under sequence parallelism.
    attention.install(model, spec.model.attn_implementation)
    if spec.training.adapters:
        with meta_base(model) if on_meta else contextlib.nullcontext():
            model = apply_lora(spec, model)
    return model


def experts_kernel(spec: JobSpec, config: dict) -> str | None:
    """transformers' `experts_implementation` the job's mixture-of-experts model runs (None: a dense model)."""
    return choose_experts("cuda" if spec.scaling.use_gpu else "cpu") if moe.is_moe(config) else None


def apply_lora(spec: JobSpec, model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = spec.training.lora
    torch.manual_seed(spec.training.seed)  # same adapter init on every rank and every restart
    # A reward model's head is new: peft's SEQ_CLS task trains it whole beside the adapters (its
    # `modules_to_save`), and the exported adapter carries it.
    # What the job asks, as it asks it: peft's own rewrite on some MoE families applies (targets.py), and
    # the audit reads what peft built.
    modules, parameters = lora_targets(spec, model).asked
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(modules) or None,
        target_parameters=list(parameters) or None,
        task_type="SEQ_CLS" if spec.scores else "CAUSAL_LM",
        use_dora=lora.use_dora,
    )
    model = get_peft_model(model, config)
    for name, module in model.named_modules():  # the head's trained copy, as peft keeps its adapters:
        if name.endswith(f"{SCORE_HEAD}.modules_to_save.default"):  # plain parameters, fp32 under a 16-bit base
            for leaf, p in list(module.named_parameters(recurse=False)):  # (a copy of a ZeRO-3 partitioned
                dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype  # layer is not one)
                setattr(module, leaf, nn.Parameter(p.detach().to(dtype, copy=True)))
    return model


def new_weights(spec: JobSpec, model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: starting value} of the weights in no model file: a reward model's score head
    (under LoRA its frozen original and its trained copy alike). Drawn from the job's seed as
    transformers initializes a linear layer (normal, std `initializer_range`), the same on every rank,
    strategy and restart; the strategies fill them after the files' weights."""
    if not spec.scores:
        return {}
    params = {n: p for n, p in model.named_parameters() if base_name(n).split(".")[0] == SCORE_HEAD}
    if not params:
        raise JobError(
            f"training.objective: reward needs a sequence-classification head named {SCORE_HEAD!r}; "
            f"{type(model).__name__} has none. Use a model whose architecture has ...ForSequenceClassification"
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    std = getattr(base.config.get_text_config(), "initializer_range", 0.02)
    out = {}
    for n, p in params.items():
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # (ZeRO-3 keeps a partition's shape apart)
        g = torch.Generator().manual_seed(spec.training.seed)
        out[n] = torch.randn(shape, generator=g) * std if n.endswith("weight") else torch.zeros(shape)
    return out


@contextlib.contextmanager
def meta_base(model: nn.Module):
    """While LoRA is applied to a model built on meta, its weights look like CPU tensors of their
    shape and dtype (zero-stride views of one element: no memory). peft then creates, seeds and
    casts the adapters on the CPU exactly as on a loaded model, instead of moving them to meta
    (peft puts an adapter on its base layer's device). The meta weights are put back after."""
    swapped: dict[int, nn.Parameter] = {}
    places = [(m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False)]
    for module, name, p in places:
        stand_in = swapped.setdefault(
            id(p), nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad)
        )
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, p in places:  # peft froze the stand-ins: freeze the weights alike
            setattr(module, name, p.requires_grad_(swapped[id(p)].requires_grad))


def take_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The real (adapter) weights of a model `load_model(on_meta=True)` built, by name; the whole
    model is on meta after, ready to be sharded."""
    # No copy: `to("meta")` gives each parameter a new tensor, and these keep the old storage.
    real = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}
    model.to("meta")
    return real


def init_buffers(model: nn.Module) -> None:
    """Compute the buffers of a model materialized from meta as `from_pretrained` computes them
    (rotary frequencies are in no weight file): transformers' own `_init_weights` of each module
    that holds buffers and no weights. A buffer it does not compute is refused by name rather
    than trained on with garbage."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for module in model.modules():
        own = list(module.named_buffers(recurse=False))
        if own and not list(module.parameters(recurse=False)):
            for _, buf in own:
                if buf.is_floating_point():
                    buf.fill_(float("nan"))
            private_apis.init_weights(base, module)
            left = [n for n, b in own if b.is_floating_point() and bool(b.isnan().any())]
            if left:
                raise JobError(
                    f"cannot compute the buffer(s) {left} of {type(module).__name__} when loading "
                    f"{type(base).__name__} shard by shard. Use training.strategy: zero3 or ddp"
                )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the class names HF marks as unsplittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(private_apis.unsplittable_blocks(base))
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:  # fall back to the longest ModuleList (the layer stack in every HF decoder)
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = list(max(lists, key=len)) if lists else []
    return blocks


def _tied(lookup: nn.Module | None, head: nn.Module | None) -> bool:
    """Whether the input embedding and the output layer share a weight (one table at both ends)."""
    if lookup is None or head is None:
        return False
    return bool({id(p) for p in lookup.parameters()} & {id(p) for p in head.parameters()})


def untied_input_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding, when it shares no weight with the output layer (None when it does:
    the one table is then used at both ends of the forward)."""
    lookup = model.get_input_embeddings()
    return None if lookup is None or _tied(lookup, model.get_output_embeddings()) else lookup


def frozen_output_weight(model: nn.Module) -> nn.Parameter | None:
    """The output layer's weight when it does not train (LoRA, QLoRA), tied to the input embedding
    or not: the chunked loss applies it after the model's forward and its backward needs it again,
    so a sharded copy would be gathered for the whole step anyway (strategies/fsdp2.py keeps it whole)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, nn.Parameter) and not weight.requires_grad else None


def tied(model: nn.Module) -> bool:
    return _tied(model.get_input_embeddings(), model.get_output_embeddings())


def sparse_tied_lookup(model: nn.Module, device: torch.device) -> bool:
    """Where the input embedding is the output layer's weight and trains (a full fine-tune of a tied
    model: SmolLM2, Qwen2.5 up to 3B, Llama 3.2 1B/3B, Gemma), look tokens up with a sparse gradient.
    A dense lookup's backward makes a zeroed table for its few rows, and autograd a third table for
    its sum with the output layer's gradient (that one is a transposed view, which autograd does not
    add into); a sparse one is added into a single new table: one table-sized tensor less at the
    backward's peak (benchmarks/RESULTS.md, "A tied table's gradient"). The weight's gradient stays
    dense, since the output layer adds one in every objective's loss, so the strategies and AdamW see
    what they saw. Call it after DDP is built: DDP reads `sparse` once, to expect a sparse gradient.
    CPU workers only, where it was measured and tested: an accelerator keeps the dense lookup (a
    backend without sparse kernels aborts in the backward, as the stand-in device of
    tests/test_device.py did; CUDA's sparse path under FSDP2 has not run on a GPU here)."""
    lookup, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (
        device.type != "cpu"
        or not isinstance(lookup, nn.Embedding)
        or not _tied(lookup, head)
        or not lookup.weight.requires_grad
    ):
        return False
    lookup.sparse = True
    return True


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def require_complete(model: nn.Module, missing: list[str], unexpected: list[str], finetune: str, where: str) -> None:
    """A checkpoint must give every weight it trained. With LoRA the frozen base is the one
    expected absence (it comes from model.path); any other weight left at its initial value,
    or a saved weight this model does not have (a renamed key), is refused: a silent
    mismatch would train on, or export, weights nobody trained."""
    # Every name of each tensor: a tied output layer's weight is the input embedding's, which
    # named_parameters() lists once (under the embedding's name); set_state_dict names both.
    names: dict[int, set[str]] = {}
    frozen = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(n)
        if finetune != "full" and not p.requires_grad:
            frozen.add(n)
    missing_set = set(missing)
    given = {n for group in names.values() if group - missing_set for n in group}  # saved under another name
    absent = sorted(k for k in missing if k not in frozen and k not in given)
    if absent or unexpected:
        parts = ([f"no saved value for {len(absent)} weight(s) of the model, e.g. {absent[:3]}"] if absent else []) + (
            [f"{len(unexpected)} saved weight(s) the model does not have, e.g. {sorted(unexpected)[:3]}"]
            if unexpected
            else []
        )
        raise JobError(
            f"the checkpoint {where} does not match model.path ({'; '.join(parts)}): it was written for "
            f"another model or its keys were renamed. Point model.path at the model it was trained from"
        )


_PEFT_PREFIX = re.compile(r"^base_model\.model\.")
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")  # nested where peft wraps one module twice (ParamWrapper per parameter)


def base_name(name: str) -> str:
    """A peft parameter name as the base model calls it."""
    return _BASE_LAYERS.sub(".", _PEFT_PREFIX.sub("", name))
