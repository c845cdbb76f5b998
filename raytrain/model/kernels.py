"""Which kernels a worker runs where the job leaves the choice to raytrain: the attention's, and the
loss's.

`model.attn_implementation: sdpa` (the default) on packed rows or a sliding window used to give sdpa a
boolean b x s x s mask, and a mask sends it to the memory-efficient kernel, never flash. torch has
its own varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`): documents laid end to end,
told by the same `cu_seq_lens` flash_attention_2 gets (attention.Boundaries.varlen), no mask, a
window as flash's (left, 0). It runs on CUDA in 16 bits on Ampere and newer; `attention_kernel`
picks it there when the model asks nothing flash lacks (masks.sdpa_varlen, the rule the memory
estimate reads too), and names the choice for the start-up line.

`VARLEN` holds the kernel by device type, with the compute dtypes it takes. "cuda" is torch's;
tests/varlen.py adds a reference in plain torch for "cpu" (fp32), so the combination test runs this
path on CPU as a GPU would, through the same calls. The kernel is resolved once, at setup, where the
worker picks its attention (`attention_kernel`: the import, the signature, the device's capability),
into `BOUND`; each attention call reads that plain dict, so a compiled block traces no lookup (a
`functools.cache` wrapper, `inspect.signature` or `get_device_capability` in the graph would break it).

The loss: where liger-kernel (LIGER_FLOOR or later) is installed on CUDA workers, its fused linear
cross-entropy applies the output layer and the per-token loss a chunk of tokens at a time in one kernel
(no logits kept: Liger's reported +20% throughput, -60% memory on Llama-3-8B); else raytrain's own
(objectives/tokens.py: whole logits, or chunks under training.chunked_loss). raytrain calls it with
`reduction="none"`, and before 0.8.2 its backward scaled every row's gradient by the first row's
(liger-kernel 9ac26bb8): SFT's upstream gradient is uniform and survived, DPO's, KTO's and SimPO's
got wrong gradients with no error. An older liger-kernel is not used, and the kernel line says so.

The blocks: compiled (training.compile, auto on GPU where it applies), inductor fuses each block's
norms, SwiGLU and rotary embedding itself. Where they stay eager on CUDA (zero3, sequence
parallelism, GRPO, QLoRA, `compile: false`), Liger's RMSNorm, SwiGLU and RoPE kernels take those
ops when liger-kernel is installed, through Liger's own per-family patch of the model instance
(`block_kernels`); not under tensor parallelism, whose norms are DTensors a Triton kernel cannot take.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from raytrain.job import masks, strategies

VARLEN_NAME = "sdpa varlen"  # the kernel's name in the start-up line and `attention_kernel`'s answer
LIGER_BLOCKS = "Liger's RMSNorm, SwiGLU and RoPE"  # their name in the start-up line


@dataclass(frozen=True)
class Kernel:
    function: Callable  # varlen_attn's calling convention (query [t, h, d], ..., cu_seq_q, cu_seq_k, max_q, max_k)
    dtypes: tuple[torch.dtype, ...]
    keywords: frozenset  # the keyword arguments it takes of window_size, enable_gqa, scale (torch's grew them)


VARLEN: dict[str, Kernel] = {}
BOUND: dict[str, Kernel] = {}  # the kernel `attention_kernel` chose, by device type: what each call runs
LIGER_FLOOR = "0.8.2"  # the first liger-kernel whose fused loss takes reduction="none" rightly


def kernel(function: Callable, dtypes: tuple[torch.dtype, ...]) -> Kernel:
    return Kernel(
        function, dtypes, frozenset(inspect.signature(function).parameters) & {"window_size", "enable_gqa", "scale"}
    )


@functools.cache
def _torch_cuda_kernel() -> Kernel | None:
    """torch's varlen flash kernel, where this torch has it in a form that trains causally (a
    window_size argument: (-1, 0) is causal) and the GPU runs flash (sm80+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    found = kernel(varlen_attn, (torch.bfloat16, torch.float16))
    if "window_size" not in found.keywords or torch.cuda.get_device_capability()[0] < 8:
        return None
    return found


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """The varlen kernel for `device` in compute `dtype`, or None."""
    found = VARLEN.get(device.type) or (_torch_cuda_kernel() if device.type == "cuda" else None)
    return found if found is not None and dtype in found.dtypes else None


def attention_kernel(
    implementation: str, device: torch.device, dtype: torch.dtype, config: dict, windows: tuple[int | None, ...]
) -> str:
    """The kernel a worker's attention runs: VARLEN_NAME where sdpa can take torch's varlen kernel
    here (masks.sdpa_varlen), else `implementation` (with its masks where masks.py needs them)."""
    found = varlen_kernel(device, dtype)
    fits = (
        found is not None
        and (windows == (None,) or "window_size" in found.keywords)
        and ("scale" in found.keywords or not config.get("query_pre_attn_scalar"))
    )
    if not masks.sdpa_varlen(implementation, fits, config):
        return implementation
    BOUND[device.type] = found  # resolved here, once: varlen_attention reads it
    return VARLEN_NAME


def varlen_attention(
    query, key, value, *, cu: torch.Tensor, longest: int, groups: int, window: int | None, scale: float | None
) -> torch.Tensor:
    """[b, h, s, d] query (key/value [b, h / groups, s, d]) in, [b, s, h, d] out: the rows laid end to
    end as one sequence, each document its own segment; a window W as masks.py counts it (a key fewer
    than W positions back), flash's left bound W - 1."""
    b, h, s, d = query.shape
    found = BOUND[query.device.type]  # a plain read: resolved at setup (attention_kernel), never looked up here
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    keywords = {"window_size": (-1 if window is None else window - 1, 0)}
    if "enable_gqa" in found.keywords:
        keywords["enable_gqa"] = groups > 1
    elif groups > 1:  # an earlier torch: every query head its own key/value copy
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if scale is not None and "scale" in found.keywords:
        keywords["scale"] = scale
    out = found.function(q, k, v, cu, cu, longest, longest, **keywords)
    return out.view(b, s, h, d)


def liger_fused_allowed(version: str) -> bool:
    """Whether this liger-kernel's fused linear cross-entropy takes reduction="none" rightly (LIGER_FLOOR)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(LIGER_FLOOR)
    except InvalidVersion:
        return False


def _liger_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return None


def _fused_applies(spec, device: torch.device) -> bool:
    t = spec.training
    return not (
        device.type != "cuda"
        or t.chunked_loss != "auto"
        or not strategies.of(spec).head_after_forward
        or spec.scaling.tensor_parallel > 1
        or spec.scores
        or spec.rl
    )


def fused_loss(spec, device: torch.device) -> Callable | None:
    """Liger's `liger_fused_linear_cross_entropy`, or None (raytrain's own loss). Taken under training.chunked_loss auto
    (true or a number asks for raytrain's chunks) where the output layer is whole at the loss (fsdp2 or ddp without
    tensor parallelism: objectives/tokens.py applies it after the forward; where fsdp2 split a frozen one by rows,
    strategies/vocab_parallel.py's loss runs) and the objective scores vocabulary logits at temperature 1 (not a reward
    model's one score, not GRPO's tempered log-probs), from liger-kernel LIGER_FLOOR on (`fused_loss_note`)."""
    if not _fused_applies(spec, device) or not liger_fused_allowed(_liger_version() or "0"):
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def fused_loss_note(spec, device: torch.device, version: str | None = None) -> str:
    """For the kernel line: why Liger's fused loss does not run where it would (an installed
    liger-kernel older than LIGER_FLOOR), else ""."""
    version = version if version is not None else _liger_version()
    if version is None or not _fused_applies(spec, device) or liger_fused_allowed(version):
        return ""
    return (
        f"raytrain's, not Liger's fused one: liger-kernel {version} predates {LIGER_FLOOR}, whose backward scales "
        'each row\'s gradient rightly under reduction="none"'
    )


def liger_blocks_apply(spec, device: torch.device, compiled: bool) -> bool:
    """Whether Liger's block kernels may replace the model's own (`block_kernels`): on CUDA, blocks
    eager (compiled ones get the same fusions from inductor), no tensor parallelism."""
    return device.type == "cuda" and not compiled and spec.scaling.tensor_parallel == 1


def block_kernels(spec, device: torch.device, compiled: bool, model: torch.nn.Module) -> str | None:
    """Put Liger's RMSNorm, SwiGLU and RoPE into `model`'s blocks where `liger_blocks_apply` allows,
    liger-kernel imports and has a patch for the model's family; returns their name, or None.
    Liger's `apply_liger_kernel_to_<family>(model=...)` rebinds the norms' and MLPs' forward on the
    instance (their weights stay where FSDP2, DDP or ZeRO-3 put them) and the family's rotary
    function in its modeling module (the whole worker process: the reference model too). Its loss
    patches stay off: the objective applies the output layer itself (objectives/tokens.py)."""
    if not liger_blocks_apply(spec, device, compiled):
        return None
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper: the HF model
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(getattr(base.config, "model_type", None))
    if apply is None:
        return None
    takes = inspect.signature(apply).parameters
    apply(model=base, **{k: False for k in ("cross_entropy", "fused_linear_cross_entropy") if k in takes})
    return LIGER_BLOCKS
