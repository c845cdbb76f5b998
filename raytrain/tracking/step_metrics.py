"""Rank 0's step metrics into the job's MLflow run, through one background writer: the
training thread hands metrics over and goes on; it never waits for MLflow and never fails
because of it.

Two histories (see mlflow_run.py): the committed one (`loss`, ...: each step once, handed over
when its checkpoint commits) and the live one (`live/loss`, ...: within moments of each step).
While MLflow is unreachable the writer says so once, retries with a growing pause, and says
so again when it is back; live values of the outage are dropped (a convenience), committed
ones are kept. What is not written yet is also kept in storage, each step once (a checkpoint
holds its own steps, metrics_backlog.py those of earlier checkpoints), so a restart, the driver
at the end, a later run of the job or `raytrain sync-metrics` writes whatever this process never could.

A write that failed may still have landed (the server committed, the answer was lost): after
any failure, kept steps are first checked against the run's watermark (`tracking.logged_through`:
one read of the run, not its history), so each step is in MLflow once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

from raytrain.job.spec import JobSpec
from raytrain.tracking import mlflow_run

LIVE_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eval_loss", "mfu")
LIVE_KEPT = 1000  # live steps waiting for the writer; older ones are dropped, never waited for
COMMITTED_KEPT = 100_000  # committed steps kept in memory (and checkpoints) while MLflow is down
RETRY_S = (1.0, 30.0)  # the writer's pause after a failed write: doubling from the first to the second


class _Entry:
    __slots__ = ("step", "metrics", "committed", "check")

    def __init__(self, step: int, metrics: dict, committed: bool, check: bool):
        self.step, self.metrics, self.committed, self.check = step, metrics, committed, check


class StepLogger:
    def __init__(self, spec: JobSpec, run_id: str):
        self.run_id, self.client = run_id, mlflow_run.client(spec)
        self._cond = threading.Condition()
        self._kept: list[_Entry] = []  # committed steps and per-attempt values, in order
        self._live: deque = deque(maxlen=LIVE_KEPT)
        self._tags: dict[str, str] = {}
        self._busy = False  # the writer holds a batch taken from the queues
        self._down_since: float | None = None
        self.written_through = 0  # MLflow has every committed step up to here (the backlog's files may go)
        threading.Thread(target=self._write, name="raytrain-metrics", daemon=True).start()

    # --- the training thread's side: none of these waits for MLflow ---
    def log_live(self, step: int, metrics: dict[str, float]) -> None:
        with self._cond:
            self._live.append((step, {f"live/{k}": metrics[k] for k in LIVE_KEYS if k in metrics}))
            self._cond.notify()

    def log_committed(self, steps: list[tuple[int, dict]], checkpoint: str | None) -> None:
        """The steps of a committed checkpoint (and its path, as a tag)."""
        self._keep([_Entry(s, m, True, False) for s, m in steps])
        if checkpoint:
            self.set_tags({"raytrain.latest_checkpoint": str(checkpoint)})

    def log_missing(self, steps: list[tuple[int, dict]]) -> None:
        """A restored checkpoint's unwritten steps: written unless MLflow already has them."""
        self._keep([_Entry(s, m, True, True) for s, m in steps])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Per-attempt values (restarts, start-up times): kept while MLflow is down, not checkpointed."""
        self._keep([_Entry(step, metrics, False, False)])

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._cond:
            self._tags.update(tags)
            self._cond.notify()

    def unwritten(self) -> list[tuple[int, dict]]:
        """Committed steps not in MLflow yet: they go into the next checkpoint."""
        with self._cond:
            return [(e.step, e.metrics) for e in self._kept if e.committed]

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until everything handed over is written; False if not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._kept or self._tags or self._live or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._down_since is not None:
                    return False
                self._cond.wait(left)
            return True

    def log_table(self, artifact_file: str, rows: list[dict]) -> None:
        """A table artifact (GRPO's prompt / completion / reward samples), written in the background
        and best effort: samples are worth a line in the log, not a step's wait or a failed job."""

        def write() -> None:
            try:
                self.client.log_table(
                    self.run_id, data={k: [r.get(k) for r in rows] for k in rows[0]}, artifact_file=artifact_file
                )
            except Exception as exc:
                print(f"[raytrain] {artifact_file} was not logged to MLflow ({_why(exc)})", file=sys.stdout, flush=True)

        if rows:
            threading.Thread(target=write, name="raytrain-table", daemon=True).start()

    def log_model_dir(self, local_dir: str) -> None:
        """`tracking.log_model`: a copy of the final model as the run's artifact, if MLflow takes it."""
        try:
            self.client.log_artifacts(self.run_id, local_dir, artifact_path="final_model")
        except Exception as exc:  # the model is in the run directory whatever MLflow does
            print(
                f"[raytrain] the final model was not logged to MLflow ({_why(exc)}); it is in the run directory",
                file=sys.stdout,
                flush=True,
            )

    def _keep(self, entries: list[_Entry]) -> None:
        with self._cond:
            self._kept.extend(entries)
            if len(self._kept) > COMMITTED_KEPT:
                dropped = len(self._kept) - COMMITTED_KEPT
                del self._kept[:dropped]
                print(
                    f"[raytrain] MLflow has been unreachable too long: {dropped} oldest step metrics dropped",
                    file=sys.stdout,
                    flush=True,
                )
            self._cond.notify()

    # --- the writer thread ---
    def _write(self) -> None:
        pause = RETRY_S[0]
        while True:
            with self._cond:
                while not (self._kept or self._tags or self._live):
                    self._cond.wait()
                kept, tags, live = list(self._kept[: mlflow_run.BATCH]), dict(self._tags), list(self._live)
                self._tags.clear()
                self._live.clear()
                self._busy = True
            try:
                self._send(kept, tags, live)
            except Exception as exc:  # MLflow unreachable or failing: training goes on, kept steps wait
                with self._cond:
                    for entry in kept:
                        entry.check = True  # the failed write may have landed
                    self._tags = {**tags, **self._tags}
                    self._busy = False
                    if self._down_since is None:
                        self._down_since = time.monotonic()
                        print(
                            f"[raytrain] MLflow unreachable ({_why(exc)}): training goes on; step metrics are kept "
                            "(and in storage) and written when it is back",
                            file=sys.stdout,
                            flush=True,
                        )
                    self._cond.notify_all()
                time.sleep(pause)
                pause = min(pause * 2, RETRY_S[1])
                continue
            pause = RETRY_S[0]
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _reached(self) -> None:
        """A request went through: if MLflow was unreachable, it is back."""
        with self._cond:
            if self._down_since is not None:
                print(
                    f"[raytrain] MLflow reachable again after {time.monotonic() - self._down_since:.0f} s: "
                    "the kept step metrics are being written",
                    file=sys.stdout,
                    flush=True,
                )
                self._down_since = None

    def _written(self, entries: list[_Entry]) -> None:
        with self._cond:
            done = {id(e) for e in entries}
            self._kept = [e for e in self._kept if id(e) not in done]

    def _send(self, kept: list[_Entry], tags: dict, live: list) -> None:
        """One batch, request by request; each one that goes through says MLflow is reachable, and
        the kept steps are forgotten as soon as MLflow has them (a later request may still fail)."""
        from mlflow.entities import Metric

        kept = self._drop_written(kept, lambda e: not e.metrics)  # nothing to write
        if any(e.check and e.committed for e in kept):  # a step is in the run iff <= its watermark (tracking)
            through = mlflow_run.logged_through(self.client, self.run_id)
            self._reached()
            self.written_through = max(self.written_through, through)
            kept = self._drop_written(kept, lambda e: e.committed and e.check and e.step <= through)
        attempts = [e for e in kept if e.check and not e.committed]
        if attempts:  # per-attempt values: a few an attempt, so their whole histories
            have = mlflow_run.logged_steps(self.client, self.run_id, {next(iter(e.metrics)) for e in attempts})
            self._reached()
            kept = self._drop_written(kept, lambda e: e in attempts and e.step in have[next(iter(e.metrics))])
        committed = [e for e in kept if e.committed]
        mlflow_run.log_steps(self.client, self.run_id, [(e.step, e.metrics) for e in committed])
        if committed:
            self._reached()
            self._written(committed)
            self.written_through = max(self.written_through, committed[-1].step)
        now = int(time.time() * 1000)
        others = [e for e in kept if not e.committed]
        pairs = [(e.step, k, v) for e in others for k, v in e.metrics.items()]
        batch = [Metric(k, float(v), now, step) for step, k, v in pairs]  # host: metric values, once a step
        for i in range(0, len(batch), mlflow_run.BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + mlflow_run.BATCH])
            self._reached()
        self._written(others)
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
            self._reached()
        if live:  # after the committed ones; a live batch that fails is dropped, not retried
            pairs = [(step, k, v) for step, m in live for k, v in m.items()]
            values = [Metric(k, float(v), now, step) for step, k, v in pairs]  # host: metric values, once a step
            for i in range(0, len(values), mlflow_run.BATCH):
                self.client.log_batch(self.run_id, metrics=values[i : i + mlflow_run.BATCH])
                self._reached()

    def _drop_written(self, kept: list[_Entry], written) -> list[_Entry]:
        done = [e for e in kept if written(e)]
        self._written(done)
        return [e for e in kept if not written(e)]


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
