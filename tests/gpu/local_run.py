"""raytrain's worker path in plain processes, without Ray: what the GPU suite and benchmarks/gpu.py run.

A Ray Train worker (raytrain/train/worker.py) builds its strategy, restores, opens its rows of the token store, runs
`loop.fit` and exports. Here the same product code runs in this process (or in one process per device, spawned), on a
process group made with torch.distributed itself (NCCL on GPUs, gloo on CPU, a FileStore rendezvous). Ray appears in
exactly three places of that path, and each is replaced here by the same work done locally, nothing else:

- preparing the token store (`data/prepare.py`): Ray Data maps `prepare_unit` over the read units;
  here `_run_units` maps the same `prepare_unit` over them in this process, and the rest of
  `prepare.ensure_inputs` (key, shards, signed manifest) runs as it is;
- committing a checkpoint (`checkpoint.save_and_report`): each rank saves and signs its part in a
  folder of its own, as under Ray Train; here the parts are merged into `<run_dir>/step_N/` (what
  Ray's upload does), registered as Ray's controller registers it, and rank 0 records it. Restoring reads that folder
  through
  `signing.SignedCheckpoint` and `strategy.load`, as `checkpoint.restore` does;
- the stop notices (`preemption.StopSignals.local`, which reads Ray's drain notice every step): here a SIGTERM
  flag only (there is no driver and no Ray drain notice to hear).

A machine with Ray installed never imports it through this module. `blocked_imports` makes that checkable on a machine
that has Ray: the suite runs inside it, with Ray and MLflow unimportable."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

DEVICE_ENV = "RAYTRAIN_GPU_SUITE_DEVICE"  # "cpu": run the suite on CPU (gloo, fp32) for development
NOT_ON_GPU_MACHINE = ("ray", "mlflow", "boto3", "moto")  # what the bare GPU machine does not have


def suite_device() -> torch.device | None:
    """cuda:0 where a GPU is, cpu when RAYTRAIN_GPU_SUITE_DEVICE=cpu, else None (the suite skips)."""
    want = os.environ.get(DEVICE_ENV, "").strip().lower()
    if want == "cpu":
        return torch.device("cpu")
    if want not in ("", "cuda", "gpu"):
        raise ValueError(f"{DEVICE_ENV}={want!r}: use cpu (development) or leave it unset")
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def device_count(device: torch.device) -> int:
    """How many ranks this machine can run: its GPUs, or 2 gloo processes on CPU."""
    return torch.cuda.device_count() if device.type == "cuda" else 2


@contextlib.contextmanager
def blocked_imports(names: tuple[str, ...] = NOT_ON_GPU_MACHINE):
    """For the duration, `names` are as if not installed: importing one raises ModuleNotFoundError
    and `importlib.util.find_spec` says None (a None in sys.modules does both). Yields whether it
    could: not if one was imported already (a mixed session), then nothing is changed."""
    if any(n.split(".")[0] in names for n in sys.modules if sys.modules[n] is not None):
        yield False
        return
    blocked = [n for n in names if n not in sys.modules]
    for name in blocked:
        sys.modules[name] = None
    try:
        yield True
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ process group
def init_group(device: torch.device, rank: int, world: int, rendezvous: str) -> torch.device:
    """Join the process group (FileStore at `rendezvous`); returns this rank's device."""
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    # What Ray Train sets in every worker (DeepSpeed and zero3's universal loading read them).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        **kwargs,
    )
    return device


@contextlib.contextmanager
def process_group(device: torch.device):
    """A one-rank process group in this process, for the duration."""
    folder = tempfile.mkdtemp(prefix="raytrain-pg-")
    device = init_group(device, 0, 1, os.path.join(folder, "store"))
    try:
        yield device
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


# Ray's raylet starts its workers at niceness 15 (its worker_niceness). Spawned ranks at the default 0
# would outweigh them 28 to 1 in the kernel's scheduler: on 2 cores, a 4-rank group in one test lane
# starved the other lane's Ray jobs (seen: a job's workers 318 s to start, its test's waits timing out).
RAY_WORKER_NICENESS = 15


def _spawned(rank: int, fn, world: int, device_type: str, rendezvous: str, out: str, args: tuple) -> None:
    os.nice(max(0, RAY_WORKER_NICENESS - os.nice(0)))  # as a Ray training worker runs: the same share of a core
    if device_type == "cpu":  # and its thread pool, which train/worker.py sizes to its 1-CPU share: torch sized
        torch.set_num_threads(1)  # it to the cores, and 4 ranks x 2 threads on 2 cores oversubscribe them
    device = init_group(torch.device(device_type), rank, world, rendezvous)
    # As a forked train worker starts (train/forkserver.py): the worker's modules imported, and what they made
    # frozen out of the collector's way, so that release()'s collection scans the cases' objects only (with
    # torch's, transformers' and the product's module objects too it took ~0.9 s a call on 2 busy cores).
    from raytrain.train.worker_launch import STEP_IMPORTS

    for name in STEP_IMPORTS:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    try:
        result = fn(rank, world, device, *args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, device: torch.device, *args):
    """Run fn(rank, world, device, *args) on `world` fresh processes (one per GPU); rank 0's
    JSON-able result. `fn` must be importable by name (a module-level function)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="raytrain-spawn-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _spawned,
            args=(fn, world, device.type, os.path.join(tmp, "store"), out, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(out).read_text())


TORCH_LINEAR = torch.nn.functional.linear


def torch_linear() -> None:
    """Put torch's own F.linear back before building a strategy. zero.Init replaces it with
    DeepSpeed's for the rest of the process (its words: "This will persist unless manually reset"):
    a worker never builds another strategy, but these harnesses build many in one process, and an
    NF4 base through DeepSpeed's linear is a shape error (seen after a zero3 case)."""
    torch.nn.functional.linear = TORCH_LINEAR


def release(*objects) -> None:
    """Free a strategy's memory before the next one is built in the same process."""
    for obj in objects:
        engine = getattr(obj, "engine", None)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()  # DeepSpeed's hooks hold the partitioned parameters
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the three Ray seams
def _run_units_here(spec, data, fs, units, out_fs, out_path, concurrency) -> list[dict]:
    """`prepare._run_units` without Ray Data: the same `prepare_unit` on every unit, in order."""
    from raytrain.data import prepare

    kwargs = {
        "fs": fs,
        "out_fs": out_fs,
        "out_path": out_path,
        "spec": spec.model_dump(mode="json"),
        "data": data.model_dump(mode="json"),
    }
    return [
        json.loads(prepare.prepare_unit({"index": i, "unit": u.to_json()}, **kwargs)["result"])
        for i, u in enumerate(units)
    ]


def register(run_dir: str, name: str) -> None:
    """What Ray Train's controller writes once every rank reported: its run snapshot naming the
    latest checkpoint (the part of Ray 2.60's layout that `checkpoint.latest_checkpoint` reads)."""
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT

    Path(run_dir, RAY_SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": name}}))


def commit_here(strategy, state, metrics: dict, wait: bool = True) -> str | None:
    """`checkpoint.save_and_report` without Ray Train: each rank saves its part in its own folder
    and rank 0 signs them all (as Ray Train workers do), the parts are merged into `<run_dir>/step_N/`
    (Ray's upload), then rank 0 registers it as Ray Train's controller does (`register`) and records it
    (`checkpoint.confirm`). Committed before it returns; with `checkpoint.async_save` the files are
    written by the strategy's background save, as the loop's are."""
    from raytrain.rundir.checkpoints import record_latest
    from raytrain.train.checkpoint import sign

    spec, rank = strategy.spec, strategy.rank
    name = f"step_{state.step:08d}"
    final = Path(spec.run_dir, name)
    own = tempfile.mkdtemp(prefix="raytrain-ckpt-")
    try:
        if rank == 0:
            state.write(own)
        # As the loop saves: in the background where the job says so (its files complete before signing).
        (strategy.save_async(own) if spec.checkpoint.async_save else strategy.save(own) or (lambda: None))()
        sign(own, spec.run_dir, name, strategy.plan.lease)  # collective: rank 0 signs every rank's files
        if rank == 0 and final.exists():
            shutil.rmtree(final)  # an earlier run's folder of the same step (a rerun in the same run_dir)
        dist.barrier()
        shutil.copytree(own, final, dirs_exist_ok=True)
        dist.barrier()
        if rank == 0:
            register(spec.run_dir, name)
            record_latest(spec.run_dir, name)
        dist.barrier()
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return str(final) if rank == 0 else None


def _confirm_here(strategy) -> str | None:
    return None  # commit_here commits before it returns: nothing is ever pending


def _no_checkpoint(strategy, state, metrics: dict, wait: bool = True) -> None:
    return None


def _local_stop_signals():
    from raytrain.train import preemption

    class LocalStopSignals(preemption.StopSignals):
        """`StopSignals` with no Ray to ask: a SIGTERM to this process still stops at a step boundary."""

        def local(self) -> list[float]:
            flags = preemption.SIGTERM if preemption._sigterm.is_set() else 0
            return [float((flags >> i) & 1) for i in range(self.N_FLAGS)]

    return LocalStopSignals


@contextlib.contextmanager
def without_ray(checkpoints: bool = True):
    """The three Ray seams replaced for the duration (`checkpoints=False`: saves are skipped)."""
    from raytrain.data import prepare
    from raytrain.train import checkpoint, loop

    patches = [
        (prepare, "_run_units", _run_units_here),
        (checkpoint, "save_and_report", commit_here if checkpoints else _no_checkpoint),
        (checkpoint, "confirm", _confirm_here),
        (loop, "StopSignals", _local_stop_signals()),
    ]
    missing = [f"{m.__name__}.{name}" for m, name, _ in patches if not hasattr(m, name)]
    if missing:
        raise RuntimeError(f"the product no longer has {missing}: update tests/gpu/local_run.py's seams")
    before = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, value in patches:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in before:
            setattr(m, name, value)


# ------------------------------------------------------------------ the worker's steps
def prepare_data(spec) -> dict:
    """The job's token stores (prepared here if they are not there yet), as the driver hands them to
    the workers (`prepare.ensure_inputs`)."""
    from raytrain.data import prepare

    with without_ray():
        return prepare.ensure_inputs(spec)


class CaptureLogger:
    """What `loop.fit` logs on rank 0 (the StepLogger's place): every step's metrics, by step."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log_live(self, step: int, metrics: dict) -> None:
        self.steps[step] = dict(metrics)

    def log_committed(self, steps, checkpoint=None) -> None:
        for step, metrics in steps:
            self.steps.setdefault(step, {}).update(metrics)

    def unwritten(self) -> list:  # everything is "written" at once here
        return []

    def __getattr__(self, name):  # set_tags, log, log_model_dir, ...: nothing to record
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


@dataclass
class Trained:
    state: object  # raytrain.rundir.checkpoints.TrainState after the last step
    steps: dict[int, dict] = field(default_factory=dict)  # rank 0: step -> the loop's metrics

    @property
    def losses(self) -> dict[int, float]:
        return {s: m["loss"] for s, m in sorted(self.steps.items()) if "loss" in m}


def train(spec, strategy, prepared: dict, state=None, checkpoints: bool = True, on_step=None) -> Trained:
    """`loop.fit` from `state` (default: a fresh start) to training.max_steps, on this rank's rows
    of each global batch, read as worker.py reads them (`open_data` from the prepared stores)."""
    from raytrain.data.batches import open_data
    from raytrain.job.plan import RunPlan
    from raytrain.rundir.checkpoints import TrainState
    from raytrain.train import loop

    state = state or TrainState(model_commit=spec.model.revision)
    plan = RunPlan.of(spec, prepared)
    batches, eval_batches, key = open_data(spec, plan, strategy.rank, strategy.world_size, state.data)
    state.require_same_data(key, f"the checkpoint at step {state.step}")
    state.bad_rows = sum(s.bad_rows for s in batches.stores)
    logger = CaptureLogger() if strategy.rank == 0 else None
    try:
        with without_ray(checkpoints=checkpoints):
            state = loop.fit(spec, strategy, batches, state, logger, None, on_step=on_step, eval_batches=eval_batches)
    finally:
        batches.close()
    return Trained(state, logger.steps if logger else {})


def restore(strategy, step: int | None = None):
    """`checkpoint.restore` from a local run directory: the latest committed checkpoint (or step
    `step`'s), every file verified against its signed manifest before it is read. The TrainState."""
    from raytrain.rundir import signing, storage
    from raytrain.rundir.checkpoints import TrainState
    from raytrain.train.export import latest_checkpoint

    spec = strategy.spec
    folder = storage.join(spec.run_dir, f"step_{step:08d}") if step else latest_checkpoint(spec.run_dir)
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    with signing.SignedCheckpoint(folder, spec.run_dir, name) as signed:
        strategy.load(signed)
        return TrainState.read(signed, with_metrics=strategy.rank == 0)


def export(spec, strategy, out: str) -> None:
    """worker.export without the upload: the tokenizer on rank 0, `strategy.export` (collective)."""
    from raytrain.model import hub

    tokenizer = hub.load_tokenizer(spec) if strategy.rank == 0 else None
    strategy.export(out, tokenizer)


def _fit_jobs(rank: int, world: int, device, jobs: list[tuple[str, dict, int]]) -> dict:
    """On every rank: each job in turn from its checkpoint at step `start` (0: a fresh start) to its
    max_steps, committing as the job does, then its final model exported by worker.export."""
    from raytrain.job.spec import JobSpec
    from raytrain.strategies import build_strategy
    from raytrain.train import worker

    out = {}
    for spec_json, prepared, start in jobs:
        spec = JobSpec.model_validate_json(spec_json)
        torch_linear()  # zero3's F.linear is not the next job's
        strategy = build_strategy(spec, device)
        state = restore(strategy, step=start) if start else None
        trained = train(spec, strategy, prepared, state=state)
        worker.export(spec, strategy, CaptureLogger())
        release(strategy)
        out[f"{spec.name}/{spec.scaling.num_workers}"] = trained.steps
    return out


def fit_jobs(world: int, specs_and_starts: list[tuple[object, int]]) -> dict[str, dict[int, dict]]:
    """Whole jobs, as `raytrain run` trains and exports them but without Ray, on one spawned group of
    `world` CPU ranks for all of them (torch and the product imported once, not once a job): each
    (spec, start step), its job file signed first as the driver signs it. Rank 0's per-step metrics
    (what MLflow would get), by "name/num_workers"."""
    from raytrain.rundir.job_file import write_job_file

    jobs = []
    for spec, start in specs_and_starts:
        write_job_file(spec)  # the offline export rebuilds the job from it
        jobs.append((spec.model_dump_json(), prepare_data(spec), start))
    got = spawn(_fit_jobs, world, torch.device("cpu"), jobs)
    return {name: {int(k): v for k, v in steps.items()} for name, steps in got.items()}


# ------------------------------------------------------------------ models
def model_files(folder: Path) -> list[Path]:
    return [
        f for f in folder.iterdir() if f.is_file() and (f.suffix == ".safetensors" or f.name.endswith(".index.json"))
    ]


def save_bf16_copy(source: Path, out: Path, max_shard_size: str = "40KB") -> Path:
    """`source`'s model saved in bf16 over several safetensors files (with an index), as hub models
    are stored, with its tokenizer: what sharded loading reads."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16).save_pretrained(
        str(tmp), max_shard_size=max_shard_size
    )
    for f in source.iterdir():  # the tokenizer's files (and its chat template)
        if f.is_file() and not (tmp / f.name).exists() and f.suffix != ".safetensors" and "index" not in f.name:
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return out


def resume_case(rank: int, world: int, device: torch.device, spec_json: str, prepared: dict) -> dict:
    """On every rank (spawned): train to max_steps with checkpoints, then a fresh strategy restored
    from step 2 trains on. Rank 0's losses of both runs, and how the weights were loaded."""
    from raytrain.job.spec import JobSpec
    from raytrain.strategies import build_strategy

    spec = JobSpec.model_validate_json(spec_json)
    strategy = build_strategy(spec, device)
    loaded_by = getattr(strategy, "loaded_by", None)
    first = train(spec, strategy, prepared)
    release(strategy)
    del strategy
    again = build_strategy(spec, device)
    resumed = train(spec, again, prepared, state=restore(again, step=2))
    release(again)
    return {"loaded_by": loaded_by, "first": first.losses, "resumed": resumed.losses}


def mesh_case(rank: int, world: int, device: torch.device, spec_jsons: list[str], prepared: dict) -> dict:
    """On every rank (spawned): each job in turn (their scaling names the mesh) trains from the start
    without checkpoints; rank 0's losses of each."""
    from raytrain.job.spec import JobSpec
    from raytrain.strategies import build_strategy

    out = {}
    for spec_json in spec_jsons:
        spec = JobSpec.model_validate_json(spec_json)
        strategy = build_strategy(spec, device)
        out[f"sp{spec.scaling.sequence_parallel}-tp{spec.scaling.tensor_parallel}"] = train(
            spec, strategy, prepared, checkpoints=False
        ).losses
        release(strategy)
        del strategy
    return out
