"""Rollouts on the training workers: the policy's own forward with a KV cache, and a sampler whose
randomness is a pure function of (seed, step, prompt, generation, position).

Each token is drawn by inverse transform: one uniform a completion a position, from a
counter-based hash (lowbias32) of the completion's key and the position, not from torch's global
generator, against the cumulative softmax of logits / temperature (top_p-filtered first, as
transformers' TopPLogitsWarper). So a completion depends on its own key and the policy only: the
same whatever the micro-batch it shares, the worker count, or a restart (a resumed step k samples
what the uninterrupted run sampled), and alike on CPU and GPU. (The first cut, Gumbel-max over
hashed noise, hashed every vocabulary entry at every token.)

Every rank runs the same number of forwards (FSDP2 and ZeRO-3 gather each layer in a collective):
ranks agree every `CHECK` tokens whether all their completions have ended."""

from __future__ import annotations

import hashlib

import torch

from raytrain import private_apis

CHECK = 8  # tokens between the ranks' "all ended?" agreement: at most CHECK - 1 idle forwards
M32 = 0xFFFFFFFF


def completion_key(seed: int, step: int, row: tuple, generation: int) -> int:
    """The key of one completion: (seed, step, the prompt's (source, epoch, row), its index)."""
    text = f"{seed}/{step}/{'/'.join(map(str, row))}/{generation}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


def _mul(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for 0 <= x < 2**32 in int64, without overflowing it: c's top bit apart."""
    return (x * (c & 0x7FFFFFFF) + ((x & 1) << 31) * (c >> 31)) & M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit integer hash with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, t: int) -> torch.Tensor:
    """One uniform in (0, 1) a completion (its key) at position t, float64."""
    h = _mix(_mix((keys + _mul(torch.full_like(keys, t + 1), 0x9E3779B1)) & M32) ^ 0x5BD1E995)
    return (h.double() + 0.5) / 2.0**32


def sample(logits: torch.Tensor, keys: torch.Tensor, t: int, temperature: float, top_p: float) -> torch.Tensor:
    """The next token of each row: inverse transform of the softmax of logits / temperature (top_p-filtered)."""
    probs = (logits.float() / temperature).double().softmax(-1)
    if top_p < 1.0:
        ordered, index = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(-1) - ordered >= top_p  # the tokens after the smallest set reaching top_p
        probs = probs.scatter(-1, index, ordered.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)
    u = uniforms(keys, t) * cdf[:, -1]  # the kept mass (1 without top_p)
    return torch.searchsorted(cdf, u[:, None], right=True).clamp(max=cdf.shape[-1] - 1).squeeze(-1)


def native_attention(strategy):
    """transformers' own attention for the rollout (its masks handle left padding and the cache);
    raytrain's (attention.py) is for whole training rows."""
    return private_apis.attn_implementation_as(strategy.hf_model.config, strategy.spec.model.attn_implementation)


def _all_ended(ended: torch.Tensor) -> bool:
    flag = (~ended).any().double().view(1)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0  # host: the rollout's agreement every CHECK tokens


@torch.no_grad()
def rollout(
    strategy,
    prompts: list[list[int]],
    keys: list[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    eos: set[int],
    pad: int,
    budgets: list[int] | None = None,
) -> list[list[int]]:
    """Each prompt's completion (its tokens up to and including the first end token, at most
    `max_tokens`, or its own budget where `budgets` gives one: an episode's later turn), sampled by
    the strategy's model (gathered once: `strategy.gathered`). `max_tokens` bounds the loop on every
    rank alike (the ranks agree on its end); a row at its budget ends as at an end token."""
    device, model = strategy.device, strategy.model
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends where decoding starts
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ids, mask, keys_t = ids.to(device), mask.to(device), torch.tensor(keys, dtype=torch.long, device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    out = torch.full((len(prompts), max_tokens), pad, dtype=torch.long, device=device)
    limit = torch.tensor(budgets, device=device) if budgets is not None else None  # a single turn's is max_tokens
    ended = limit <= 0 if limit is not None else torch.zeros(len(prompts), dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()  # no dropout while sampling
    try:
        with native_attention(strategy), strategy.gathered(), strategy.autocast():
            step = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
            last = positions[:, -1]
            steps = 0
            for t in range(max_tokens):
                token = torch.where(ended, pad, sample(step.logits[:, -1], keys_t, t, temperature, top_p))
                out[:, t] = token
                ended = ended | torch.isin(token, eos_t)
                if limit is not None:
                    ended = ended | (limit <= t + 1)
                steps = t + 1
                if t + 1 == max_tokens or ((t + 1) % CHECK == 0 and _all_ended(ended)):
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # an ended row's pads: never read
                last = last + 1
                step = model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=last[:, None],
                    past_key_values=step.past_key_values,
                    use_cache=True,
                    logits_to_keep=1,
                )
    finally:
        model.train(was_training)
    completions = []
    for row, budget in zip(out[:, :steps].tolist(), budgets or [max_tokens] * len(prompts)):  # host: the completions
        n = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        completions.append(row[: min(n, max(budget, 0))])
    return completions
