"""What each Ray Train worker runs: re-validate the spec, build, restore, fit, export."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from raytrain import allocator, private_apis
from raytrain.data.batches import open_data
from raytrain.errors import transient, user_message
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.model import hub
from raytrain.rundir import metrics_backlog, storage
from raytrain.rundir.checkpoints import TrainState
from raytrain.rundir.job_file import verify_plan
from raytrain.strategies import build_strategy
from raytrain.tracking.step_metrics import StepLogger
from raytrain.tracking.timeline import STEADY_AFTER, Timeline, host_memory_mb
from raytrain.train import checkpoint, loop, worker_launch
from raytrain.train.preemption import Preempted


def train_func(config: dict) -> None:
    import ray.train

    # The job and the driver's decisions, as the driver signed them for the run directory: a worker
    # acts on nothing that crossed the wire unsigned (model.path, trust_remote_code, ...).
    job_control = config.get("control")  # the driver's control actor; None without a driver (tests, tools)
    try:
        spec, plan = verify_plan(config["plan"])
    except Exception as exc:  # nothing a restart mends (a tampered plan, a rule this side refuses): the job ends
        if job_control is None:
            raise
        said = user_message(exc) or " ".join(str(exc).split())
        ray.get(job_control.failed.remote(f"the job did not validate on a worker: {said}", retry=False))
        return  # as a spent verdict's group does (below): the driver says why, a restart would repeat it
    timeline = Timeline(**config["timeline"])
    timeline.mark("workers")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = torch.device(f"cuda:{ctx.get_local_rank()}") if spec.scaling.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # Ray sets OMP_NUM_THREADS to the worker's CPU share, but torch sized its thread pool
        # from the core count when it was imported: 2 threads per rank on 2 cores oversubscribe
        # them (P1 measured it). Size the pool as torchrun's ranks get it.
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))

    verdict = [ray.get(job_control.may_start.remote(world)) if rank == 0 and job_control else None]
    dist.broadcast_object_list(verdict, src=0)  # every rank returns, or none does
    if verdict[0]:
        if rank == 0:
            print(f"[raytrain] not restarting: {verdict[0]}", file=sys.stdout, flush=True)
        return
    if rank == 0:
        for line in private_apis.untested():  # another stack than the tested one: said at each attempt's start
            print(f"[raytrain] {line}", file=sys.stdout, flush=True)
    try:
        _train(spec, plan, config, rank, world, device, job_control, timeline)
    except Preempted:
        raise
    except Exception as exc:  # the control actor keeps what ended this attempt for the job's last word
        if job_control is not None:
            message = user_message(exc)
            last_line = (str(exc).strip().splitlines() or [""])[-1]
            job_control.failed.remote(
                message or f"{type(exc).__name__}: {last_line}", retry=message is None, transient=transient(exc)
            )
        raise


def _train(
    spec: JobSpec, plan: RunPlan, config: dict, rank: int, world: int, device, job_control, timeline: Timeline
) -> None:
    import ray

    strategy = build_strategy(spec, device, plan, on_phase=timeline.mark)
    timeline.mark("model")
    state = checkpoint.restore(strategy) or TrainState(model_commit=spec.model.revision)  # pinned by the driver
    timeline.mark("restored")
    resumed_from = state.step
    state.world_size, state.run_id = world, config["run_id"]
    logger = StepLogger(spec, config["run_id"]) if rank == 0 else None
    attempt = 0  # rank 0 learns it from the control actor
    if rank == 0:  # what trains, per group (attention, dense MLP, experts, router, ...), as peft built it
        trains = strategy.adapter_line()
        print(f"[raytrain] trains: {trains}", file=sys.stdout, flush=True)
        logger.set_tags({"raytrain.adapters": trains})
        if (
            resumed_from
        ):  # the restored checkpoint's steps (and the backlog's), if the last attempt died before logging them
            logger.log_missing(metrics_backlog.unwritten(spec.run_dir, state))
        attempt = ray.get(job_control.attempt_started.remote(world, resumed_from)) if job_control else 1
        logger.set_tags({f"raytrain.attempt.{attempt}": f"world_size={world} resumed_from_step={resumed_from}"})
        if resumed_from:
            logger.log(resumed_from, {"restarts": attempt - 1})
            print(
                f"[raytrain] attempt {attempt}: resumed at step {resumed_from} ({state.data.consumed:,} rows "
                f"consumed) with {world} workers",
                file=sys.stdout,
                flush=True,
            )

    if not _data_ready(job_control, device):
        return  # preparing the data failed (the driver says why) or the job was stopped first
    batches, eval_batches, key = open_data(spec, plan, rank, world, state.data)
    state.require_same_data(key, f"the checkpoint at step {state.step}")
    state.bad_rows = sum(s.bad_rows for s in batches.stores)
    timeline.mark("data")
    # A row's sp x tp ranks all read it: the first of them records it, so each row is logged once.
    sample_log = _sample_logger(
        spec.data.sample_log, rank, world, batches.stores, records_rows=rank % plan.mesh(world).row_ranks == 0
    )
    on_step = _first_step_reporter(timeline, logger, attempt, sample_log, strategy.kernel_line())
    state = loop.fit(spec, strategy, batches, state, logger, job_control, on_step=on_step, eval_batches=eval_batches)

    if spec.checkpoint.export_final and not state.stopped:
        export(spec, strategy, logger)
    if logger:  # a moment for the last steps; what is still unwritten is in the last checkpoint for the driver
        logger.flush(timeout_s=10)


def export(spec: JobSpec, strategy, logger) -> None:
    """Every rank writes its part of the final model (a full model's weights files are spread
    over the ranks) and uploads it; rank 0 uploads raytrain.json last, once all parts are there."""
    # The tokenizer only goes into the export, which rank 0 writes: loaded there, at the end,
    # not on every rank before step 1 (1.3 s of a tiny model's start-up on 2 cores).
    tokenizer = hub.load_tokenizer(spec) if strategy.rank == 0 else None
    final = spec.run_dir + "/final_model"
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
        strategy.export(tmp, tokenizer)
        marker = os.path.join(tmp, "raytrain.json")  # rank 0's: uploaded last, once the folder is complete
        meta = open(marker).read() if os.path.exists(marker) else None
        if meta is not None:
            os.unlink(marker)
        if os.listdir(tmp):
            storage.upload_dir(tmp, final)
    dist.barrier()
    if meta is not None:
        storage.write_text(final + "/raytrain.json", meta)
        logger.set_tags({"raytrain.final_model": final})
        if spec.tracking.log_model:  # asked for a second copy, in MLflow's artifact store
            with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
                storage.download_dir(final, tmp)
                logger.log_model_dir(tmp)
        print(f"[raytrain] exported final model to {final}", file=sys.stdout, flush=True)


def _data_ready(job_control, device) -> bool:
    """Wait for the driver's word (on the control actor) that the token stores it prepares while
    this group starts are ready: one pending call per rank, not a poll. False on every rank if
    any rank saw the job end first (a failed prepare, a stop): all return."""
    import ray

    ready = None if job_control is not None else True  # without the launcher: the stores are there
    while ready is None:  # None: a minute went by (the call expires so on the actor if this rank dies)
        ready = ray.get(job_control.data_ready.remote())
    flag = torch.tensor([int(ready)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())  # host: once, before training


def _first_step_reporter(timeline: Timeline, logger, attempt: int, then, kernels: str = ""):
    """After this attempt's first step, rank 0 (attempt > 0) says where its start-up went: the
    phases' times, and the busiest rank's host memory at each (every rank's, gathered); after
    its STEADY_AFTER-th step, the busiest rank's memory once the steps are steady. At step 1 it
    also says which host allocator the workers run, as their own mappings show (allocator.py), and
    which kernels run the step (`Strategy.kernel_line`: the attention kernel, the loss, compiled blocks)."""
    steps, host_allocator = [0], allocator.in_use()  # a process's allocator is fixed at its start
    began = "forked" if worker_launch.forked() else "fresh"  # from the job's fork server, or as Ray starts workers

    def on_step(state, batch) -> None:
        steps[0] += 1
        if steps[0] in (1, STEADY_AFTER):
            phase = "step_1" if steps[0] == 1 else "steps"
            timeline.mark(phase)
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, (timeline.memory, host_allocator, began))  # twice an attempt
            timeline.with_busiest([memory for memory, _, _ in every_rank])
            if attempt:
                if phase == "step_1":
                    allocators = ",".join(sorted({name for _, name, _ in every_rank}))
                    starts = ",".join(sorted({how for _, _, how in every_rank}))
                    tags = {"host_allocator": allocators, "worker_start": starts, "kernels": kernels}
                    said = f"host allocator: {allocators}; workers {starts}; kernels: {kernels}"
                    line = f"{timeline.line(attempt)} ({said})"
                    logger.set_tags({f"raytrain.{k}": v for k, v in tags.items()})
                else:
                    line = timeline.steps_line()
                print(f"[raytrain] {line}", file=sys.stdout, flush=True)
                logger.log(attempt, timeline.metrics(attempt, phase))
        if then:
            then(state, batch)

    return on_step


def _sample_logger(folder: str | None, rank: int, world: int, stores, records_rows: bool = True):
    """`data.sample_log`: which samples each rank trained on at each step, per attempt, with the
    rank's resident memory and the bytes it has read from the token stores so far."""
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    stamp = [f"{time.time():.6f}-{world}"]
    dist.broadcast_object_list(stamp, src=0)  # one id for the whole worker group of this attempt
    attempt = stamp[0]

    def on_step(state, batch) -> None:
        with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "world": world,
                        "rank": rank,
                        "step": state.step,
                        "time": time.time(),
                        "samples": batch.sample_ids if records_rows else [],
                        **dict(zip(("rss_mb", "peak_mb"), host_memory_mb())),
                        "read_bytes": sum(s.read_counters.bytes for s in stores),
                    }
                )
                + "\n"
            )

    return on_step
