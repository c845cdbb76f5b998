"""flash-attn's kernels in plain torch, for machines without a GPU: `flash_attention_2` runs here
through transformers' own integration (`integrations/flash_attention.py`, its kwargs processing,
its varlen and window handling) with only the CUDA kernels replaced.

`flash_attn_varlen_func` and `flash_attn_func` take flash-attn 2's arguments (cu_seqlens,
max_seqlen, causal, window_size, softcap) and compute the same attention in fp32 with the same
conventions: rows of `q` are tokens of sequences laid end to end, sequence i spanning
cu_seqlens[i]:cu_seqlens[i+1]; `causal` aligns a query with the key of the same index; a window
(left, right) lets query t see keys t-left..t+right (-1: unbounded). So a test that uses
`flash_attention_2` on a GPU passes the same kwargs to the same transformers code here.

`install()` makes transformers load flash_attention_2 models on this CPU and resolve its flash
kernels to these: two private transformers seams (the flash availability check, the loaded kernel
cache), checked against the transformers version they were written for.
"""

from __future__ import annotations

import torch

WRITTEN_FOR = "5."  # transformers' major version whose private seams install() sets
_UNINSTALLED = {}  # what install() replaced, for uninstall()


BLOCK = 256  # queries a block: like flash-attn, no s x s score matrix is kept (each block recomputed in backward)


def _attention(q, k, v, scale, causal, window, softcap):
    """One sequence: q [t, h, d], k/v [t, hk, d] -> [t, h, d], a block of queries at a time."""
    from torch.utils.checkpoint import checkpoint

    h, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
    offset = k.shape[0] - q.shape[0]  # bottom-right alignment, as flash-attn's causal
    blocks = [
        checkpoint(_block, q[a : a + BLOCK], k, v, a + offset, scale, causal, window, softcap, use_reentrant=False)
        for a in range(0, q.shape[0], BLOCK)
    ]
    return torch.cat(blocks) if blocks else q.new_empty(q.shape)


def _block(q, k, v, first, scale, causal, window, softcap):
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    tq, tk = q.shape[0], k.shape[0]
    back = torch.arange(tq)[:, None] + first - torch.arange(tk)[None, :]  # query index - key index
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed &= back >= 0
    left, right = window
    if left >= 0:
        allowed &= back <= left
    if right >= 0:
        allowed &= -back <= right
    scores = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", scores, v.float()).to(q.dtype)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    if dropout_p:
        raise NotImplementedError("the reference kernel has no dropout (raytrain trains attention without it)")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert len(cq) == len(ck) and cq[-1] == q.shape[0] and ck[-1] == k.shape[0], (cq, ck, q.shape, k.shape)
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_seqlen_q, "max_seqlen_q below a segment's length"
    out = torch.empty_like(q)
    for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]):
        out[a:b] = _attention(q[a:b], k[c:d], v[c:d], scale, causal, tuple(window_size), softcap)
    return out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    b, s = q.shape[:2]
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    return flash_attn_varlen_func(*flat, cu, cu, s, s, dropout_p, softmax_scale, causal, window_size, softcap).view(
        q.shape
    )


def _opaque(function):
    """Outside compiled graphs, as torch's kernel is (a custom op dynamo does not trace into): traced,
    the reference's per-segment loop reads the boundaries' values, and a second compile of the same
    blocks (a restored strategy in this process) specializes them otherwise, off in the last bit."""
    import torch

    return torch.compiler.disable(function)


@_opaque
def torch_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch's `torch.nn.attention.varlen.varlen_attn` (torch 2.13's signature) on the same reference:
    a window (left, right) as flash's, (-1, 0) causal; fewer key heads only with enable_gqa, as torch's."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError(f"varlen_attn: {query.shape[1]} query heads and {key.shape[1]} key heads need enable_gqa")
    if return_aux is not None or seqused_k is not None or block_table is not None:
        raise NotImplementedError("the reference varlen_attn trains; it has no aux outputs nor a paged cache")
    return flash_attn_varlen_func(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale, window_size=window_size
    )


def install_torch_varlen(on: bool = True) -> None:
    """sdpa on this CPU (fp32) through raytrain's varlen path, as on a GPU (kernels.VARLEN); off: masks."""
    import torch

    from raytrain.model import kernels

    if on:
        kernels.VARLEN["cpu"] = kernels.kernel(torch_varlen_attn, (torch.float32, torch.bfloat16))
    else:
        kernels.VARLEN.pop("cpu", None)


def install() -> None:
    """flash_attention_2 on this CPU, through transformers' integration and these kernels."""
    import transformers
    from transformers import modeling_flash_attention_utils as fa
    from transformers.modeling_utils import PreTrainedModel

    if not transformers.__version__.startswith(WRITTEN_FOR):
        raise RuntimeError(
            f"tests/varlen.py sets private seams of transformers {WRITTEN_FOR}x, not "
            f"{transformers.__version__}: check _flash_attn_can_dispatch and lazy_import_flash_attention"
        )
    _UNINSTALLED.setdefault("dispatch", PreTrainedModel._flash_attn_can_dispatch)
    PreTrainedModel._flash_attn_can_dispatch = lambda self, *args, **kwargs: True
    fa._loaded_implementation = "flash_attention_2"
    fa._flash_fn, fa._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    fa._flash_with_kvcache_fn, fa._pad_fn, fa._unpad_fn = None, fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)
    fa._process_with_kvcache_kwargs_fn = dict


def dispatch_check():
    """transformers' own check that flash-attn is on this machine (what install() replaced)."""
    from transformers.modeling_utils import PreTrainedModel

    return _UNINSTALLED.get("dispatch", PreTrainedModel._flash_attn_can_dispatch)
