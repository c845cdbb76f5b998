"""KTO on unpaired feedback (TRL's KTOTrainer): each row one completion, labelled desirable or not,
stored with its mismatched KL sequence and a label tag (data/unpaired.py)."""

from __future__ import annotations

import torch

from raytrain.data import IGNORE
from raytrain.job.spec import JobSpec
from raytrain.objectives.base import Objective
from raytrain.objectives.tokens import forward, sequence_logps, staged, unstage


class KTO(Objective):
    """KTO on unpaired rows, as TRL's KTOTrainer computes it: a desirable row's loss is
    desirable_weight x (1 - sigmoid(beta (log-ratio - KL))), an undesirable one's
    undesirable_weight x (1 - sigmoid(beta (KL - log-ratio))), the mean over the global batch's rows;
    the log-ratio is the completion's log-prob under the policy minus under the reference (DPO's).
    KL is the mean log-ratio of the rows' mismatched KL sequences (data/unpaired.py), clamped at 0
    and not differentiated. TRL takes that mean over each device's micro-batch; here it is over the
    global batch (`begin`, one all-reduce before the step's first forward), so it is the same at any
    worker count and micro-batch split."""

    begins = True  # its `begin` sees the whole batch
    metrics = (
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "count/chosen",
        "count/rejected",
    )
    shown = (("kl", "kl"), ("margin", "rewards/margins"))

    def __init__(self, spec: JobSpec):
        p = spec.training.preference
        self.beta, self.weights = p.beta, (p.desirable_weight, p.undesirable_weight)
        self.kl_free = p.loss == "apo_zero_unpaired"  # TRL's unpaired APO-zero: the log-ratio against 0
        self.kl: torch.Tensor | None = None

    def units(self, mb: dict) -> int:
        return int(_split_kto(mb)["real"].sum())

    @torch.no_grad()
    def begin(self, strategy, micro_batches: list[dict]) -> None:
        """The global batch's KL estimate, from the KL sequences under the policy and the reference
        (under apo_zero_unpaired none: 0, and the KL sequences are not run, as TRL skips them)."""
        if self.kl_free:
            self.kl = torch.zeros((), device=strategy.device)
            return
        split, sums = strategy.sequence, torch.zeros(2, dtype=torch.float64, device=strategy.device)
        for mb in micro_batches:
            kl_rows = _split_kto(mb)["kl"]
            logps = sequence_logps(*forward(strategy, strategy.model, kl_rows))
            with strategy.reference() as reference:
                logps = logps - sequence_logps(*forward(strategy, reference, kl_rows))
            if split:
                logps = split.sum(logps)
            real = staged(strategy, kl_rows)["real"]
            sums += torch.stack([(logps * real).sum().double(), real.sum().double()])
            unstage(kl_rows)  # its device copies (masks: b x s x s) are not needed again
        torch.distributed.all_reduce(sums)  # each of a row's ranks adds it: the mean is the same
        self.kl = (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        split, rows = strategy.sequence, _split_kto(mb)
        out, targets = forward(strategy, strategy.model, rows)
        logps = sequence_logps(out, targets)
        with torch.no_grad(), strategy.reference() as reference:
            ref_logps = sequence_logps(*forward(strategy, reference, rows))
        if split:
            logps, ref_logps = split.sum(logps), split.sum(ref_logps).detach()
        x = staged(strategy, rows)
        desirable, kl = x["label"], self.kl
        ratio = logps - ref_logps
        # KTO: 1 - sigmoid(beta (ratio - KL)) / 1 - sigmoid(beta (KL - ratio)); APO-zero: KL is 0 and an
        # undesirable row's loss is sigmoid(beta ratio), the same value as KTO's at KL 0.
        loss = desirable * self.weights[0] * (1 - torch.sigmoid(self.beta * (ratio - kl))) + (
            1 - desirable
        ) * self.weights[1] * (1 - torch.sigmoid(self.beta * (kl - ratio)))
        real = x["real"] / (split.size if split else 1)  # as Preference's
        reward, lp = self.beta * ratio.detach(), logps.detach()
        stats = [
            kl.expand_as(lp),
            reward * desirable,
            reward * (1 - desirable),
            lp * desirable,
            lp * (1 - desirable),
            desirable,
            1 - desirable,
        ]
        return (loss * real).sum(), [(s * real).sum() for s in stats]

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """TRL's per-label means from the global batch's sums (each was divided by all its rows):
        a side with no rows in the batch is left out, as TRL leaves it out."""
        out = {"kl": means["kl"]}
        for side in ("chosen", "rejected"):
            share = means[f"count/{side}"]
            if share > 0:
                out.update({f"{k}/{side}": means[f"{k}/{side}"] / share for k in ("rewards", "logps")})
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def _split_kto(mb: dict) -> dict:
    """A KTO micro-batch (each row's example, KL sequence and label tag: data/unpaired.py) as the
    rows to train, with their KL sequences (`kl`), labels and real-row flags; made once, in place."""
    if "kl" not in mb:
        b = len(mb["input_ids"]) // 3
        planes = {k: mb[k] for k in ("input_ids", "labels", "position_ids")}
        label = planes["input_ids"][2 * b :, 0].float()  # the tag's one token: 1 desirable, 0 not
        real = (planes["labels"][:b, 1:] != IGNORE).any(-1).float()
        mb.update({k: v[:b] for k, v in planes.items()}, label=label, real=real)
        mb["kl"] = {**{k: v[b : 2 * b] for k, v in planes.items()}, "label": label, "real": real}
        if "most_sequences" in mb:  # each forward holds a third of a row's sequences, on every rank alike
            mb["most_sequences"] = mb["kl"]["most_sequences"] = mb["most_sequences"] // 3
    return mb
