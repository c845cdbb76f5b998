"""The job's control actor: the one piece of state that outlives worker-group restarts
while the driver lives. Workers report progress to it; the driver asks it to stop the job
gracefully (ray job stop, Ctrl-C); at the end it gives the goodput accounting.

It is also the job's lease on its run directory: one job, one driver (`start_actor`).

Workers that start while the driver prepares the token stores wait on it for the driver's word
(`data_ready`): one pending call per rank that returns when the stores are prepared, preparing
failed or a stop was requested, not a poll of the stores and the actor four times a second.

It owns the failure budget (`failure.max_failures`): Ray restarts the worker group
whenever it breaks, and each new group asks `may_start` first. An attempt that ended after a
preemption notice committed its checkpoint (SIGTERM, a Ray drain) was a preemption, one
followed by a larger group was a resize: neither counts. A job error (bad input) is never
worth a retry: the next group stops at once with its message; nor is an error that came twice in
a row at the same step from the same checkpoint (`failed`).

Goodput: a step counts as productive once it is in the final lineage of the run (it was
never rolled back). Per failure: the steps lost (reached but not checkpointed) and the
recovery time (last progress before the failure -> first step finished after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field

from raytrain.errors import JobError
from raytrain.rundir import lease


@dataclass
class Attempt:
    world_size: int
    resumed_from: int
    started_at: float
    first_step_at: float | None = None
    last_step: int = 0
    last_step_at: float | None = None
    preempted_at: int | None = None  # step whose checkpoint a preemption notice committed
    error: str | None = None  # what ended it, as the worker said it


@dataclass
class Goodput:
    wall_s: float
    productive_s: float  # time spent on steps that survive in the final model
    wasted_s: float
    failures: list[dict] = field(default_factory=list)  # per restart: steps_lost, recovery_s, world sizes


class JobControl:
    """Plain class; `actor_for(run_name)` runs it as a named Ray actor."""

    def __init__(self, max_failures: int = -1, holder: dict | None = None, window: int = 10_000):
        self.max_failures = max_failures
        self.holder = holder or {}  # the driver that owns the run directory: who a second submit is told of
        self.spent: str | None = None  # why the job must stop instead of restarting
        self.started = time.time()
        self.stop_reason: str | None = None
        self.attempts: list[Attempt] = []
        # Productive seconds (goodput): the step times of the steps the run keeps. A restart rolls back
        # to a checkpoint, never further than `window` steps (every_n_steps x (keep_last + 1)), so only
        # the last `window` steps are kept one by one; older ones are folded into `settled`.
        self.step_times: dict[int, float] = {}  # step -> seconds, latest attempt wins (rolled-back steps overwritten)
        self.settled, self.window, self.top = 0.0, window, 0
        self.prepared = False  # the driver has prepared the token stores (it stays so for every later group)
        self._settled = asyncio.Event()  # set once workers need not wait for the data: prepared, a verdict or a stop

    def _wake(self) -> None:
        if self.prepared or self.spent or self.stop_reason:
            self._settled.set()

    # --- workers (rank 0) ---
    def may_start(self, world_size: int) -> str | None:
        """A new worker group asks before building anything: None (and its attempt is on
        record from here, so a group that dies while loading counts too), or why the job
        must end."""
        worlds = [a.world_size for a in self.attempts[1:]] + [world_size]
        failures = [
            a for a, next_world in zip(self.attempts, worlds) if a.preempted_at is None and next_world <= a.world_size
        ]
        last = next((a.error for a in reversed(self.attempts) if a.error), None)
        if self.spent is None and 0 <= self.max_failures < len(failures):
            self.spent = (
                f"{len(failures)} worker failures (preemptions and resizes not counted) exceed "
                f"failure.max_failures={self.max_failures}"
                + (f"; the last: {last}" if last else "")
                + "; the latest committed checkpoint is kept: raise failure.max_failures and run again to resume"
            )
        if self.spent is None:
            resumed = self.attempts[-1].resumed_from if self.attempts else 0  # until the group says
            self.attempts.append(Attempt(world_size, resumed, time.time()))
        self._wake()
        return self.spent

    def preempted(self, step: int) -> None:
        """A preemption notice's checkpoint committed at `step`: this attempt's end is not a failure."""
        self.attempts[-1].preempted_at = step

    def failed(self, error: str, retry: bool, transient: bool = False) -> None:
        """A worker's error; a job error (retry=False) ends the job at the next group's start, and so
        does the same error twice in a row at the same step from the same checkpoint: a restart
        repeats what failed (a bug, a combination that cannot run), it does not mend it. Not an
        error of storage, the network or a collective (`transient`, errors.transient): a restart
        may well mend those, within failure.max_failures."""
        if self.attempts:
            self.attempts[-1].error = error
        if retry and not transient and len(self.attempts) >= 2:
            before, now = self.attempts[-2], self.attempts[-1]
            if (before.error, before.resumed_from, before.last_step) == (
                error,
                now.resumed_from,
                now.last_step,
            ) and before.preempted_at is None:
                where = (
                    f"in step {now.last_step + 1}" if now.first_step_at or now.last_step else "before the first step"
                )
                retry, error = (
                    False,
                    (
                        f"the same error twice {where}, each time from "
                        f"{f'step {now.resumed_from}' if now.resumed_from else 'the start'}: {error}. "
                        "A restart repeats it: fix its cause, then run the job again (it resumes from "
                        "the latest committed checkpoint, which is kept)"
                    ),
                )
        if not retry:
            self.spent = error
            self._wake()

    async def data_ready(self, timeout_s: float = 60.0) -> bool | None:
        """Every rank, before it opens the token stores: True once the driver said they are prepared,
        False once the job ended first (preparing failed, a verdict, a stop), None if neither came
        within `timeout_s` (ask again: a call of a group that died meanwhile expires so)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout_s)
        if self.prepared:
            return True
        return False if self.spent or self.stop_reason else None

    def attempt_started(self, world_size: int, resumed_from: int) -> int:
        """The group restored its checkpoint (or starts fresh) and is about to train."""
        if not self.attempts:  # workers run without `may_start` (not through the launcher)
            self.attempts.append(Attempt(world_size, resumed_from, time.time()))
        self.attempts[-1].resumed_from = resumed_from
        for step in [s for s in self.step_times if s > resumed_from]:
            del self.step_times[step]  # rolled back: not part of the final lineage
        self.top = resumed_from
        return len(self.attempts)

    def step_done(self, step: int, step_time: float) -> str | None:
        """Record progress; returns a stop reason if the driver asked the job to stop."""
        now = time.time()
        attempt = self.attempts[-1]
        attempt.first_step_at = attempt.first_step_at or now
        if step >= attempt.last_step:  # an asyncio actor need not run one caller's calls in their order
            attempt.last_step, attempt.last_step_at = step, now
        self.step_times[step] = step_time
        self.top = max(self.top, step)
        while self.step_times and next(iter(self.step_times)) <= self.top - self.window:  # O(1) a step
            self.settled += self.step_times.pop(next(iter(self.step_times)))
        return self.stop_reason

    # --- driver ---
    def owner(self) -> dict:
        return self.holder

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self._wake()

    def data_prepared(self) -> None:
        """Every token store of the job is prepared: waiting workers go on, later groups do not wait."""
        self.prepared = True
        self._wake()

    def stop_requested(self) -> str | None:
        return self.stop_reason

    def verdict(self) -> str | None:
        """Why the job ended without finishing (the failure budget, a job error), or None."""
        return self.spent

    def goodput(self) -> dict:
        wall = time.time() - self.started
        productive = self.settled + sum(self.step_times.values())
        failures = []
        for i, (before, after) in enumerate(zip(self.attempts, self.attempts[1:])):
            failed_at = before.last_step_at or before.started_at
            # Recovered at the next attempt's first step; if that attempt died before one, this
            # recovery ends where the next one's begins (its start), so no second counts twice.
            recovered_at = after.first_step_at or (after.started_at if i + 2 < len(self.attempts) else time.time())
            kind = (
                "preemption"
                if before.preempted_at is not None
                else "resize"
                if after.world_size > before.world_size
                else "failure"
            )
            failures.append(
                {
                    "kind": kind,
                    "steps_lost": max(0, before.last_step - after.resumed_from),
                    "recovery_s": round(recovered_at - failed_at, 3),
                    "world_size_before": before.world_size,
                    "world_size_after": after.world_size,
                    "resumed_from": after.resumed_from,
                }
            )
        return asdict(Goodput(round(wall, 3), round(productive, 3), round(max(0.0, wall - productive), 3), failures))

    def attempts_summary(self) -> list[dict]:
        return [asdict(a) for a in self.attempts]


NAMESPACE = "raytrain"  # every driver's: a job's own (anonymous) namespace would hide it from a second driver
MAX_CALLS = 100_000  # the control actor's concurrent calls: more than a job's ranks ever are
TAKEOVER_WAIT_S = 600  # how long --takeover waits for the holder to checkpoint and end before killing its actor


def actor_name(run_dir: str) -> str:
    return "raytrain-control:" + run_dir


def driver_identity() -> dict:
    """Who this driver is, as a second submit of the same job is told."""
    import ray

    config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")  # set for `ray job submit`'s entrypoint
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job_id": ray.get_runtime_context().get_job_id(),
        "submission_id": config.get("metadata", {}).get("job_submission_id"),
        "since": time.time(),
    }


@dataclass
class Held:
    """A driver's hold on its run directory: the control actor (the lock within its Ray cluster) and
    the lease in storage (lease.py: across clusters), renewed while the job runs."""

    actor: object
    token: str  # the lease's generation:token, signed into the run plan for the workers' fence
    renewal: lease.Renewal

    def taken_over(self, run_dir: str) -> bool:
        """Another driver holds the run directory's lease now: the run, its MLflow run included, is its."""
        try:
            holder = lease.read(run_dir)
        except JobError:  # unreadable: not known to be taken
            return False
        return holder is not None and holder.get("token") != self.token


def start_actor(run_dir: str, max_failures: int = -1, takeover: bool = False, window: int = 10_000) -> Held:
    """Driver: the named control actor of this job, which is its lock on the run directory within
    its Ray cluster, and the lease in storage, which is it across clusters (lease.py).
    Ray creates a named actor once, so a second driver of the same run directory is refused here,
    at once, naming the first; with `takeover` it asks the first to checkpoint and stop (as `ray
    job stop` would) and takes its place. The actor is not detached: a driver that dies takes it
    along (Ray removes it within a second), so a resubmit after a crash goes ahead. A holder on
    another cluster is refused by the lease, or fenced with `takeover`."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    # Pinned to the driver's node: it must not die with a spot worker node it happened to land on.
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name, me, asked = actor_name(run_dir), driver_identity(), takeover
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    # An asyncio actor (data_ready awaits): its methods take turns on one event loop. Every rank's
    # data_ready is pending at once, so its slots must outnumber the ranks, or the driver's calls
    # (data_prepared among them) would queue behind the waits they end.
    make = ray.remote(num_cpus=0, max_concurrency=MAX_CALLS)(JobControl).options(
        name=name, namespace=NAMESPACE, scheduling_strategy=here
    )
    for _ in range(20):
        try:
            actor = make.remote(max_failures, me, window)
        except ValueError:  # the name is taken: a live driver holds the run directory (or a dead one's actor is going)
            pass
        else:
            try:
                token = lease.acquire(run_dir, me, cluster_identity(), asked)
            except BaseException:  # held elsewhere, or the run directory cannot be written: give the lock back
                ray.kill(actor)
                raise
            return Held(actor, token, lease.Renewal(run_dir, token))
        try:
            holder_actor = ray.get_actor(name, namespace=NAMESPACE)
            holder = ray.get(holder_actor.owner.remote(), timeout=10)
        except (ValueError, RayActorError, GetTimeoutError):  # it went meanwhile: try again
            time.sleep(0.5)
            continue
        if not takeover:
            raise JobError(
                f"run directory {run_dir} is in use by another driver of this job: {lease.describe(holder)}. "
                f"Wait for it, stop it with {lease.how_to_stop(holder)}, or run with --takeover to have it "
                "checkpoint and stop and continue the run here"
            )
        print(
            f"[raytrain] --takeover: asking {lease.describe(holder)} to checkpoint and stop; this driver continues "
            f"the run",
            flush=True,
        )
        holder_actor.request_stop.remote(f"taken over by {lease.describe(me)}")
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while time.monotonic() < deadline and _exists(name):
            time.sleep(1)
        if _exists(name):  # it does not stop: the lease's new generation fences its workers
            ray.kill(holder_actor)
        takeover = False  # once
    raise JobError(f"could not take the run directory {run_dir}'s lease (its control actor {name} keeps coming back)")


def cluster_identity() -> str:
    """This Ray cluster instance: its GCS address (which two clusters on pod or bridge networks can
    share) and its session, which names one start of one cluster."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_session_name()}"


def release(run_dir: str, held: Held) -> None:
    """Driver, at its end: the run directory is free, its control actor gone."""
    import ray

    held.renewal.release()
    ray.kill(held.actor)


def _exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def find_actor(run_dir: str):
    """Workers: the job's control actor, or None when run without the launcher."""
    import ray

    try:
        return ray.get_actor(actor_name(run_dir), namespace=NAMESPACE)
    except ValueError:
        return None
