"""GRPO as TRL's GRPOTrainer computes it, on completions the workers sample each step.

`begin` runs before the step's first forward: each micro-batch's prompts are completed
`num_generations` times by the current policy (sampling.rollout), decoded and scored (rewards),
the scores of the whole global batch gathered to every rank, and the advantages computed as TRL
does (group-normalized; `scale_rewards`). Each micro-batch then becomes its completions as
training rows: prompt + completion, only the completion labelled.

The loss per token is TRL's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps_high) A), or
CISPO's -sg(min(r, eps_high)) A log p, or SAPO's sigmoid-gated ratio, plus beta x the k3 estimate
of KL(policy || reference); r is per token, or per completion (GSPO's sequence level); with
num_iterations 1 it is 1 (its gradient is the log-prob's). It is averaged by `loss_type` over the
global batch's units (the loop's rule: the same at any worker count and micro-batch split):
completions for `grpo` and `sapo` (each a token mean), completion tokens for `dapo`, `bnpo` and
`cispo` (TRL's bnpo averages each micro-batch's tokens instead), completions x
max_completion_length for `dr_grpo`.
"""

from __future__ import annotations

import atexit
import math
import time

import torch
import torch.nn.functional as F

from raytrain.data import IGNORE
from raytrain.data.prompts import columns_of
from raytrain.errors import JobError
from raytrain.job.grpo import reward_model_bytes
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.model import attention
from raytrain.objectives.base import Objective
from raytrain.objectives.grpo_batch import rollout_metrics, sample_rows, training_rows
from raytrain.objectives.tokens import Hidden, chunked_cross_entropy, forward
from raytrain.rl import rewards as rewards_module
from raytrain.rl.losses import advantages, importance_ratio, summed_loss, token_terms
from raytrain.rl.sampling import completion_key, rollout


def token_logps(out, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each target token's log-probability under logits / temperature (TRL's), 0 where unlabelled."""
    if isinstance(out, Hidden):
        return -chunked_cross_entropy(out, targets, temperature)
    return -F.cross_entropy(
        out.flatten(0, 1).float() / temperature, targets.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(targets.shape)


class GRPO(Objective):
    begins = True  # its `begin` sees the whole batch
    gathers_model = True  # the step's rollout and training forwards share one gathered model (loop.train_step)
    # Sums the loop reduces with the loss (means over the units; `finish` makes TRL's metrics of them)
    metrics = ("_sequences", "_tokens", "_kl", "_low", "_high", "_region", "_logp_diff", "_is_ratio")
    shown = (("reward", "reward"), ("reward_std", "reward_std"), ("len", "completions/mean_length"))

    def __init__(self, spec: JobSpec):
        self.spec, self.g = spec, spec.training.grpo
        self.rewards: list | None = None  # built in the worker (a user's function is imported there)
        self.tokenizer = None
        self.step, self.rows = 0, []
        self.host: dict[str, float] = {}  # this step's reward and completion metrics (the same on every rank)
        self.samples: list[dict] = []  # a few (prompt, completion, reward) of this rank's last step
        self.engine = None  # engine: vllm's (rl/engine.py), started at the first rollout
        self.agents = None  # tools and environments (grpo_agents.py), where the job has them

    def at(self, step: int, rows: list[tuple[int, int, int]]) -> None:
        """The step about to run and this rank's rows (source, epoch, row), in micro-batch order."""
        self.step, self.rows = step, rows

    @property
    def iterations(self) -> int:
        """Updates on a step's completions (loop.train_step)."""
        return self.g.num_iterations

    def units(self, mb: dict) -> int:
        return mb["_units"]

    def _setup(self, device: torch.device) -> None:
        if self.rewards is None:
            from raytrain.model.hub import load_tokenizer

            self.tokenizer = load_tokenizer(self.spec)
            bf16 = reward_model_bytes(self.spec, RunPlan.of(self.spec).bf16) == 2  # the plan's precision, on GPUs
            dtype = torch.bfloat16 if bf16 else torch.float32  # a reward model's
            self.rewards = [
                rewards_module.Reward(r, self.g.max_completion_length, device, dtype) for r in self.g.rewards
            ]
            if self.g.agents:
                from raytrain.objectives.grpo_agents import Agents

                self.agents = Agents(self.spec, self.tokenizer)
                atexit.register(self.agents.close)
                self.rewards += [rewards_module.EnvironmentReward(name) for name in self.agents.env_rewards]
                if not self.rewards:
                    raise JobError(
                        "training.grpo: no reward: give training.grpo.rewards, or an environment with get_reward"
                    )

    def begin(self, strategy, micro_batches: list[dict]) -> None:
        """Roll out, score and normalize the whole step's completions; turn each micro-batch into them."""
        self._setup(strategy.device)
        g, tok, started = self.g, self.tokenizer, time.perf_counter()
        eos = {tok.eos_token_id} | set(_ids(getattr(strategy.hf_model.generation_config, "eos_token_id", None)))
        self.ends = eos | {tok.pad_token_id}  # TRL's: a completion ending otherwise was truncated
        rows = iter(self.rows)
        asks = []  # per micro-batch: (its prompts, their columns, their rows, the prompts asked, their keys)
        for mb in micro_batches:
            b = len(mb["input_ids"]) // 2
            prompts, columns, ids = [], [], []
            for i in range(b):
                n = int((mb["labels"][i] != IGNORE).sum())  # host: the stored prompt's length
                if n:
                    prompts.append(mb["input_ids"][i, :n].tolist())  # host: the prompt's tokens
                    m = int((mb["labels"][b + i] != IGNORE).sum())  # host: its columns' length
                    columns.append(columns_of(mb["input_ids"][b + i, :m].tolist()))  # host: the columns' bytes
                    ids.append(next(rows))
            asked = [p for p in prompts for _ in range(g.num_generations)] or [[tok.pad_token_id]] * g.num_generations
            keys = [
                completion_key(self.spec.training.seed, self.step, r, k) for r in ids for k in range(g.num_generations)
            ] or [0] * g.num_generations
            asks.append((prompts, columns, ids, asked, keys))
        host = {}
        asks, outs, engine_logps, episodes, gen_s, tools_s = self._sample(strategy, asks, eos, host)
        generated = sum(len(c) for cs in outs for c in cs)
        made, t0 = [], time.perf_counter()
        for k, (mb, (prompts, columns, ids, asked, _), completions) in enumerate(zip(micro_batches, asks, outs)):
            mine = episodes[k] if episodes is not None else None
            scores = self._score(prompts, columns, completions, ids, mine) if prompts else []
            made.append((mb, asked, completions, scores))  # scores: the real completions' (the first ones)
        reward_s = time.perf_counter() - t0
        local = []
        for k, (_, _, cs, ss) in enumerate(made):
            for i, (s, c) in enumerate(zip(ss, cs)):
                e = episodes[k][i] if episodes is not None else None
                ended = c[-1] in eos if c else False
                local.append((s, sum(e.mask) if e else len(c), ended, *((e.calls, e.failures, e.turns) if e else ())))
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, local)  # small: a few floats a completion
        mine = sum(len(x) for x in everyone[: torch.distributed.get_rank()])
        flat = [x for part in everyone for x in part]
        scores = torch.tensor([x[0] for x in flat], dtype=torch.float64).view(len(flat), len(self.rewards))
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        adv, summed, zero_std = advantages(scores, weights, g.num_generations, g.scale_rewards)
        self.host = rollout_metrics(self.rewards, scores, summed, zero_std, flat, gen_s, reward_s, generated)
        if episodes is not None:
            self.host.update(self.agents.finish(episodes, [x[3:] for x in flat], tools_s))
        self.host.update(host)
        at = mine
        for k, (mb, asked, completions, ss) in enumerate(made):
            count = len(ss)
            mine_adv = adv[at : at + count].tolist() + [0.0] * (len(asked) - count)  # host: tiny
            at += count
            masks = [e.mask for e in episodes[k]] if episodes is not None else None
            training_rows(
                self,
                mb,
                asked,
                completions,
                mine_adv,
                count,
                engine_logps[k] if engine_logps is not None else None,
                masks,
            )
        self.samples = sample_rows(tok, g, self.step, self.rewards, made)
        self.host["time/rollout_s"] = time.perf_counter() - started

    def _sample(self, strategy, asks, eos: set[int], host: dict):
        """The step's completions, by the engine, the policy itself, or as episodes (tools): (the asks,
        with each episode's own prompt; completions; the engine's log-probs; episodes; seconds)."""
        g, tok = self.g, self.tokenizer
        t0, engine_logps, episodes, tools_s = time.perf_counter(), None, None, 0.0
        if g.engine == "vllm":  # one request for the rank's whole step, after the sync of this step's weights
            if self.engine is None:
                from raytrain.rl.engine import VLLMEngine

                self.engine = VLLMEngine(
                    self.spec, strategy.device, sum(len(a[3]) for a in asks), bf16=strategy.plan.bf16
                )
                atexit.register(self.engine.close)
                host["vllm/start_s"] = self.engine.start_s
            host["vllm/sync_mb"], host["vllm/sync_s"] = self.engine.sync(strategy)
            t0 = time.perf_counter()
        if self.agents is not None:  # episodes of several turns: each turn batched across the rank's episodes
            episodes, seconds = self.agents.rollout(strategy, self.step, asks, eos, self.engine)
            outs = [[e.completion for e in mb] or [[tok.pad_token_id]] * g.num_generations for mb in episodes]
            if self.engine is not None:
                engine_logps = [[e.logps for e in mb] or [[0.0]] * g.num_generations for mb in episodes]
            asks = [a[:3] + ([e.prompt for e in mb] or a[3], a[4]) for a, mb in zip(asks, episodes)]
            gen_s, tools_s = seconds["generation"], seconds["tools"]
        elif g.engine == "vllm":
            flat, logps = self.engine.generate([p for a in asks for p in a[3]], [k for a in asks for k in a[4]], eos)
            at, outs, engine_logps = 0, [], []
            for a in asks:
                outs.append(flat[at : at + len(a[3])])
                engine_logps.append(logps[at : at + len(a[3])])
                at += len(a[3])
        else:
            outs = [
                rollout(strategy, a[3], a[4], g.max_completion_length, g.temperature, g.top_p, eos, tok.pad_token_id)
                for a in asks
            ]
        if episodes is None:
            gen_s = time.perf_counter() - t0
        return asks, outs, engine_logps, episodes, gen_s, tools_s

    def _score(self, prompts, columns, completions, ids, episodes=None):
        g, tok = self.g, self.tokenizer
        conversational = isinstance(columns[0]["prompt"], list)
        given = [c["prompt"] for c in columns for _ in range(g.num_generations)]
        if episodes is not None:  # TRL's shape of an episode: its assistant and tool messages
            texts = [e.messages for e in episodes]
        else:
            texts = tok.batch_decode(completions, skip_special_tokens=True)
            if conversational:  # TRL's shape: the completion as one assistant message
                texts = [[{"role": "assistant", "content": t}] for t in texts]
        cols = {k: [c.get(k) for c in columns for _ in range(g.num_generations)] for k in columns[0] if k != "prompt"}
        plain = [r for r in self.rewards if not isinstance(r, rewards_module.EnvironmentReward)]
        scores = rewards_module.score(plain, given, texts, completions, cols, ids)
        if episodes is None or len(plain) == len(self.rewards):
            return scores
        env = self.agents.env_scores(episodes)  # the environments' own rewards, after the others
        return [s + v for s, v in zip(scores, env)] if plain else env

    def __call__(self, strategy, mb: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        g = self.g
        out, targets = forward(strategy, strategy.model, mb)
        logps = token_logps(out, targets, g.temperature)
        mask = (targets != IGNORE).float()
        # The sampling policy's log-probs: this pass's on the first update (ratio 1), kept on the
        # micro-batch for the step's later updates (num_iterations), as TRL's old_per_token_logps
        old = mb.setdefault("_old_logps", logps.detach())
        ref = mb.get("_ref_logps")
        if g.beta and ref is None:  # the reference does not change within a step: once
            with torch.no_grad(), strategy.reference() as reference:
                ref = mb["_ref_logps"] = token_logps(forward(strategy, reference, mb)[0], targets, g.temperature)
        adv = attention.to_device(mb["advantages"], strategy.device)
        real = (mask.sum(-1) > 0).float()
        ratio, diff, ratio_sum = None, mask.sum() * 0, mask.sum() * 0
        if "_sampling_logps" in mb:  # engine: vllm: the trainer's log-probs against the engine's
            if "_is_ratio" not in mb:  # once a micro-batch: `old` and the engine's do not change within a step
                sampled = attention.to_device(mb["_sampling_logps"], strategy.device)
                mb["_logp_diff"] = ((old - sampled).abs() * mask).sum()
                mb["_is_ratio"] = (
                    importance_ratio(old, sampled, mask, g) if g.vllm_importance_sampling_correction else None
                )
            diff, ratio = mb["_logp_diff"], mb["_is_ratio"]
            if ratio is not None:
                ratio_sum = (ratio * (mask if ratio.shape[-1] > 1 else real[:, None])).sum()
        loss, kl, low, high = token_terms(logps, old, ref, adv, mask, g, ratio)
        over = (
            mask if low.shape[-1] > 1 else real[:, None]
        )  # clips counted over tokens, or completions (sequence level)
        stats = [
            real.sum(),
            mask.sum(),
            (kl.detach() * mask).sum() if kl is not None else mask.sum() * 0,
            (low * over).sum(),
            (high * over).sum(),
            (torch.maximum(low, high) * over).sum(),
            diff,
            ratio_sum,
        ]
        return summed_loss(loss, mask, g.loss_type), stats

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """TRL's metric names from the global batch's sums (over completion tokens) and the rollout's."""
        tokens = means["_tokens"] or math.inf
        counted = (means["_sequences"] or math.inf) if self.g.importance_sampling_level == "sequence" else tokens
        if self.g.loss_type == "cispo":
            out = {"cispo_clip_ratio": means["_high"] / counted}
        elif self.g.loss_type == "sapo":  # no clip to count
            out = {}
        else:
            out = {
                "clip_ratio/low_mean": means["_low"] / counted,
                "clip_ratio/high_mean": means["_high"] / counted,
                "clip_ratio/region_mean": means["_region"] / counted,
            }
        if self.g.beta:
            out["kl"] = means["_kl"] / tokens
        if self.g.engine == "vllm":  # TRL's names
            out["sampling/sampling_logp_difference/mean"] = means["_logp_diff"] / tokens
            if self.g.vllm_importance_sampling_correction:
                per = (
                    (means["_sequences"] or math.inf)
                    if self.g.vllm_importance_sampling_mode.startswith("sequence")
                    else tokens
                )
                out["sampling/importance_sampling_ratio/mean"] = means["_is_ratio"] / per
        return {**out, **self.host}


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)
