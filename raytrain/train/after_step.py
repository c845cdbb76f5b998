"""What follows a step's update in `loop.fit`, each a named step: its metrics and the step line
(`Report`), the lease check (`Lease`), and the checkpoint it may commit with the step metrics that
reach MLflow only once their step is committed (`Commits`)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from raytrain.errors import JobError
from raytrain.rundir import lease, metrics_backlog
from raytrain.train import checkpoint, telemetry


@dataclass
class Timer:
    """One step's clock: its start, when its rows were ready, when its compute began."""

    start: float = field(default_factory=time.perf_counter)
    data_wait: float = 0.0

    def rows_ready(self) -> None:
        self.data_wait = time.perf_counter() - self.start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Report:
    """A step's metrics (what MLflow gets) and rank 0's step line."""

    def __init__(self, spec, strategy, first_step: int):
        self.spec, self.strategy = spec, strategy
        self.first_step, self.started = first_step, time.perf_counter()
        self.flops = telemetry.StepFlops(strategy.model, spec, strategy.device)
        t = spec.training
        self.step_tokens = t.global_batch_size * spec.sequences_per_row * spec.data.seq_len

    def metrics(self, state, result, lr: float, timer: Timer, objective, checkpoint_s: float) -> dict:
        step_time = timer.elapsed()
        tokens_per_s = self.step_tokens / step_time
        world = self.strategy.world_size
        out = {
            "step": state.step,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "step_time_s": step_time,
            "data_wait_s": timer.data_wait,
            "compute_s": step_time - timer.data_wait,
            "checkpoint_s": checkpoint_s,
            "tokens_per_s": tokens_per_s,
            "peak_memory_gb": telemetry.peak_memory_gb(self.strategy.device),
            "tokens_seen": state.tokens_seen,
            "bad_rows": state.bad_rows,
            "world_size": world,
            **self.flops.metrics(tokens_per_s, world),
            **objective.finish(dict(zip(objective.metrics, result.means))),
        }
        if len(result.means) > len(objective.metrics):  # the router's balancing loss (train_step appends it)
            out["aux_loss"] = result.means[len(objective.metrics)]
        if not result.applied:
            out["update_skipped"] = 1.0
        return out

    def print_line(self, step: int, metrics: dict, objective) -> None:
        """Rank 0's line for the step: the loss, the rate, the objective's headline metrics."""
        max_steps = self.spec.training.max_steps
        eta = (time.perf_counter() - self.started) / (step - self.first_step) * (max_steps - step)
        extra = f" | mfu {metrics['mfu']:.1%}" if "mfu" in metrics else ""
        extra += f" | eval {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
        extra += "".join(f" | {label} {metrics[name]:.3f}" for label, name in objective.shown if name in metrics)
        extra += f" | aux {metrics['aux_loss']:.3f}" if "aux_loss" in metrics else ""
        print(
            f"[raytrain] step {step}/{max_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | grad "
            f"{metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s{extra} | data "
            f"{metrics['data_wait_s'] / metrics['step_time_s']:.0%} | mem {metrics['peak_memory_gb']:.1f}G | world "
            f"{self.strategy.world_size} | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}",
            file=sys.stdout,
            flush=True,
        )


class Lease:
    """The run directory's lease as this worker group sees it: rank 0 watches it (a `lease.Fence`
    thread, whose word rides the stop flags); `require` is a collective that raises rank 0's word
    on every rank once another driver holds it."""

    def __init__(self, token: str, fence: lease.Fence | None):
        self.token, self.fence = token, fence  # the lease this group's driver holds ("" without a driver)

    @classmethod
    def of(cls, spec, strategy) -> "Lease":
        token = strategy.plan.lease
        return cls(token, lease.Fence(spec.run_dir, token) if token and strategy.rank == 0 else None)

    def require(self) -> None:
        said = [None]
        if self.fence is not None:
            try:
                self.fence.require()
            except JobError as exc:
                said = [exc.args[0] if exc.args else str(exc)]
        torch.distributed.broadcast_object_list(said, src=0)
        if said[0]:
            raise JobError(said[0])


class Commits:
    """Step metrics wait here until their step is in a committed checkpoint: then they go to MLflow
    (rank 0's writer), so a rolled-back step never appears twice. A checkpoint holds its own steps'
    metrics; those of earlier checkpoints MLflow has not taken go once into the run directory's
    backlog (rundir/metrics_backlog.py)."""

    def __init__(self, spec, strategy, logger, lease_: Lease, resumed: int):
        self.spec, self.strategy, self.logger, self.lease = spec, strategy, logger, lease_
        self.pending: list[tuple[int, dict]] = []  # not yet in a committed checkpoint
        self.uploading: list[tuple[int, dict]] = []  # ...of the checkpoint being uploaded in the background
        # rank 0's; a restart's resumed step is its watermark: what the rolled-back lineage kept goes
        self.journal = metrics_backlog.Journal(spec.run_dir, resumed) if logger else None
        self.checkpoint_s = 0.0  # the last save's blocking time, reported with the next step

    def keep(self, step: int, metrics: dict) -> None:
        """Rank 0: a step's metrics, shown live at once, committed with their checkpoint."""
        if step % self.spec.tracking.log_every_n_steps == 0 or step == self.spec.training.max_steps:
            self.pending.append((step, metrics))
            if self.logger:
                self.logger.log_live(step, metrics)

    def due(self, flags: int, step: int) -> bool:
        ck = self.spec.checkpoint
        self.checkpoint_s = 0.0
        return bool(flags) or step % ck.every_n_steps == 0 or step == self.spec.training.max_steps

    def save(self, state, metrics: dict, flags: int, objective) -> None:
        started = time.perf_counter()
        if self.uploading:  # the previous background checkpoint: long uploaded by now
            self._committed(self.uploading, checkpoint.confirm(self.strategy))
        urgent = bool(flags) or state.step == self.spec.training.max_steps or not self.spec.checkpoint.async_save
        done = self.pending + [(state.step, {"checkpoint_step": state.step})]
        state.metrics = done if self.strategy.rank == 0 else []
        before_checkpoint(self.lease, self.journal, self.logger)
        committed = checkpoint.save_and_report(self.strategy, state, metrics, wait=urgent)
        self.checkpoint_s = time.perf_counter() - started
        if self.logger and objective.samples:  # GRPO: what the step sampled and scored
            self.logger.log_table(f"samples/step_{state.step:08d}.json", objective.samples)
        self.uploading = [] if urgent else done
        if urgent:
            self._committed(done, committed)
        self.pending = []

    def _committed(self, steps: list[tuple[int, dict]], path: str | None) -> None:
        if self.logger:  # handed to its writer: the step goes on at once, whatever MLflow does
            self.logger.log_committed(steps, path)


def before_checkpoint(held: Lease, journal, logger) -> None:
    """Collective, before each checkpoint: the lease first, on every rank at once, on the training
    thread, before anything is staged or written (an async save's own refusal, checkpoint.sign, comes
    on Ray's upload thread); then rank 0 keeps in the backlog the steps MLflow has not taken
    (rundir/metrics_backlog.py). So a fenced group writes and deletes no backlog file."""
    if held.token:
        held.require()
    if journal:
        journal.keep(logger.unwritten())
        journal.forget(logger.written_through)
