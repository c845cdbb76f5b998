"""The job's control actor: the one piece of state that outlives worker-group restarts
while the driver lives. Workers report progress to it; the driver asks it to stop the job
gracefully (ray job stop, Ctrl-C); at the end it gives the goodput accounting.

It is also the job's lease on its run directory: one job, one driver (`start_actor`).

Workers that start while the driver prepares the token stores wait on it for the driver's word
(`data_ready`): one pending call per rank that returns when the stores are prepared, preparing
failed or a stop was requested, not a poll of the stores and the actor four times a second.

It holds the failure budget's state (`may_start`, `failed`: the decisions are failures.py's) and
the goodput's, and the driver's secrets for the train workers of nodes that lack them (`give`,
which only a holder of the job's capability can use: train/entry.py). It is raytrain's one actor
of a job; beside it run Ray Train's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from raytrain.driver.failures import Attempt, Decision, FailurePolicy, Goodput
from raytrain.errors import JobError
from raytrain.rundir import lease
from raytrain.train.entry import RELAY_TIMEOUT_S


class JobControl:
    """Plain class; `start_actor` runs it as the job's named Ray actor. Its state is what must outlive
    a worker group: the attempts (the failure budget's input: failures.py decides), a stop request,
    the data-ready word, the step times goodput is made of, and the driver's secrets for nodes that
    lack them. The decisions themselves are failures.py's pure functions."""

    def __init__(self, max_failures: int = -1, holder: dict | None = None, window: int = 10_000):
        self.policy = FailurePolicy(max_failures)
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
        self._secrets: dict[str, str] = {}
        self._capability = ""  # what a worker must show to get them (driver/worker_env.py: relay_secrets)
        self._held = asyncio.Event()

    def _wake(self) -> None:
        if self.prepared or self.spent or self.stop_reason:
            self._settled.set()

    def _decide(self, decision: Decision) -> None:
        if decision.stop and self.spent is None:
            self.spent = decision.reason
        self._wake()

    # --- workers (rank 0) ---
    def may_start(self, world_size: int) -> str | None:
        """A new worker group asks before building anything: None (and its attempt is on
        record from here, so a group that dies while loading counts too), or why the job
        must end."""
        self._decide(self.policy.may_start(self.attempts, world_size))
        if self.spent is None:
            resumed = self.attempts[-1].resumed_from if self.attempts else 0  # until the group says
            self.attempts.append(Attempt(world_size, resumed, time.time()))
        return self.spent

    def preempted(self, step: int) -> None:
        """A preemption notice's checkpoint committed at `step`: this attempt's end is not a failure."""
        self.attempts[-1].preempted_at = step

    def failed(self, error: str, retry: bool, transient: bool = False) -> None:
        """A worker's error (retry=False: a job error); the policy says whether the job ends at the
        next group's start."""
        if self.attempts:
            self.attempts[-1].error = error
        self._decide(self.policy.after_error(self.attempts, error, retry, transient))

    async def data_ready(self, timeout_s: float = 60.0) -> bool | None:
        """Every rank, before it opens the token stores: True once the driver said they are prepared,
        False once the job ended first (preparing failed, a verdict, a stop), None if neither came
        within `timeout_s` (ask again: a call of a group that died meanwhile expires so)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout_s)
        if self.prepared:
            return True
        return False if self.spent or self.stop_reason else None

    async def give(self, names: list[str], capability: str) -> dict[str, str]:
        """The driver's secrets of `names`, to a worker that shows the job's capability (only the
        driver's own train workers have it, in their train_loop_config): anyone else who finds this
        named actor gets nothing. A worker that asks before the driver's `hold` waits for it."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._held.wait(), RELAY_TIMEOUT_S)
        if not self._capability or not hmac.compare_digest(capability, self._capability):
            return {}
        return {n: self._secrets[n] for n in names if n in self._secrets}

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

    def hold(self, values: dict[str, str], capability: str) -> None:
        """The driver's secrets, by a method call: never with the actor's creation, whose options
        Ray's dashboard shows."""
        self._secrets, self._capability = dict(values), capability
        self._held.set()

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
        return Goodput.of(self.started, self.settled + sum(self.step_times.values()), self.attempts)

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
