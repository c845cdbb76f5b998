"""The training loop: the same for every strategy.

Loss is the mean over the global batch's units (label tokens for SFT, pairs for DPO/SimPO;
objectives/), whatever the worker count, mesh and micro-batch split: each micro-batch
contributes its summed loss / the global units, scaled by the ranks gradients are averaged
over (`Mesh.gradient_ranks`: data- and sequence-parallel; tensor-parallel ranks compute the same
loss). So a run resumed at another world size or mesh continues the same optimization, not a
reweighted one.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from raytrain import objectives
from raytrain.data.batches import GlobalBatches
from raytrain.errors import JobError
from raytrain.job.spec import JobSpec
from raytrain.rundir.checkpoints import TrainState
from raytrain.train.after_step import Commits, Lease, Report, Timer
from raytrain.train.preemption import DRIVER_STOP, FENCED, RAY_NOTICE, SIGTERM, Preempted, StopSignals


def lr_at(step: int, spec: JobSpec) -> float:
    """Warmup then decay; a pure function of the step, so a checkpoint's step restores it."""
    o, total = spec.optimizer, spec.training.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    # Steps run 0 .. max_steps - 1: the last one trained gets the floor.
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - 1 - o.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * shape)


def seed_step(seed: int, step: int, rank: int) -> None:
    """Dropout and every other torch RNG: a function of (seed, step, rank), nothing to checkpoint."""
    torch.manual_seed(hash((seed, step, rank)) % (2**63))


@dataclass
class StepResult:
    loss: float  # the mean over the global batch's units (objectives/)
    grad_norm: float
    means: list[float]  # the objective's metrics, means over the global batch
    flags: list[float]  # the stop flags, summed over ranks
    applied: bool = True  # False: the gradients were not finite and the update was skipped


class SkippedUpdates:
    """Steps whose gradients are not finite (a NaN or inf anywhere) are not applied: the weights
    and AdamW's state stay as they were and the step's rows count as seen, as Megatron and
    DeepSpeed skip such iterations. One applied update poisons every later step and checkpoint;
    a few skipped ones cost a few global batches. `LIMIT` in a row stop the job: then it diverges
    rather than meets a bad batch, and the last checkpoint is from before."""

    LIMIT = 5

    def __init__(self) -> None:
        self.run: list[int] = []  # the skipped steps in a row, up to now

    def record(self, step: int, applied: bool) -> bool:
        """Whether `step`'s update was skipped."""
        self.run = [] if applied else self.run + [step]
        return not applied

    def after(self, step: int, result: StepResult, rows: list, rank: int) -> None:
        """Record `step`'s update; rank 0 names a skipped one and its rows; the LIMIT-th in a row stops."""
        if self.record(step, result.applied) and rank == 0:
            print(
                f"[raytrain] step {step}: the gradients are not finite (grad norm {result.grad_norm}); its update "
                f"is skipped ({len(self.run)} in a row of {self.LIMIT} that stop the job). This "
                f"rank's rows (source, epoch, row): {rows}",
                file=sys.stdout,
                flush=True,
            )
        self.check()

    def check(self) -> None:
        """JobError at the LIMIT-th skipped step in a row."""
        if len(self.run) >= self.LIMIT:
            raise JobError(
                f"training diverged: the gradients were not finite at steps {self.run[0]}-{self.run[-1]}, "
                f"{self.LIMIT} in a row, and none of those updates was applied. The last checkpoint "
                "holds the weights from before them. Lower optimizer.lr, set training.grad_clip, "
                "or look at the rows of those steps (printed above)"
            )


def train_step(strategy, objective, micro_batches: list[dict], lr: float, stops: StopSignals) -> StepResult:
    """One optimizer step over this rank's micro-batches of a global batch.

    The host waits for the device once a step, at the end (`host_values`): the loss, the
    metrics and the grad norm accumulate on the device and ride one all-reduce with the stop
    flags. The global batch's units are summed over ranks first, on the device, and scale the
    loss there: nothing in between stalls the host while kernels run (FSDP2's prefetch keeps
    overlapping)."""
    device, mesh = strategy.device, strategy.layout
    results, units, scale = [], None, None
    coef = strategy.router_aux_coef  # an MoE's balancing loss (objectives/router.py)
    # GRPO's num_iterations: one rollout, then that many updates on its completions (TRL's mu). Each
    # update is one pass over the micro-batches; the last ends the step, the unit a checkpoint holds.
    for iteration in range(objective.iterations):
        # GRPO's pass runs many forwards of one model (a rollout's decode steps, then its micro-batches):
        # a sharded model is gathered once for all of them (FSDP2Strategy.gathered), not per forward;
        # resharded before the update, which changes the shards
        with strategy.gathered() if objective.gathers_model else contextlib.nullcontext():
            if iteration == 0:
                objective.begin(strategy, micro_batches)  # of the whole batch: KTO's KL, GRPO's rollouts
                counts = [sum(map(objective.units, micro_batches))]
                if coef:  # the balancing loss's units: the global batch's real tokens
                    counts.append(sum(objectives.aux_tokens(strategy, mb) for mb in micro_batches))
                totals = objectives.to_device(counts, device)
                torch.distributed.all_reduce(totals)  # the global batch's units, counted by each of a row's ranks
                totals = (totals / mesh.row_ranks).clamp(min=1)
                units = totals[:1]
                # Gradients are averaged over the data- and sequence-parallel ranks (a sequence's parts
                # add up; its tp ranks compute the same loss): this makes the step's gradient a sum / units.
                scale = mesh.gradient_ranks / units
                aux_scale = mesh.gradient_ranks / totals[1:] if coef else None
            sums = torch.zeros(1 + len(objective.metrics) + bool(coef), dtype=torch.float64, device=device)
            for i, mb in enumerate(micro_batches):
                loss, stats = objective(strategy, mb)
                total = loss * scale.to(loss.dtype)
                if coef:  # Σ T_r·aux_r of this micro-batch's sequences, over the global batch's real tokens
                    aux = objectives.staged(strategy, mb).get("aux", torch.zeros((), device=device))
                    total = total + (coef * aux * aux_scale).to(total.dtype).reshape(())
                    stats = [*stats, aux * units / totals[1]]  # reported as a mean over those tokens
                strategy.backward(total, sync=i == len(micro_batches) - 1)
                sums += torch.stack([t.detach().double().reshape(()) for t in (loss, *stats)])
                objectives.unstage(mb)
                if i + 1 < len(micro_batches):  # the next one's copies queue behind this backward
                    objectives.staged(strategy, micro_batches[i + 1])
        results.append(_update(strategy, sums, units, lr, stops))
    if len(results) == 1:
        return results[0]
    n = len(results)  # the updates' means; the last update's grad norm; a skipped update counts
    return StepResult(
        loss=sum(r.loss for r in results) / n,
        grad_norm=results[-1].grad_norm,
        means=[sum(v) / n for v in zip(*(r.means for r in results))],
        flags=[max(v) for v in zip(*(r.flags for r in results))],
        applied=all(r.applied for r in results),
    )


def _update(strategy, sums: torch.Tensor, units: torch.Tensor, lr: float, stops: StopSignals) -> StepResult:
    """Clip, reduce the step's sums with the stop flags (the one host read), and apply the update."""
    device, mesh = strategy.device, strategy.layout
    grad_norm = strategy.begin_update(lr)
    reduced = torch.cat([sums, objectives.to_device(stops.local(), device)])
    torch.distributed.all_reduce(reduced)  # the stop flags ride along
    n = len(sums)
    values = host_values(
        torch.cat([reduced[:n] / mesh.tp / units, grad_norm.detach().double().view(1).to(device), reduced[n:]])
    )
    # The update waits for the norm on the host (it is the same on every rank): its kernels queue
    # right behind the read, so the device idles only for the host's decision.
    applied = strategy.end_update(math.isfinite(values[n]))
    return StepResult(loss=values[0], means=values[1:n], grad_norm=values[n], flags=values[n + 1 :], applied=applied)


def host_values(t: torch.Tensor) -> list[float]:
    """The step's one host sync: a device vector's values on the host."""
    return t.tolist()  # host: the step's one sync


def fit(
    spec: JobSpec,
    strategy,
    batches: GlobalBatches,
    state: TrainState,
    logger=None,
    control=None,
    on_step=None,
    eval_batches: Iterable[dict] | None = None,
) -> TrainState:
    """Train until max_steps or a stop notice, a checkpoint at every `every_n_steps`, the last step
    and every notice. Step metrics reach MLflow only once their step is committed (`Commits`)."""
    t, rank = spec.training, strategy.rank
    objective = objectives.build(spec)
    held = Lease.of(spec, strategy)
    stops = StopSignals(control, check_ray_notice=spec.failure.checkpoint_on_preemption, fence=held.fence)
    commits, report, skipped = (
        Commits(spec, strategy, logger, held, state.step),
        Report(spec, strategy, state.step),
        SkippedUpdates(),
    )
    while state.step < t.max_steps:
        timer = Timer()
        seed_step(t.seed, state.step, rank // strategy.layout.tp)  # a layer's tp ranks drop out alike
        lr = lr_at(state.step, spec)
        batch = next(batches)
        objective.at(state.step, batch.sample_ids)  # GRPO keys its completions by the step and rows
        timer.rows_ready()
        result = train_step(strategy, objective, batch.micro_batches, lr, stops)
        flags = stops.agree(result.flags)
        state.step, state.data = state.step + 1, batches.position
        state.tokens_seen += report.step_tokens
        skipped.after(state.step, result, batch.sample_ids, rank)
        metrics = report.metrics(state, result, lr, timer, objective, commits.checkpoint_s)
        if eval_batches is not None and (state.step % spec.data.eval.every_n_steps == 0 or state.step == t.max_steps):
            metrics.update(objectives.evaluate(strategy, objective, eval_batches))
        if on_step:
            on_step(state, batch)
        if rank == 0:
            commits.keep(state.step, metrics)
            report.print_line(state.step, metrics, objective)
        stops.step_done(state.step, metrics["step_time_s"], rank)
        if flags & FENCED:  # another driver holds the run directory: stop here, commit nothing
            held.require()  # every rank raises rank 0's word, naming the new holder
        if commits.due(flags, state.step):
            commits.save(state, metrics, flags, objective)
        if _stop(flags, state, stops, rank):
            break
    return state


def _stop(flags: int, state: TrainState, stops: StopSignals, rank: int) -> bool:
    """After a notice's checkpoint committed: leave for a restart (SIGTERM), end the job (a stop the
    driver asked for), or go on (Ray's drain notice: Ray restarts once the node is gone)."""
    if flags & (SIGTERM | RAY_NOTICE):
        stops.preempted(state.step, rank, wait=bool(flags & SIGTERM))
    if flags & SIGTERM:
        raise Preempted(f"SIGTERM: checkpoint committed at step {state.step}; restarting from it")
    if flags & DRIVER_STOP:
        state.stopped = True
        return True
    if flags & RAY_NOTICE and rank == 0:
        print(f"[raytrain] preemption notice: checkpoint committed at step {state.step}", file=sys.stdout, flush=True)
    return False
