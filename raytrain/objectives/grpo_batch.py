"""What a GRPO step's rollout becomes (objectives/grpo.py): each micro-batch's training rows, the
rollout metrics under TRL's names and the samples each checkpoint logs (the metrics are functions of
the step's global batch: every rank computes the same from the gathered scores)."""

from __future__ import annotations

import torch

from raytrain.data import IGNORE
from raytrain.rl.losses import nanstd, units_of


def rollout_metrics(rewards, scores, summed, zero_std, flat, gen_s: float, reward_s: float, generated: int) -> dict:
    """`flat`: each completion of the global batch as (scores, its model-written tokens (TRL's
    tool_mask: an episode's tool results not counted), whether it ended, ...)."""
    lengths = torch.tensor([x[1] for x in flat], dtype=torch.float64)
    ended = torch.tensor([x[2] for x in flat], dtype=torch.bool)
    means = [torch.nanmean(scores[:, i]).item() for i in range(len(rewards))]  # host: CPU tensors
    stds = [nanstd(scores[:, i]).item() for i in range(len(rewards))]  # host: CPU tensors
    host = {f"rewards/{r.name}/mean": m for r, m in zip(rewards, means)}
    host.update({f"rewards/{r.name}/std": sd for r, sd in zip(rewards, stds)})
    host.update(
        {
            "reward": torch.nanmean(summed).item(),  # host: CPU tensors
            "reward_std": nanstd(summed).item(),  # host: CPU tensors
            "frac_reward_zero_std": zero_std.double().mean().item(),  # host: CPU tensor
            "completions/mean_length": lengths.mean().item(),  # host: CPU tensors and Python numbers
            "completions/min_length": lengths.min().item(),  # host: CPU
            "completions/max_length": lengths.max().item(),  # host: CPU tensor
            "completions/clipped_ratio": 1 - ended.double().mean().item(),  # host: CPU tensor
            "completions/mean_terminated_length": lengths[ended].mean().item() if ended.any() else 0.0,  # host: CPU
            "time/generation_s": gen_s,
            "time/reward_s": reward_s,
            "generation_tokens_per_s": generated / gen_s if gen_s else 0.0,
        }
    )
    return host


def sample_rows(tok, g, step: int, rewards, made) -> list[dict]:
    """A few (prompt, completion, each reward) of this rank's step, for the checkpoint's table."""
    out = []
    for _, asked, completions, scores in made:
        for p, c, s in list(zip(asked, completions, scores))[: max(0, g.samples_per_checkpoint - len(out))]:
            out.append(
                {
                    "step": step + 1,
                    "prompt": tok.decode(p),
                    "completion": tok.decode(c, skip_special_tokens=True),
                    **{f"reward/{r.name}": v for r, v in zip(rewards, s)},
                }
            )
    return out


def training_rows(objective, mb: dict, asked, completions, adv: list[float], real: int, engine_logps, masks=None):
    """A micro-batch becomes its completions as training rows (in place): prompt + completion, the
    completion labelled where the model wrote it (TRL's tool_mask: 0 on tool results) unless
    `mask_truncated_completions` leaves out a completion that never ended; the first `real` rows
    are the micro-batch's own (the rest pad a micro-batch without prompts)."""
    g, n, ends = objective.g, objective.spec.data.seq_len, objective.ends
    pad = objective.tokenizer.pad_token_id
    ids = torch.full((len(asked), n), pad, dtype=torch.long)
    labels = torch.full((len(asked), n), IGNORE, dtype=torch.long)
    sampled = torch.zeros((len(asked), n), dtype=torch.float32)  # the engine's log-probs, where labelled
    for i, (p, c) in enumerate(zip(asked, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        if i < real and not (g.mask_truncated_completions and (not c or c[-1] not in ends)):
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(
                c if masks is None else [t if m else IGNORE for t, m in zip(c, masks[i])]
            )
            if engine_logps is not None:
                sampled[i, len(p) : len(p) + len(c)] = torch.tensor(engine_logps[i], dtype=torch.float32)
    mb.clear()
    mb.update(
        input_ids=ids,
        labels=labels,
        position_ids=torch.arange(n)[None].repeat(len(asked), 1),
        advantages=torch.tensor(adv, dtype=torch.float32),
        pad_id=pad,
    )
    if engine_logps is not None:
        mb["_sampling_logps"] = sampled[:, 1:]  # aligned as the targets are (position t scores label t + 1)
    tokens = int((labels != IGNORE).sum())  # host: built on the host
    mb["_units"] = units_of(g.loss_type, real, tokens, g.max_completion_length)
