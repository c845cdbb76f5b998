"""Stopping well: every reason a job must stop soon becomes a checkpoint at a step
boundary that every rank agrees on.

Three notices, one mechanism (an all-reduced flag at the end of each step):
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
import signal
import threading

import torch
import torch.distributed as dist

SIGTERM, RAY_NOTICE, DRIVER_STOP = 1, 2, 4  # bit flags, combined across ranks with a max-reduce per bit
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


class StopSignals:
    """Checked once per step on every rank; returns the agreed flags (0: keep training)."""

    def __init__(self, control, device: torch.device, check_ray_notice: bool = True):
        self.control, self.device, self.check_ray_notice = control, device, check_ray_notice
        self.ray_notice_seen = False

    def check(self, step: int, step_time: float, rank: int) -> int:
        import ray
        import ray.train

        flags = SIGTERM if _sigterm.is_set() else 0
        if rank == 0 and self.control is not None:
            try:
                if ray.get(self.control.step_done.remote(step, step_time), timeout=30):
                    flags |= DRIVER_STOP
            except (ray.exceptions.RayError, TimeoutError):
                self.control = None  # the driver is gone; training needs no bookkeeping to go on
        if self.check_ray_notice and not self.ray_notice_seen:
            if ray.train.get_preemption_info() is not None:  # a barrier: every rank calls it each step
                flags |= RAY_NOTICE
        bits = torch.tensor([(flags >> i) & 1 for i in range(3)], dtype=torch.int32, device=self.device)
        dist.all_reduce(bits, op=dist.ReduceOp.MAX)
        agreed = sum(int(b) << i for i, b in enumerate(bits.tolist()))
        self.ray_notice_seen |= bool(agreed & RAY_NOTICE)
        return agreed
