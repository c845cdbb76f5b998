"""P1's probe inside raytrain's workers: how long the per-step stop check takes (and, for
P6, every rank's peak memory), plus the check raytrain had before P1 (the "before" arm).

raytrain's check (`raytrain.preemption.StopSignals`): each rank reads its flags locally
(`local`, including Ray's preemption notice from its own train context) and they ride on
the loss all-reduce; rank 0 sends its progress to the control actor without waiting
(`step_done`). The check it replaced ran after every step: rank 0 waited for the control
actor's answer (a Ray RPC), every rank called `ray.train.get_preemption_info()` (a barrier
through Ray Train's synchronization actor), then one more all-reduce. Timings stay in
memory (a perf_counter pair per call) and are written once, when the train function ends.
"""

from __future__ import annotations

import json
import os
import time

_samples: dict[str, list[float]] = {"stop_check_s": [], "preemption_info_s": []}  # per step, per rank


def _timed(fn, key: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _samples[key].append(time.perf_counter() - start)

    return call


def install() -> None:
    from raytrain.train import preemption

    # The loop holds the class; local() looks _local_preemption_info up on the module at each call.
    preemption.StopSignals.local = _timed(preemption.StopSignals.local, "stop_check_s")
    preemption.StopSignals.step_done = _timed(preemption.StopSignals.step_done, "stop_check_s")
    preemption._local_preemption_info = _timed(preemption._local_preemption_info, "preemption_info_s")


def dump(folder: str, rank: int) -> None:
    """The step samples, and this rank's peak memory (P6: every rank's, where MLflow has rank 0's)."""
    import resource

    import torch

    memory = {
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    with open(os.path.join(folder, f"probe-rank{rank}.json"), "w") as f:
        json.dump({**_samples, **memory}, f)


def install_blocking_check() -> None:
    """raytrain's check before P1: blocking, with a barrier and a collective of its own per step."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from raytrain.train import preemption

    def step_done(self, step, step_time, rank):
        flags = 0
        if rank == 0 and self.control is not None:
            flags |= (
                preemption.DRIVER_STOP if ray.get(self.control.step_done.remote(step, step_time), timeout=30) else 0
            )
        if self.check_ray_notice and ray.train.get_preemption_info() is not None:  # the barrier
            flags |= preemption.RAY_NOTICE
        bits = torch.tensor([(flags >> i) & 1 for i in range(3)], dtype=torch.int32)
        dist.all_reduce(bits, op=dist.ReduceOp.MAX)
        self.driver_stop |= bool(int(bits[2]))  # acted on at the next step's agreement

    preemption.StopSignals.step_done = step_done
    preemption._local_preemption_info = lambda: None  # the barrier above replaces it
