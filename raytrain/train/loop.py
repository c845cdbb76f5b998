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
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from raytrain import objectives
from raytrain.data.batches import GlobalBatches
from raytrain.errors import JobError
from raytrain.job.spec import JobSpec
from raytrain.rundir import lease, metrics_backlog
from raytrain.rundir.checkpoints import TrainState
from raytrain.train import checkpoint, telemetry
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
    coef = getattr(strategy, "router_aux_coef", 0)  # an MoE's balancing loss (objectives/router.py)
    # GRPO's num_iterations: one rollout, then that many updates on its completions (TRL's mu). Each
    # update is one pass over the micro-batches; the last ends the step, the unit a checkpoint holds.
    for iteration in range(getattr(objective, "iterations", 1)):
        # GRPO's pass runs many forwards of one model (a rollout's decode steps, then its micro-batches):
        # a sharded model is gathered once for all of them (FSDP2Strategy.gathered), not per forward;
        # resharded before the update, which changes the shards
        with strategy.gathered() if getattr(objective, "gathers_model", False) else contextlib.nullcontext():
            if iteration == 0:
                if hasattr(
                    objective, "begin"
                ):  # what the micro-batches need of the whole batch (KTO's KL, GRPO's rollouts)
                    objective.begin(strategy, micro_batches)
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


def _require_lease(fence) -> None:
    """Collective, before a checkpoint: rank 0 reads the lease now; every rank raises if it is lost."""
    said = [None]
    if fence is not None:
        try:
            fence.require()
        except JobError as exc:
            said = [str(exc)]
    torch.distributed.broadcast_object_list(said, src=0)
    if said[0]:
        raise JobError(said[0])


def host_values(t: torch.Tensor) -> list[float]:
    """The step's one host sync: a device vector's values on the host."""
    return t.tolist()  # host: the step's one sync


def _log_committed(logger, steps: list[tuple[int, dict]], path: str | None) -> None:
    if logger:  # handed to its writer: the step goes on at once, whatever MLflow does
        logger.log_committed(steps, path)


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
    """Train until max_steps or a stop notice. Step metrics reach MLflow only once their
    step is in a committed checkpoint, so a rolled-back step is never left in the run."""
    device, rank, world = strategy.device, strategy.rank, strategy.world_size
    t, ck = spec.training, spec.checkpoint
    start, started = state.step, time.perf_counter()
    token = strategy.plan.lease  # the lease this group's driver holds: rank 0 watches it (lease.py)
    fence = lease.Fence(spec.run_dir, token) if token and rank == 0 else None
    stops = StopSignals(control, check_ray_notice=spec.failure.checkpoint_on_preemption, fence=fence)
    pending: list[tuple[int, dict]] = []  # step metrics not yet in a committed checkpoint
    uploading: list[tuple[int, dict]] = []  # ...of the checkpoint being uploaded asynchronously
    flops = telemetry.StepFlops(strategy.model, spec, device)
    objective = objectives.build(spec)
    checkpoint_s = 0.0  # the last save's blocking time, reported with the next step
    skipped = SkippedUpdates()
    journal = metrics_backlog.Journal(spec.run_dir) if logger else None  # rank 0
    while state.step < t.max_steps:
        step_start = time.perf_counter()
        seed_step(t.seed, state.step, rank // strategy.layout.tp)  # a layer's tp ranks drop out alike
        lr = lr_at(state.step, spec)
        batch = next(batches)
        if hasattr(objective, "at"):  # GRPO: the step and rows its completions are keyed by
            objective.at(state.step, batch.sample_ids)
        data_wait = time.perf_counter() - step_start
        compute_start = time.perf_counter()
        result = train_step(strategy, objective, batch.micro_batches, lr, stops)
        loss, grad_norm, means, flags = result.loss, result.grad_norm, result.means, stops.agree(result.flags)
        state.step += 1
        state.data = batches.position
        if skipped.record(state.step, result.applied) and rank == 0:
            print(
                f"[raytrain] step {state.step}: the gradients are not finite (grad norm {grad_norm}); its update "
                f"is skipped ({len(skipped.run)} in a row of {SkippedUpdates.LIMIT} that stop the job). This "
                f"rank's rows (source, epoch, row): {batch.sample_ids}",
                file=sys.stdout,
                flush=True,
            )
        skipped.check()
        step_tokens = t.global_batch_size * spec.sequences_per_row * spec.data.seq_len
        state.tokens_seen += step_tokens
        step_time = time.perf_counter() - step_start
        tokens_per_s = step_tokens / step_time
        metrics = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "compute_s": time.perf_counter() - compute_start,
            "checkpoint_s": checkpoint_s,
            "tokens_per_s": tokens_per_s,
            "peak_memory_gb": telemetry.peak_memory_gb(device),
            "tokens_seen": state.tokens_seen,
            "bad_rows": state.bad_rows,
            "world_size": world,
            **flops.metrics(tokens_per_s, world),
            **objectives.finish(objective, dict(zip(objective.metrics, means))),
        }
        if len(means) > len(objective.metrics):  # the router's balancing loss (train_step appends it)
            metrics["aux_loss"] = means[len(objective.metrics)]
        if not result.applied:
            metrics["update_skipped"] = 1.0
        if eval_batches is not None and (state.step % spec.data.eval.every_n_steps == 0 or state.step == t.max_steps):
            metrics.update(objectives.evaluate(strategy, objective, eval_batches))
        if on_step:
            on_step(state, batch)
        if rank == 0:
            if state.step % spec.tracking.log_every_n_steps == 0 or state.step == t.max_steps:
                pending.append((state.step, metrics))
                if logger:
                    logger.log_live(state.step, metrics)
            elapsed = time.perf_counter() - started
            eta = elapsed / (state.step - start) * (t.max_steps - state.step)
            mfu = f" | mfu {metrics['mfu']:.1%}" if "mfu" in metrics else ""
            mfu += f" | eval {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
            shown = getattr(objective, "shown", ())  # the preference objectives' headline metrics: (label, TRL's name)
            mfu += "".join(f" | {label} {metrics[name]:.3f}" for label, name in shown if name in metrics)
            mfu += f" | aux {metrics['aux_loss']:.3f}" if "aux_loss" in metrics else ""
            print(
                f"[raytrain] step {state.step}/{t.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} "
                f"| {tokens_per_s:,.0f} tok/s{mfu} | data {data_wait / step_time:.0%} | mem "
                f"{metrics['peak_memory_gb']:.1f}G "
                f"| world {world} | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}",
                file=sys.stdout,
                flush=True,
            )
        stops.step_done(state.step, step_time, rank)
        if flags & FENCED:  # another driver holds the run directory: stop here, commit nothing
            _require_lease(fence)  # every rank raises rank 0's word, naming the new holder
        checkpoint_s = 0.0
        if flags or state.step % ck.every_n_steps == 0 or state.step == t.max_steps:
            save_start = time.perf_counter()
            if uploading:  # the previous asynchronous checkpoint: long uploaded by now
                _log_committed(logger, uploading, checkpoint.confirm(strategy))
            urgent = bool(flags) or state.step == t.max_steps or not ck.async_save
            done = pending + [(state.step, {"checkpoint_step": state.step})]
            # The checkpoint holds its own steps' metrics; those of earlier ones MLflow has not taken
            # yet go once into the run directory's backlog (metrics_backlog.py): a restart, the driver
            # at the end or `raytrain sync-metrics` writes them if this process never can.
            state.metrics = done if rank == 0 else []
            if journal:
                journal.keep(logger.unwritten())
                journal.forget(logger.written_through)
            # A stop on every rank at once, on the training thread, before anything is staged: an async
            # save's own refusal (checkpoint.sign, the fence itself) comes on Ray's upload thread
            if token:
                _require_lease(fence)
            committed = checkpoint.save_and_report(strategy, state, metrics, wait=urgent)
            checkpoint_s = time.perf_counter() - save_start
            if logger and getattr(objective, "samples", None):  # GRPO: what the step sampled and scored
                logger.log_table(f"samples/step_{state.step:08d}.json", objective.samples)
            uploading = [] if urgent else done
            if urgent:
                _log_committed(logger, done, committed)
            pending = []
        if flags & (SIGTERM | RAY_NOTICE):
            stops.preempted(state.step, rank, wait=bool(flags & SIGTERM))
        if flags & SIGTERM:
            raise Preempted(f"SIGTERM: checkpoint committed at step {state.step}; restarting from it")
        if flags & DRIVER_STOP:
            state.stopped = True
            break
        if flags & RAY_NOTICE and rank == 0:
            print(
                f"[raytrain] preemption notice: checkpoint committed at step {state.step}", file=sys.stdout, flush=True
            )
    return state
