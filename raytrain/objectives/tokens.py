"""The token-level pieces every objective uses: a micro-batch staged on the device, the forward
that gives its logits (or, under `training.chunked_loss`, its hidden states and the output layer),
per-token cross-entropy and per-sequence log-probs; and SFT, the next-token objective."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from raytrain.data import IGNORE
from raytrain.model import attention
from raytrain.objectives import router
from raytrain.objectives.base import Objective
from raytrain.strategies import vocab_parallel


@dataclass
class Hidden:
    """What a forward gives under `training.chunked_loss`: the last hidden states and the output
    layer, which the loss applies a chunk of tokens at a time."""

    states: torch.Tensor
    head: torch.nn.Module
    chunk: int  # tokens a chunk of raytrain's own (0 where `fused` does the chunking)
    autocast: Callable  # the strategy's compute precision, which the output layer runs in as in the model
    fused: Callable | None = None  # Liger's fused linear cross-entropy (kernels.fused_loss), or None


def token_loss(out: torch.Tensor | Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over the labelled tokens; `targets` are the labels shifted by one
    (`targets_of`), aligned with `out`'s positions."""
    if isinstance(out, Hidden):
        return chunked_cross_entropy(out, targets).sum()
    return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def sequence_logps(out: torch.Tensor | Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Per sequence: the summed log-probability of its labelled tokens (of this rank's part of it
    under sequence parallelism). Cross-entropy per token rather than a log-softmax over the
    vocabulary: one fp32 copy of the logits, not two."""
    if isinstance(out, Hidden):
        return -chunked_cross_entropy(out, targets).sum(-1)
    return (
        -F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
        .view(targets.shape)
        .sum(-1)
    )


def targets_of(labels: torch.Tensor) -> torch.Tensor:
    """The next token's label at each position (IGNORE at the last): position t predicts label t+1.
    Shifted before a sequence is split over ranks, so a part's last position is scored against the
    next part's first label."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def chunked_cross_entropy(out: Hidden, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token cross-entropy of logits / temperature (0 where unlabelled), `out.chunk` tokens at a
    time. Each chunk's logits are recomputed in backward (a checkpoint), so at most one chunk's exist
    at once: at a 128k vocabulary a 4k-token sequence's fp32 logits and their gradient are 4 GiB, a
    chunk 256 MiB. The temperature divides the fp32 logits, as TRL's does (not the hidden states:
    an output layer with a bias is no scale of its input)."""
    states, labels = out.states.flatten(0, 1), targets.flatten()
    weight, bias = out.head.weight, out.head.bias
    if out.fused is not None and temperature == 1.0:  # Liger's kernel: its own chunks and recomputation
        with out.autocast():
            return (
                out.fused(states, weight, labels, bias, ignore_index=IGNORE, reduction="none")
                .float()
                .view(targets.shape)
            )
    with out.autocast():  # recorded by each checkpoint and restored when backward recomputes it
        parts = [
            checkpoint(
                _chunk_cross_entropy,
                states[i : i + out.chunk],
                weight,
                bias,
                labels[i : i + out.chunk],
                temperature,
                use_reentrant=False,
            )
            for i in range(0, len(labels), out.chunk)
        ]
    return torch.cat(parts).view(targets.shape)


def _chunk_cross_entropy(states, weight, bias, labels, temperature: float = 1.0) -> torch.Tensor:
    logits = F.linear(states, weight, bias).float()
    return F.cross_entropy(
        logits / temperature if temperature != 1.0 else logits, labels, ignore_index=IGNORE, reduction="none"
    )


class SFT(Objective):
    """Next-token cross-entropy, the token mean over the global batch."""

    def units(self, mb: dict) -> int:
        return int((mb["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out, targets = forward(strategy, strategy.model, mb)
        return token_loss(out, targets), []  # a sequence part's share: the parts' losses add up


def real_pairs(mb: dict) -> torch.Tensor:
    chosen_labels = mb["labels"][: len(mb["labels"]) // 2, 1:]
    return (chosen_labels != IGNORE).any(-1)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP's and peft's wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward(strategy, model, mb: dict) -> tuple[torch.Tensor | Hidden, torch.Tensor]:
    """(logits, or under `training.chunked_loss` the last hidden states with the output layer; the
    targets they are scored against) of a micro-batch. Packed documents attend only to themselves
    (attention.py, told by `staged`). Under sequence parallelism: this rank's part of each sequence."""
    chunk, head = strategy.loss_chunk, getattr(model, "module", model).get_output_embeddings()  # (DDP's wrapper)
    x, split, fused = staged(strategy, mb), strategy.sequence, strategy.fused_loss
    if isinstance(fused, vocab_parallel.Loss):  # the split table's collectives, sized on the host (no all-gather)
        fused = fused.sized(x.get("most"))
    # The output layer returns its input for this call: the model's output is its hidden states.
    with (
        strategy.autocast(),
        replaced_forward(head, _identity) if chunk or fused else contextlib.nullcontext(),
        vocab_parallel.sized_lookup(model, x.get("most")),
    ):
        out = model(input_ids=x["input_ids"], position_ids=x["position_ids"], **x["attention"], **routed(strategy))
    balance(strategy, out, x)
    # The output layer is used after the model's forward: FSDP2 keeps the root's parameters (the
    # output layer's among them) gathered from its forward to its backward, so this is the same weight.
    logits, targets = out.logits, x["targets"]
    if split is None or split.rank == split.size - 1:  # a sequence's last position predicts nothing: its
        logits, targets = logits[:, :-1], targets[:, :-1]  # sums then add exactly the terms they always did
    return (Hidden(logits, head, chunk, strategy.autocast, fused) if chunk or fused else logits), targets


def routed(strategy) -> dict:
    """The model's keyword for its router's logits, where this forward trains the policy of a job with a
    balancing loss (router.py): grad enabled; references, KL rows and evaluation run under no_grad."""
    return {"output_router_logits": True} if strategy.router_aux_coef and torch.is_grad_enabled() else {}


def balance(strategy, out, x: dict) -> None:
    """This micro-batch's Σ T_r·aux_r (router.balance_sum), kept in its staged copies for the loop."""
    if getattr(out, "router_logits", None) is not None and "row_tokens" in x:
        split = strategy.sequence
        x["aux"] = x.get("aux", 0) + router.balance_sum(
            out.router_logits, x["real_tokens"], x["row_tokens"], strategy.router_top_k, split.group if split else None
        )


def aux_tokens(strategy, mb: dict) -> int:
    """The micro-batch's real tokens (router.real_tokens), whole sequences: the balancing loss's units."""
    return int(router.real_tokens(mb["input_ids"], mb["labels"], pad_id(strategy, mb)).sum())  # host: host rows


def pad_id(strategy, mb: dict) -> int | None:
    """The pad id the rows were padded with: the store's (micro_batches puts it in), else the model's."""
    if "pad_id" in mb:
        return mb["pad_id"]
    return unwrapped(strategy.model).config.get_text_config().pad_token_id


def staged(strategy, mb: dict) -> dict:
    """The micro-batch on the strategy's device, made once for all its forward passes (DPO's
    reference reuses it): this rank's part of its ids, positions and shifted labels, its pairs'
    token counts, and its attention boundaries (from the whole rows' host positions, `masks.py`).
    Every copy is from pinned memory and asynchronous: nothing here waits for the device.
    The loop stages the next micro-batch while this one's backward runs and drops each after it."""
    if "_staged" in mb:
        return mb["_staged"]
    device, split = strategy.device, strategy.sequence
    ids, positions, targets = mb["input_ids"], mb["position_ids"], targets_of(mb["labels"])
    boundaries = attention.Boundaries.of(positions)  # whole rows: under sp too
    compute = torch.bfloat16 if strategy.compute_bf16 else torch.float32
    out = {
        "attention": attention.model_kwargs(
            boundaries, strategy.attention_kernel, strategy.attention_windows, device, compute
        )
    }
    if strategy.spec.unpaired:  # KTO's labels and real rows (`_split_kto`)
        out["label"], out["real"] = attention.to_device(mb["label"], device), attention.to_device(mb["real"], device)
    elif strategy.spec.preference:  # whole sequences' counts (targets before the split)
        out["counts"] = attention.to_device((targets != IGNORE).sum(-1), device)
        out["real"] = attention.to_device(real_pairs(mb).float(), device)
    if strategy.spec.scores:  # the token a reward model scores: transformers' rule, the last that is not padding
        pad = unwrapped(strategy.model).config.get_text_config().pad_token_id
        last = (torch.arange(ids.shape[1]) * (ids != pad)).argmax(-1)
        n = ids.shape[1] // (split.size if split else 1)  # this rank's positions: [first, first + n)
        first = n * split.rank if split else 0
        out["last"] = attention.to_device((last - first).clamp(0, n - 1), device)
        out["here"] = attention.to_device(((last >= first) & (last < first + n)).float(), device)
        out["margin"] = attention.to_device(mb["margin"], device)  # the pairs' (objectives.pairs.split_margins)
    if strategy.router_aux_coef:  # the balancing loss's tokens: real ones, whole sequences' counts
        real = router.real_tokens(ids, mb["labels"], pad_id(strategy, mb))
        out["row_tokens"] = attention.to_device(real.sum(-1).float(), device)
        out["real_tokens"] = attention.to_device((split.part(real) if split else real).float(), device)
    if split:
        ids, positions, targets = split.part(ids), split.part(positions), split.part(targets)
    if "most_sequences" in mb:  # the most tokens any rank's forward (and loss) of this micro-batch holds
        out["most"] = mb["most_sequences"] * ids.shape[1]
    out.update(
        input_ids=attention.to_device(ids, device),
        position_ids=attention.to_device(positions, device),
        targets=attention.to_device(targets, device),
    )
    mb["_staged"] = out
    return out


def unstage(mb: dict) -> None:
    """Drop a micro-batch's device copies (its masks are b x s x s)."""
    mb.pop("_staged", None)


@contextlib.contextmanager
def replaced_forward(module: torch.nn.Module, forward: Callable):
    """`module` computes `forward` for the calls inside (an instance attribute shadows the class's
    method; the module's hooks, FSDP2's and ZeRO-3's gathers among them, still run around it)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
