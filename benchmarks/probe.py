"""P1's probe inside raytrain's workers: how long the per-step stop check takes (and, for
P6, every rank's peak memory), plus P1's prototype of a cheaper check.

The check (`raytrain.preemption.StopSignals.check`) runs after every step, outside the
loop's own `step_time_s`: rank 0 asks the job's control actor (a Ray RPC), every rank calls
`ray.train.get_preemption_info()` (a barrier through Ray Train's synchronization actor), then
one all-reduce. The bare script has none of it, so it is the first suspect when raytrain's
step period exceeds the bare one. Timings stay in memory (a perf_counter pair per call) and
are written once, when the worker's train function ends.
"""

from __future__ import annotations

import json
import os
import time

_samples: dict[str, list[float]] = {"stop_check_s": [], "preemption_info_s": []}


def _timed(fn, key: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _samples[key].append(time.perf_counter() - start)
    return call


def install() -> None:
    import ray.train

    from raytrain import preemption

    # The loop holds the class, and check() looks get_preemption_info up on ray.train at each call.
    preemption.StopSignals.check = _timed(preemption.StopSignals.check, "stop_check_s")
    ray.train.get_preemption_info = _timed(ray.train.get_preemption_info, "preemption_info_s")


def dump(folder: str, rank: int) -> None:
    """The step samples, and this rank's peak memory (P6: every rank's, where MLflow has rank 0's)."""
    import resource

    import torch

    memory = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    with open(os.path.join(folder, f"probe-rank{rank}.json"), "w") as f:
        json.dump({**_samples, **memory}, f)


def install_fast_check() -> None:
    """The prototype fix for the stop check: the same three notices, with no Ray round trip
    and no collective of its own on the step path.

    - Rank 0 sends its progress to the control actor without waiting, and reads the answer
      to the previous call if it is in (the stop reason is sticky: a stop comes a step later).
    - Each rank reads Ray's preemption notice from its own worker context (Ray marks every
      worker of the group) instead of the per-step barrier through Ray Train's
      synchronization actor.
    - The flags ride on the loop's loss all-reduce (SUM: a flag is set somewhere iff its sum
      is > 0), so the step has the same two collectives as the bare script; check() returns
      what that all-reduce agreed. The loop's second `_all_reduce` call of a step is the loss.
    """
    import ray
    import torch
    import torch.distributed as dist
    from ray.train.v2._internal.execution.context import get_train_context

    from raytrain import loop, preemption

    state = {"signals": None, "calls": 0, "agreed": 0, "stop_answer": None, "stop_seen": False}
    original_init = preemption.StopSignals.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        state["signals"] = self  # the loop's one instance: its control handle and notice flag

    def local_flags() -> int:
        signals = state["signals"]
        flags = preemption.SIGTERM if preemption._sigterm.is_set() else 0
        answer = state["stop_answer"]
        if answer is not None and not state["stop_seen"] and ray.wait([answer], timeout=0)[0]:
            state["stop_seen"] = bool(ray.get(answer))
        if state["stop_seen"]:
            flags |= preemption.DRIVER_STOP
        if signals is not None and signals.check_ray_notice and not signals.ray_notice_seen:
            if get_train_context().preemption_context.preemption_info is not None:
                flags |= preemption.RAY_NOTICE
        return flags

    def all_reduce(value: float, device) -> float:
        state["calls"] += 1
        if state["calls"] != 2:
            t = torch.tensor([value], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            return float(t.item())
        flags = local_flags()
        t = torch.tensor([value] + [float((flags >> i) & 1) for i in range(3)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        state["agreed"] = sum(1 << i for i in range(3) if float(t[1 + i]) > 0)
        return float(t[0])

    def check(self, step, step_time, rank):
        if rank == 0 and self.control is not None and not state["stop_seen"]:
            state["stop_answer"] = self.control.step_done.remote(step, step_time)
        agreed, state["calls"] = state["agreed"], 0  # the next step starts counting its all-reduces
        self.ray_notice_seen |= bool(agreed & preemption.RAY_NOTICE)
        return agreed

    preemption.StopSignals.__init__ = init
    preemption.StopSignals.check = check
    loop._all_reduce = all_reduce
