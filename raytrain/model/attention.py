"""The attention every raytrain model runs: the job's implementation (eager, sdpa, flash), told each
micro-batch's document boundaries by raytrain (the rule is masks.py's), with or without Ulysses'
exchange around it (strategies/ulysses.py).

Why not transformers' own: it infers packed documents from the position ids inside the model, per
layer for flash (`position_ids == min`, batch 1 only: a row that starts mid-document loses its
leading tokens, rows of a micro-batch of 2 attend to each other) and with a device sync per
forward for sdpa/eager. Here the boundaries come from the host rows, once per micro-batch, and
reach the attention as keyword arguments of the model's forward: transformers passes them down to
each layer, and activation checkpointing keeps them for the recomputation in backward (a context
set around the forward would be gone by then).

The model's config names `raytrain-<inner>` (registered with transformers' AttentionInterface and
deliberately not with its mask interface, so transformers builds no mask and infers nothing).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from raytrain import private_apis
from raytrain.errors import JobError
from raytrain.job import masks
from raytrain.job.implementations import AUTO, AttentionFlags, attention_problem, choose_attention
from raytrain.job.plan import RunPlan
from raytrain.model import kernels

PREFIX = "raytrain-"


def resolve(spec):
    """The job with `model.attn_implementation` as its workers run it: `auto` resolved from the model
    class's own flags (job/implementations.py, the rule validate applies from the class's source), an
    explicit choice the class cannot run refused."""
    chosen, _ = choice(spec)
    if chosen == spec.model.attn_implementation:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"attn_implementation": chosen})})


def choice(spec) -> tuple[str, str]:
    """(implementation, why: empty where the job named it) for the job's model on its workers."""
    m, plan = spec.model, RunPlan.of(spec)
    return _choice(
        m.path, m.revision, m.trust_remote_code, spec.scores, m.attn_implementation, spec.scaling.use_gpu, plan.bf16
    )


@functools.cache  # the model's class is looked up once a process (every load_model asks)
def _choice(path, revision, remote, scores, requested, gpu, bf16) -> tuple[str, str]:
    flags = model_flags(path, revision, remote, scores)
    if flags is None:  # a class found nowhere: transformers' own choice at load (sdpa, or its error)
        return (
            ("sdpa", "auto: sdpa (the model's class was not found to read its flags)")
            if requested == AUTO
            else (
                requested,
                "",
            )
        )
    problem = attention_problem(flags, requested)
    if problem:
        raise JobError(f"model.attn_implementation {requested}: {problem}")
    return choose_attention(flags, "cuda" if gpu else "cpu", bf16) if requested == AUTO else (requested, "")


def model_flags(path: str, revision: str | None, remote: bool, scores: bool) -> AttentionFlags | None:
    """The attention flags of the class the job's model loads as, from its config (no weights)."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=remote)
    auto = "AutoModelForSequenceClassification" if scores else "AutoModelForCausalLM"
    try:
        if remote and auto in (getattr(config, "auto_map", None) or {}):
            cls = get_class_from_dynamic_module(config.auto_map[auto], path, revision=revision)
        else:
            mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if scores else MODEL_FOR_CAUSAL_LM_MAPPING
            cls = mapping[type(config)]
    except (KeyError, ValueError, OSError):
        return None
    return AttentionFlags.of(cls.__name__, private_apis.attention_flags(cls))


@dataclass
class Boundaries:
    """A micro-batch's documents, from its whole rows' position ids in host memory."""

    documents: torch.Tensor  # [b, s]: each token's document number within its row, from 0
    packed: bool  # some row holds more than one document

    @classmethod
    def of(cls, positions: torch.Tensor) -> "Boundaries":
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1  # masks.py's rule; a row starts one
        documents = starts.cumsum(-1) - 1
        return cls(documents, bool(documents[:, -1].any()))  # host: the micro-batch's rows

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens, max_seqlen) of the rows flattened into one sequence: every document, and
        every row, its own segment (int32, host)."""
        b, s = self.documents.shape
        starts = torch.ones_like(self.documents, dtype=torch.bool)
        starts[:, 1:] = self.documents[:, 1:] != self.documents[:, :-1]
        begin = starts.flatten().nonzero().flatten()
        cu = torch.cat([begin, torch.tensor([b * s])]).to(torch.int32)
        return cu, int(cu.diff().max())  # host: the micro-batch's rows

    def mask(self, documents: torch.Tensor, window: int | None, additive: torch.dtype | None) -> torch.Tensor:
        """[b, 1, s, s] from `documents` (this on the device): True (or 0) where a query may attend."""
        s = documents.shape[1]
        at = torch.arange(s, device=documents.device)
        back = at[:, None] - at[None, :]  # query index - key index
        near = (back >= 0) if window is None else (back >= 0) & (back < window)
        allowed = (near & (documents[:, :, None] == documents[:, None, :]))[:, None]
        if additive is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=additive, device=documents.device).masked_fill(
            ~allowed, torch.finfo(additive).min
        )


def model_kwargs(
    boundaries: Boundaries,
    implementation: str,
    windows: tuple[int | None, ...],
    device: torch.device,
    dtype: torch.dtype,
    on_device: bool = False,
) -> dict:
    """What the model's forward is given for this micro-batch's attention (masks.py says what), for
    `implementation` as the worker runs it (`kernels.attention_kernel`: sdpa may run varlen).
    `on_device`: the boundaries' documents are on `device` already (a plain forward's fallback)."""
    if implementation.startswith("flash") or implementation == kernels.VARLEN_NAME:
        cu, longest = boundaries.varlen()
        cu = to_device(cu, device)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    built = masks.mask_windows(implementation, boundaries.packed, windows)
    documents = (boundaries.documents if on_device else to_device(boundaries.documents, device)) if built else None
    additive = dtype if implementation == "eager" else None
    return {"raytrain_masks": {w: boundaries.mask(documents, w, additive) for w in built}}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue: from pinned memory, copied
    asynchronously (a pageable copy to a GPU waits for its stream)."""
    if device.type == "cpu":
        return t
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def name(inner: str) -> str:
    return PREFIX + inner


def install(model: torch.nn.Module, inner: str, split=None) -> None:
    """Route `model`'s attention (its config is shared by its layers) through raytrain's, around
    `inner`; under sequence parallelism through `split`'s exchange (`ulysses.SequenceSplit`)."""
    from transformers.modeling_utils import AttentionInterface

    registered = name(inner) + ("-ulysses" if split is not None else "")

    def attention(module, query, key, value, attention_mask, **kwargs):
        return attend(module, query, key, value, inner=inner, split=split, **kwargs)

    AttentionInterface.register(registered, attention)
    private_apis.set_attn_implementation(model.config, registered)


def attend(module, query, key, value, *, inner: str, split, raytrain_masks: dict | None = None, **kwargs):
    """One layer's attention over whole rows ([b, heads, s, d] in, [b, s, heads, d] out)."""
    flash = inner.startswith("flash")
    varlen = inner == "sdpa" and "cu_seq_lens_q" in kwargs  # torch's varlen kernel (kernels.py)
    kwargs.pop("position_ids", None)  # flash would read packing from them: the boundaries say it
    given = (raytrain_masks is not None or varlen) if not flash else ("cu_seq_lens_q" in kwargs)
    if not given and split is not None:
        raise RuntimeError(
            "sequence-parallel attention was called without the micro-batch's document "
            "boundaries: call the model with `attention.model_kwargs(...)` (objectives.forward does)"
        )
    # Multi-head attention without grouped keys (GPT-NeoX, Phi-2) has no num_key_value_groups: one group
    groups = getattr(module, "num_key_value_groups", 1)
    if split is not None:
        query, key, value, groups = split.gather_positions(query, key, value, groups)
    window = kwargs.get("sliding_window")  # this layer's; one as long as the rows cuts nothing
    window = window if window is not None and window < query.shape[2] else None
    if varlen:
        out = kernels.varlen_attention(
            query,
            key,
            value,
            cu=kwargs["cu_seq_lens_q"],
            longest=kwargs["max_length_q"],
            groups=groups,
            window=window,
            scale=kwargs.get("scaling"),
        )
        return (split.scatter_positions(out) if split is not None else out), None
    mask = None
    if not flash:
        if not given:  # a plain forward (an exported or loaded model outside training): each row one
            # document. Training never comes here: objectives.staged gives every forward its boundaries.
            one_each = Boundaries(
                torch.zeros(query.shape[0], query.shape[2], dtype=torch.long, device=query.device), False
            )
            raytrain_masks = model_kwargs(one_each, inner, (window,), query.device, query.dtype, on_device=True)[
                "raytrain_masks"
            ]
        mask = raytrain_masks.get(window)
        if mask is None and (inner == "eager" or window is not None):
            raise RuntimeError(f"no mask for window {window} (masks.windows disagrees with the model's layers)")
    function, config = _inner_function(module, inner), module.config
    # transformers' flash integration loads its kernels by the name in the layer's config: the inner
    # one's for the call (the config is the model's, shared by its layers; forwards run one at a time)
    with (
        _key_value_groups(module, groups),
        _masked_kernels(mask, query.device),
        private_apis.attn_implementation_as(config, inner) if flash else contextlib.nullcontext(),
    ):
        out, _ = function(module, query, key, value, mask, **kwargs)
    if split is not None:
        out = split.scatter_positions(out)
    return out, None


@contextlib.contextmanager
def _key_value_groups(module, groups: int):
    """The layer's key/value groups as this call sees them (Ulysses' exchange can change how many
    heads a rank holds), put back after; a layer without the attribute keeps none when it is 1."""
    had = hasattr(module, "num_key_value_groups")
    saved = getattr(module, "num_key_value_groups", 1)
    if not had and groups == 1:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        if had:
            module.num_key_value_groups = saved
        else:
            del module.num_key_value_groups


def _masked_kernels(mask, device: torch.device):
    """SDPA with a mask tensor (packed rows, sliding windows) on CUDA: any kernel but cuDNN's. Its
    backward returns NaN gradients with an explicit mask on Hopper (pytorch#196678, the default
    backend there since torch 2.11 with cuDNN <= 9.25; TRL #7181 hit it in DPO). Seen here: a
    1B model's bf16 LoRA and full steps under fsdp2 and zero3 went NaN at step 3 of packed 4k rows on
    an H100 (torch 2.11). Unmasked rows (is_causal) keep every kernel: that path is clean."""
    if mask is None or device.type != "cuda":  # (eager calls no SDPA: the context is idle there)
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _inner_function(module, inner: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":  # each model's own, in its modeling module
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]
