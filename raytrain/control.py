"""The job's control actor: the one piece of state that outlives worker-group restarts
while the driver lives. Workers report progress to it; the driver asks it to stop the job
gracefully (ray job stop, Ctrl-C); at the end it gives the goodput accounting.

It also owns the failure budget (`failure.max_failures`): Ray restarts the worker group
whenever it breaks, and each new group asks `may_start` first. An attempt that ended after a
preemption notice committed its checkpoint (SIGTERM, a Ray drain) was a preemption, one
followed by a larger group was a resize: neither counts. A job error (bad input) is never
worth a retry: the next group stops at once with its message.

Goodput: a step counts as productive once it is in the final lineage of the run (it was
never rolled back). Per failure: the steps lost (reached but not checkpointed) and the
recovery time (last progress before the failure -> first step finished after it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


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

    def __init__(self, max_failures: int = -1):
        self.max_failures = max_failures
        self.spent: str | None = None  # why the job must stop instead of restarting
        self.started = time.time()
        self.stop_reason: str | None = None
        self.attempts: list[Attempt] = []
        self.step_times: dict[int, float] = {}  # step -> seconds, latest attempt wins (rolled-back steps overwritten)

    # --- workers (rank 0) ---
    def may_start(self, world_size: int) -> str | None:
        """A new worker group asks before building anything: None (and its attempt is on
        record from here, so a group that dies while loading counts too), or why the job
        must end."""
        worlds = [a.world_size for a in self.attempts[1:]] + [world_size]
        failures = [a for a, next_world in zip(self.attempts, worlds)
                    if a.preempted_at is None and next_world <= a.world_size]
        last = next((a.error for a in reversed(self.attempts) if a.error), None)
        if self.spent is None and 0 <= self.max_failures < len(failures):
            self.spent = (f"{len(failures)} worker failures (preemptions and resizes not counted) exceed "
                          f"failure.max_failures={self.max_failures}" + (f"; the last: {last}" if last else "") +
                          "; the latest committed checkpoint is kept: raise failure.max_failures and run again to resume")
        if self.spent is None:
            resumed = self.attempts[-1].resumed_from if self.attempts else 0  # until the group says
            self.attempts.append(Attempt(world_size, resumed, time.time()))
        return self.spent

    def preempted(self, step: int) -> None:
        """A preemption notice's checkpoint committed at `step`: this attempt's end is not a failure."""
        self.attempts[-1].preempted_at = step

    def failed(self, error: str, retry: bool) -> None:
        """A worker's error; a job error (retry=False) ends the job at the next group's start."""
        if self.attempts:
            self.attempts[-1].error = error
        if not retry:
            self.spent = error

    def attempt_started(self, world_size: int, resumed_from: int) -> int:
        """The group restored its checkpoint (or starts fresh) and is about to train."""
        if not self.attempts:  # workers run without `may_start` (not through the launcher)
            self.attempts.append(Attempt(world_size, resumed_from, time.time()))
        self.attempts[-1].resumed_from = resumed_from
        for step in [s for s in self.step_times if s > resumed_from]:
            del self.step_times[step]  # rolled back: not part of the final lineage
        return len(self.attempts)

    def step_done(self, step: int, step_time: float) -> str | None:
        """Record progress; returns a stop reason if the driver asked the job to stop."""
        now = time.time()
        attempt = self.attempts[-1]
        attempt.first_step_at = attempt.first_step_at or now
        attempt.last_step, attempt.last_step_at = step, now
        self.step_times[step] = step_time
        return self.stop_reason

    # --- driver ---
    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def stop_requested(self) -> str | None:
        return self.stop_reason

    def verdict(self) -> str | None:
        """Why the job ended without finishing (the failure budget, a job error), or None."""
        return self.spent

    def goodput(self) -> dict:
        wall = time.time() - self.started
        productive = sum(self.step_times.values())
        failures = []
        for i, (before, after) in enumerate(zip(self.attempts, self.attempts[1:])):
            failed_at = before.last_step_at or before.started_at
            # Recovered at the next attempt's first step; if that attempt died before one, this
            # recovery ends where the next one's begins (its start), so no second counts twice.
            recovered_at = after.first_step_at or (after.started_at if i + 2 < len(self.attempts) else time.time())
            kind = ("preemption" if before.preempted_at is not None else
                    "resize" if after.world_size > before.world_size else "failure")
            failures.append({
                "kind": kind,
                "steps_lost": max(0, before.last_step - after.resumed_from),
                "recovery_s": round(recovered_at - failed_at, 3),
                "world_size_before": before.world_size, "world_size_after": after.world_size,
                "resumed_from": after.resumed_from,
            })
        return asdict(Goodput(round(wall, 3), round(productive, 3), round(max(0.0, wall - productive), 3), failures))

    def attempts_summary(self) -> list[dict]:
        return [asdict(a) for a in self.attempts]


def actor_name(run_dir: str) -> str:
    return "raytrain-control:" + run_dir


def start_actor(run_dir: str, max_failures: int = -1):
    """Driver: the named control actor of this job (replaces a stale one of a dead driver)."""
    import ray

    name = actor_name(run_dir)
    try:
        ray.kill(ray.get_actor(name))
    except ValueError:
        pass
    # Pinned to the driver's node: it must not die with a spot worker node it happened to land on.
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(JobControl).options(name=name, scheduling_strategy=here).remote(max_failures)


def find_actor(run_dir: str):
    """Workers: the job's control actor, or None when run without the launcher."""
    import ray

    try:
        return ray.get_actor(actor_name(run_dir))
    except ValueError:
        return None
