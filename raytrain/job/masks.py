"""Which tokens a token attends to, and what each attention implementation is told of it: the one
rule, read by the model path (attention.py, with or without Ulysses) and by the memory estimate.
Torch-free, so pre-flight uses it without importing torch.

Documents. A row's first token starts a document, and so does every token whose position does not
step by one from the token before it. The token store writes each document's positions from 0,
continues a document that a row cut off at its end from where it stopped (so a row may start
mid-document), and continues the last document's positions over the padding, so padding is never a
document of its own: an unpacked or preference row is one document, whatever its padding.

Attention. A token attends to itself and the earlier tokens of its own document; in a layer with a
sliding window W, only to those fewer than W positions back (transformers' `sliding_window`, as
Mistral and Gemma's local layers and Qwen2's windowed layers set it).

What each implementation is given, built by raytrain from the host rows once per micro-batch and
passed to the model (transformers never infers it):
- flash_attention_2: varlen boundaries, the micro-batch's rows flattened into one sequence
  (`cu_seq_lens_q/k`, `max_length_q/k`), and each layer's window; no mask.
- sdpa: on CUDA in 16 bits (where torch's varlen flash kernel runs: `sdpa_varlen`), the varlen
  boundaries as flash is given them, and no mask; elsewhere nothing where every row is one document
  and no window is shorter than a row (its causal kernel), otherwise a boolean b x s x s mask for
  each window the model's layers use.
- eager: an additive mask for each window, always (its kernel is not causal by itself).
"""

from __future__ import annotations

IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def windows(config: dict, seq_len: int) -> tuple[int | None, ...]:
    """The distinct windows the model's layers attend within (None: the whole document), counting
    only windows shorter than a row (a longer one cuts nothing). From config.json."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or window >= seq_len:
        return (None,)
    layer_types = config.get("layer_types")
    if layer_types:  # Gemma 2/3, Qwen2 and most newer configs name each layer's kind
        return tuple(
            sorted(
                {window if kind == "sliding_attention" else None for kind in layer_types},
                key=lambda w: -1 if w is None else w,
            )
        )
    if config.get("use_sliding_window") is False:  # older Qwen2 configs: the window is off
        return (None,)
    return (window,)  # Mistral: every layer


def attention_shape(config: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a model's config.json, under Llama's key names or GPT-2's."""

    def first(*keys: str) -> int:
        return next((config[k] for k in keys if isinstance(config.get(k), int)), 0)

    heads = first("num_attention_heads", "n_head") or 1
    head_dim = first("head_dim") or first("hidden_size", "n_embd", "d_model") // heads
    return first("num_hidden_layers", "n_layer", "num_layers"), first("num_key_value_heads") or heads, head_dim


def sdpa_varlen(implementation: str, kernel_runs: bool, config: dict) -> bool:
    """sdpa runs torch's varlen flash kernel (`torch.nn.attention.varlen`), told the boundaries as
    flash_attention_2 is and given no mask: where the kernel runs for the workers' device and compute
    dtype (`kernel_runs`: kernels.py knows; CUDA in 16 bits), and the model asks nothing of attention
    that flash lacks: a head size flash takes (a multiple of 8 up to 256), no logit softcap (Gemma 2),
    no attention dropout. Without it, sdpa with a boolean mask falls to the memory-efficient kernel."""
    head_dim = attention_shape(config)[2]
    return (
        implementation == "sdpa"
        and kernel_runs
        and 0 < head_dim <= 256
        and head_dim % 8 == 0
        and not config.get("attn_logit_softcapping")
        and not config.get("attention_dropout")
    )


def mask_windows(
    implementation: str, packed: bool, windows_: tuple[int | None, ...], varlen: bool = False
) -> tuple[int | None, ...]:
    """The windows a mask is built for (one b x s x s mask each): none for flash (varlen boundaries
    and its window argument) nor for sdpa on torch's varlen kernel (`varlen`, the same), every one
    for eager, and for sdpa those its causal kernel alone would get wrong (a row of several
    documents, or a window)."""
    if implementation.startswith("flash") or varlen:
        return ()
    if implementation == "eager" or packed:
        return windows_
    return tuple(w for w in windows_ if w is not None)


def mask_element_bytes(implementation: str, compute_bytes: int) -> int:
    """A mask element: sdpa takes a boolean mask, eager adds one in the compute dtype."""
    return compute_bytes if implementation == "eager" else 1
