"""A step's host memory and time under an allocator setting, without Ray (2 gloo ranks, spawned):

    SEQ=256 python -m benchmarks.allocator_probe MODEL_DIR lora                     # glibc's defaults
    SEQ=256 MALLOC_MMAP_THRESHOLD_=262144 MALLOC_TRIM_THRESHOLD_=262144 python -m benchmarks.allocator_probe
    MODEL_DIR lora
    SEQ=256 TRIM=1 python -m benchmarks.allocator_probe MODEL_DIR lora   # glibc's malloc_trim(0) after each step

Prints each rank's (resident, peak) MiB after the build and each of 8 `loop.train_step`s (the peak reset before each),
and the median step time of steps 3-8. MODEL_DIR: e.g. benchmarks/.cache/smollm2-135m-shape
(`benchmarks.memory.smollm2_shape`)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu"), str(ROOT)]
import numpy as np  # noqa: E402
import torch  # noqa: E402


def rss() -> tuple[int, int]:
    """(resident, peak resident) MiB of this process, as the product's start-up record reads them."""
    from raytrain.tracking.timeline import host_memory_mb

    return tuple(round(x) for x in host_memory_mb())


def reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from here


def case(rank: int, world: int, device, job_json: str) -> list[dict]:
    """On each spawned rank: build the product's strategy, take 8 steps; every rank's marks."""
    import time

    import mesh_cases
    import torch.distributed as dist

    from raytrain import objectives
    from raytrain.data.batches import micro_batches
    from raytrain.job.plan import RunPlan
    from raytrain.job.spec import JobSpec
    from raytrain.model import modeling
    from raytrain.strategies import build_strategy
    from raytrain.train import loop
    from raytrain.train.preemption import StopSignals

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(job_json)
    modeling.load_model(spec, on_meta=True)  # the model's code imported: the marks measure the model
    marks = {"imports": rss()}
    reset()
    strategy = build_strategy(spec, device, RunPlan.of(spec))
    marks["built"] = rss()
    rows = mesh_cases.global_rows(False, False, 2, seq=spec.data.seq_len)
    rows[:, 0] = np.random.default_rng(0).integers(3, strategy.hf_model.config.vocab_size - 1, rows[:, 0].shape)
    rows[:, 1] = np.where(rows[:, 1] == -100, -100, rows[:, 0])
    batch = micro_batches([mesh_cases._Rows(rows)], [(0, rank)], 1)
    objective, times = objectives.build(spec), []
    for step in range(8):
        start = time.perf_counter()
        reset()
        loop.seed_step(0, step, rank)
        loop.train_step(strategy, objective, batch, 1e-3, StopSignals(None, check_ray_notice=False))
        if os.environ.get("TRIM"):
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        marks[f"step{step + 1}"] = rss()
        times.append(time.perf_counter() - start)
    marks["steady_s"] = round(sorted(times[2:])[len(times[2:]) // 2], 4)
    every = [None] * world
    dist.all_gather_object(every, marks)
    return every


if __name__ == "__main__":
    import local_run

    from benchmarks import allocator_probe
    from raytrain.job.spec import JobSpec

    data = ROOT / "benchmarks" / ".cache" / "base-8000" / "text.jsonl"
    spec = JobSpec.model_validate(
        {
            "name": "probe",
            "model": {"path": sys.argv[1]},
            "data": {"path": str(data), "seq_len": int(os.environ.get("SEQ", 32))},
            "training": {"finetune": sys.argv[2], "global_batch_size": 2, "micro_batch_size": 1, "max_steps": 8},
            "scaling": {"num_workers": 2},
            "checkpoint": {"storage_path": "/tmp/allocator-probe"},
        }
    )
    for rank, marks in enumerate(local_run.spawn(allocator_probe.case, 2, torch.device("cpu"), spec.model_dump_json())):
        print(rank, marks)
