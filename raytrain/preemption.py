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
"""

from __future__ import annotations

import os
import threading

SIGTERM, RAY_NOTICE, DRIVER_STOP = 1, 2, 4  # bit flags, summed across ranks on the loss all-reduce
GRACE_ENV = "RAYTRAIN_PREEMPTION_GRACE_S"
_sigterm = threading.Event()


class Preempted(RuntimeError):
    """Raised on every rank after the SIGTERM checkpoint commits: the group restarts from it."""


def install_sigterm_handler() -> None:
    """Ray `worker_process_setup_hook`: runs in each worker's main thread at start-up.

    Ray installs its own SIGTERM handler (exit at once) just after this hook, through
    `ray._private.utils.set_sigterm_handler`; we wrap that call so the handler Ray installs
    first lets the current step and its checkpoint finish, and exits only at the deadline.
    """
    import ray._private.utils as ray_utils

    original = ray_utils.set_sigterm_handler
    grace = float(os.environ.get(GRACE_ENV, "120"))

    def set_graceful(ray_handler):
        def on_sigterm(signum, frame):
            if not _sigterm.is_set():
                _sigterm.set()
                timer = threading.Timer(grace, os._exit, args=(1,))  # hard deadline, like kubelet's SIGKILL
                timer.daemon = True
                timer.start()

        original(on_sigterm)

    ray_utils.set_sigterm_handler = set_graceful


def _local_preemption_info():
    """Ray's preemption notice as this worker sees it, without a collective.

    `ray.train.get_preemption_info()` is a barrier through Ray Train's synchronization actor
    (rank 0's value, broadcast): a Ray round trip every step, measured at 1.7 ms of a 39 ms
    CPU step (benchmarks P1). Ray's PreemptionWatcher marks the notice on *every* worker of
    the group, so each rank reads its own copy and the loss all-reduce agrees on it. Falls
    back to the public call (the same on every rank, so still a valid barrier) if a later
    Ray moves the internal context.
    """
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError):
        import ray.train

        return ray.train.get_preemption_info()


class StopSignals:
    """The three notices, agreed by every rank at no cost to the step.

    Nothing here waits for Ray and nothing adds a collective: each rank's flags ride on the
    loop's loss all-reduce (a SUM, so a flag is set somewhere iff its sum is > 0), then
    `agree` turns the summed flags into the bits every rank acts on at the same step.
    Rank 0 reports progress to the job's control actor without waiting and reads the answer
    of an earlier report once it has arrived, so a driver stop lands a step or two later.
    """

    N_FLAGS = 3

    def __init__(self, control, check_ray_notice: bool = True):
        self.control, self.check_ray_notice = control, check_ray_notice
        self.ray_notice_seen, self.driver_stop = False, False
        self._answer = None  # the control actor's reply to the latest progress report

    def local(self) -> list[float]:
        """This rank's flags, one float per bit, to append to the loss all-reduce."""
        import ray

        flags = SIGTERM if _sigterm.is_set() else 0
        if self._answer is not None and ray.wait([self._answer], timeout=0)[0]:
            try:
                self.driver_stop |= bool(ray.get(self._answer))
            except ray.exceptions.RayError:
                self.control = None  # the driver is gone; training needs no bookkeeping to go on
            self._answer = None
        if self.driver_stop:
            flags |= DRIVER_STOP
        if self.check_ray_notice and not self.ray_notice_seen and _local_preemption_info() is not None:
            flags |= RAY_NOTICE
        return [float((flags >> i) & 1) for i in range(self.N_FLAGS)]

    def agree(self, summed: list[float]) -> int:
        """The flags every rank acts on (0: keep training), from the all-reduced `local()`s."""
        agreed = sum(1 << i for i, v in enumerate(summed) if v > 0)
        self.ray_notice_seen |= bool(agreed & RAY_NOTICE)
        return agreed

    def step_done(self, step: int, step_time: float, rank: int) -> None:
        """Rank 0 tells the control actor (goodput, driver stop) and does not wait."""
        if rank == 0 and self.control is not None and not self.driver_stop:
            import ray

            try:
                self._answer = self.control.step_done.remote(step, step_time)
            except ray.exceptions.RayError:
                self.control = None
