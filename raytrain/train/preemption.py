"""Stopping well: every reason a job must stop soon becomes a checkpoint at a step
boundary that every rank agrees on.

Three notices, one mechanism (flags carried by each step's loss all-reduce):
- SIGTERM to a worker process (spot reclaim, pod deletion): checkpoint, then leave; Ray
  restarts the group from that checkpoint, so no step is lost. A timer kills the process
  at `failure.preemption_grace_s` if the checkpoint cannot finish in time.
- Ray's drain/preemption notice (`ray.train.get_preemption_info`, set by `ray drain-node
  --reason PREEMPTION`, which KubeRay's preStop hook runs): checkpoint once and keep
  going, as Ray recommends; Ray restarts when the node is gone.
- A stop requested on the driver (`ray job stop`, Ctrl-C): checkpoint, then finish cleanly.

And one that must not checkpoint: another driver took the run directory's lease (lease.py). Rank 0
reads it in a thread; every rank stops before its next step, and nothing more is committed.
"""

from __future__ import annotations

import os
import threading

from raytrain import private_apis

SIGTERM, RAY_NOTICE, DRIVER_STOP, FENCED = 1, 2, 4, 8  # bit flags, summed across ranks on the loss all-reduce
_sigterm = threading.Event()


class Preempted(RuntimeError):
    """Raised on every rank after the SIGTERM checkpoint commits: the group restarts from it."""


def install_sigterm_handler(grace_s: float) -> None:
    """Ray `worker_process_setup_hook`: runs in each worker's main thread at start-up.

    Ray installs its own SIGTERM handler (exit at once) just after this hook, through
    `ray._private.utils.set_sigterm_handler`; we wrap that call so the handler Ray installs
    first lets the current step and its checkpoint finish, and exits only at the deadline.
    """

    def on_sigterm(signum, frame):
        if not _sigterm.is_set():
            _sigterm.set()
            timer = threading.Timer(grace_s, os._exit, args=(1,))  # hard deadline, like kubelet's SIGKILL
            timer.daemon = True
            timer.start()

    private_apis.sigterm_handler_for_rays(on_sigterm)


def _local_preemption_info():
    """Ray's preemption notice as this worker sees it, without a collective.

    `ray.train.get_preemption_info()` is a barrier through Ray Train's synchronization actor
    (rank 0's value, broadcast): a Ray round trip every step, measured at 1.7 ms of a 39 ms
    CPU step (benchmarks P1). Ray's PreemptionWatcher marks the notice on *every* worker of
    the group, so each rank reads its own copy and the loss all-reduce agrees on it. Falls
    back to the public call (the same on every rank, so still a valid barrier) if a later
    Ray moves the internal context.
    """
    info = private_apis.local_preemption_info()
    if info is private_apis.MOVED:
        import ray.train

        return ray.train.get_preemption_info()
    return info


class StopSignals:
    """The three notices, agreed by every rank at no cost to the step.

    Nothing here waits for Ray and nothing adds a collective: each rank's flags ride on the
    loop's loss all-reduce (a SUM, so a flag is set somewhere iff its sum is > 0), then
    `agree` turns the summed flags into the bits every rank acts on at the same step.
    Rank 0 reports progress to the job's control actor without waiting and reads the answers
    that have arrived, however late: a slow actor delays a driver stop, it cannot starve it.
    A Ray notice is acted on once per notice: a later, different one (another node drained)
    commits another checkpoint.
    """

    N_FLAGS = 4

    def __init__(self, control, check_ray_notice: bool = True, notices=None, fence=None):
        self.control, self.check_ray_notice = control, check_ray_notice
        self.fence = fence  # rank 0's lease.Fence (None elsewhere, and without a launcher)
        self.notices = notices or _local_preemption_info  # where this rank reads Ray's notice
        self.driver_stop = False
        self._answers: list = []  # the control actor's replies to progress reports not yet read
        self._notice = None  # the notice this rank reported at its last local()
        self._acted_on = None  # the last notice a checkpoint was committed for

    def local(self) -> list[float]:
        """This rank's flags, one float per bit, to append to the loss all-reduce."""
        flags = SIGTERM if _sigterm.is_set() else 0
        if self._answers:  # only with a control actor: a process without Ray (tests/gpu) never imports it
            import ray

            ready, self._answers = ray.wait(self._answers, num_returns=len(self._answers), timeout=0)
            try:
                self.driver_stop |= any(ray.get(ready))
            except ray.exceptions.RayError:
                self.control, self._answers = None, []  # the driver is gone; training needs no bookkeeping to go on
        if self.driver_stop:
            flags |= DRIVER_STOP
        if self.fence is not None and self.fence.stale:
            flags |= FENCED
        self._notice = self.notices() if self.check_ray_notice else None
        if self._notice is not None and self._notice != self._acted_on:
            flags |= RAY_NOTICE
        return [float((flags >> i) & 1) for i in range(self.N_FLAGS)]  # host: Python ints

    def agree(self, summed: list[float]) -> int:
        """The flags every rank acts on (0: keep training), from the all-reduced `local()`s."""
        agreed = sum(1 << i for i, v in enumerate(summed) if v > 0)
        if agreed & RAY_NOTICE and self._notice is not None:
            self._acted_on = self._notice
        return agreed

    def preempted(self, step: int, rank: int, wait: bool) -> None:
        """Rank 0 tells the control actor that a preemption notice's checkpoint committed at
        `step`: the end of this attempt is then no failure. Before leaving (SIGTERM) it waits
        for the actor to have it."""
        if rank == 0 and self.control is not None:
            import ray

            try:
                answer = self.control.preempted.remote(step)
                if wait:
                    ray.get(answer, timeout=10)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # the driver is gone or slow: a restart counts it as a failure, nothing worse

    def step_done(self, step: int, step_time: float, rank: int) -> None:
        """Rank 0 tells the control actor (goodput, driver stop) and does not wait."""
        if rank == 0 and self.control is not None and not self.driver_stop:
            import ray

            try:
                self._answers.append(self.control.step_done.remote(step, step_time))
            except ray.exceptions.RayError:
                self.control = None
