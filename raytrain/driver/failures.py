"""The failure budget and goodput, as decisions over a job's attempts: pure, tested without Ray.

Ray Train restarts the worker group whenever it breaks (`FailureConfig(max_failures=-1)`); what
counts against `failure.max_failures` is raytrain's decision, made when a new group asks to start
(`FailurePolicy.may_start`). An attempt that ended after a preemption notice committed its checkpoint
(SIGTERM, a Ray drain) was a preemption; one followed by a larger group was a resize: neither counts.
A job error (bad input) is never worth a retry, nor is an error that came twice in a row at the same
step from the same checkpoint (`FailurePolicy.after_error`), unless it is transient (storage, the
network, a collective: errors.transient), which a restart may well mend.

Goodput: a step counts as productive once it is in the final lineage of the run (it was never
rolled back). Per failure: the steps lost (reached but not checkpointed) and the recovery time (last
progress before the failure -> first step finished after it)."""

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


@dataclass(frozen=True)
class Decision:
    """What a failure (or a new group) means for the job: go on, or stop with `reason`."""

    stop: bool
    reason: str | None = None


GO_ON = Decision(False)


@dataclass(frozen=True)
class FailurePolicy:
    max_failures: int  # -1: no limit

    def may_start(self, attempts: list[Attempt], world_size: int) -> Decision:
        """A new worker group of `world_size` asks to start after `attempts`."""
        worlds = [a.world_size for a in attempts[1:]] + [world_size]
        failures = [a for a, after in zip(attempts, worlds) if a.preempted_at is None and after <= a.world_size]
        if 0 <= self.max_failures < len(failures):
            last = next((a.error for a in reversed(attempts) if a.error), None)
            return Decision(
                True,
                f"{len(failures)} worker failures (preemptions and resizes not counted) exceed "
                f"failure.max_failures={self.max_failures}"
                + (f"; the last: {last}" if last else "")
                + "; the latest committed checkpoint is kept: raise failure.max_failures and run again to resume",
            )
        return GO_ON

    def after_error(self, attempts: list[Attempt], error: str, retry: bool, transient: bool = False) -> Decision:
        """The latest attempt (already recording `error`) failed: a job error (retry=False) stops the
        job, and so does the same error twice in a row at the same step from the same checkpoint."""
        if not retry:
            return Decision(True, error)
        if transient or len(attempts) < 2:
            return GO_ON
        before, now = attempts[-2], attempts[-1]
        repeated = (before.error, before.resumed_from, before.last_step) == (error, now.resumed_from, now.last_step)
        if not repeated or before.preempted_at is not None:
            return GO_ON
        where = f"in step {now.last_step + 1}" if now.first_step_at or now.last_step else "before the first step"
        start = f"step {now.resumed_from}" if now.resumed_from else "the start"
        return Decision(
            True,
            f"the same error twice {where}, each time from {start}: {error}. A restart repeats it: fix its cause, "
            "then run the job again (it resumes from the latest committed checkpoint, which is kept)",
        )


def failures(attempts: list[Attempt], now: float | None = None) -> list[dict]:
    """Each restart: what it was (failure, preemption, resize), the steps it lost and its recovery time."""
    now = time.time() if now is None else now
    out = []
    for i, (before, after) in enumerate(zip(attempts, attempts[1:])):
        failed_at = before.last_step_at or before.started_at
        # Recovered at the next attempt's first step; if that attempt died before one, this
        # recovery ends where the next one's begins (its start), so no second counts twice.
        recovered_at = after.first_step_at or (after.started_at if i + 2 < len(attempts) else now)
        kind = (
            "preemption"
            if before.preempted_at is not None
            else "resize"
            if after.world_size > before.world_size
            else "failure"
        )
        out.append(
            {
                "kind": kind,
                "steps_lost": max(0, before.last_step - after.resumed_from),
                "recovery_s": round(recovered_at - failed_at, 3),
                "world_size_before": before.world_size,
                "world_size_after": after.world_size,
                "resumed_from": after.resumed_from,
            }
        )
    return out


@dataclass
class Goodput:
    wall_s: float
    productive_s: float  # time spent on steps that survive in the final model
    wasted_s: float
    failures: list[dict] = field(default_factory=list)  # per restart: steps_lost, recovery_s, world sizes

    @classmethod
    def of(cls, started: float, productive_s: float, attempts: list[Attempt]) -> dict:
        wall = time.time() - started
        return asdict(
            cls(round(wall, 3), round(productive_s, 3), round(max(0.0, wall - productive_s), 3), failures(attempts))
        )
