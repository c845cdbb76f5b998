"""The only module that builds Ray Train objects: connect to (or start) Ray, open the
MLflow run, build the dataset, run the TorchTrainer, close the run."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import control, modeling, signing, tracking
from .worker_env import controller_env, runtime_env, secrets_the_cluster_lacks
from .timeline import Timeline
from .checkpoint import STATE_FILE, TrainState, forget_deleted
from .data import prepare
from .export import latest_checkpoint, write_job_file
from .config import JobSpec
from .errors import JobError, forward_worker_stdout_only, user_message


@dataclass
class JobResult:
    run_id: str
    run_dir: str
    checkpoint: str | None
    metrics: dict
    wall_s: float
    goodput: dict


def connect(spec: JobSpec, address: str | None = None) -> None:
    """RAY_ADDRESS (set by `ray job submit`) or --address: join that cluster. Otherwise
    start a private local cluster sized so Ray Data gets CPUs beside the training workers."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        forward_worker_stdout_only()
        return
    lo, hi = spec.scaling.worker_range
    cpus = max(os.cpu_count() or 1, int(hi * spec.scaling.cpus_per_worker)) + 2  # +2 logical CPUs for Ray Data
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    forward_worker_stdout_only()  # no worker tracebacks on the console: the failure is said in one line


def build_trainer(spec: JobSpec, run_id: str, prepared: dict, forward: list[str] = (), timeline: Timeline | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from . import worker

    lo, hi = spec.scaling.worker_range
    scaling = ScalingConfig(num_workers=lo if lo == hi else (lo, hi), use_gpu=spec.scaling.use_gpu,
                            resources_per_worker={"CPU": spec.scaling.cpus_per_worker, **spec.scaling.resources_per_worker},
                            elastic_resize_monitor_interval_s=spec.scaling.resize_check_interval_s)
    run = RunConfig(name=spec.name, storage_path=spec.checkpoint.storage_path,
                    checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep_last),
                    # Ray restarts without limit; raytrain's control actor decides what counts (control.py).
                    failure_config=FailureConfig(max_failures=-1),
                    worker_runtime_env=runtime_env(spec, list(forward)))
    # No Ray Data inside the training workers: each rank reads its rows of each global
    # batch straight from the prepared token store (see raytrain/data/).
    return TorchTrainer(worker.train_func, scaling_config=scaling, run_config=run,
                        train_loop_config={"spec": spec.model_dump(mode="json"), "run_id": run_id, "data": prepared,
                                           "timeline": (timeline or Timeline()).to_config()})


def prepare_data(spec: JobSpec, address: str | None = None) -> dict:
    """`raytrain prepare`: the token stores alone, on the cluster's CPUs."""
    connect(spec, address)
    try:
        return prepare.ensure_inputs(spec)
    except BaseException as exc:
        message = user_message(exc)
        if message:
            raise JobError(message) from None
        raise


def _latest_state(spec: JobSpec) -> tuple[TrainState | None, str | None]:
    """(the state of the run directory's latest committed checkpoint, its folder), or Nones."""
    try:
        latest = latest_checkpoint(spec.run_dir)
    except FileNotFoundError:
        return None, None
    state = signing.verified_read(latest, spec.name, latest.rstrip("/").rsplit("/", 1)[-1], STATE_FILE)
    return TrainState.from_json(state.decode()), latest


def pin_model(spec: JobSpec, latest: TrainState | None, where: str | None) -> JobSpec:
    """The job with model.revision fixed to one hub commit for its whole life: the one its
    checkpoints were trained on when it resumes, else the one model.revision names now."""
    saved = latest.model_commit if latest else None
    if saved and modeling.COMMIT.fullmatch(spec.model.revision or "") and spec.model.revision != saved:
        raise JobError(f"model.revision {spec.model.revision} differs from commit {saved} that {where} was trained on; "
                       "a resumed run keeps its base model. Remove model.revision (or set it to that commit), "
                       "or start a new run (a new name or checkpoint.storage_path)")
    commit = saved or modeling.resolve_commit(spec)
    if commit is None:
        return spec
    if saved and spec.model.revision != saved:
        print(f"[raytrain] resuming on commit {saved} of {spec.model.path}, the one {where} was trained on", flush=True)
    return spec.model_copy(update={"model": spec.model.model_copy(update={"revision": commit})})


def _stop_on_signals(job_control) -> None:
    """`ray job stop` sends the driver SIGTERM: ask the workers to checkpoint and finish.
    A second signal falls through to the default (immediate) behaviour."""
    def on_signal(signum, frame):
        print(f"[raytrain] {signal.Signals(signum).name}: checkpointing at the next step, then stopping "
              "(send again to stop at once)", flush=True)
        job_control.request_stop.remote(signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)


def run(spec: JobSpec, address: str | None = None) -> JobResult:
    import ray

    started = time.time()
    timeline = Timeline(started)
    signing.ensure_key()
    # In this process's environment too, so that the forwarding below can send it to nodes that
    # would sign with another key (or none); nodes that have the same key get nothing.
    os.environ.setdefault(signing.KEY_ENV, signing.key().decode())
    os.environ.update(controller_env(spec))
    gone = forget_deleted(spec.run_dir)
    latest, where = _latest_state(spec)
    if gone:
        print(f"[raytrain] checkpoint {', '.join(gone)} of {spec.run_dir} was deleted: resuming from "
              f"{where or 'the start'}", flush=True)
    spec = pin_model(spec, latest, where)
    with ThreadPoolExecutor(1) as pool:  # the MLflow run opens (a new store migrates its schema) while Ray starts
        opening = pool.submit(_start_run, spec, timeline)
        try:
            connect(spec, address)
        except BaseException:  # no Ray: the run that opened meanwhile ends FAILED, never stays RUNNING
            with contextlib.suppress(Exception):
                tracking.end_run(spec, opening.result(), "FAILED")
            raise
        timeline.mark("ray")
        run_id = opening.result()
    job_control = None
    if modeling.COMMIT.fullmatch(spec.model.revision or ""):
        tracking.set_tags(spec, run_id, {"raytrain.model_commit": spec.model.revision})
    try:  # from here on, whatever happens ends the MLflow run: it never stays RUNNING
        write_job_file(spec)
        job_control = control.start_actor(spec.run_dir, spec.failure.max_failures)
        _stop_on_signals(job_control)
        print(f"[raytrain] job {spec.name}: {spec.training.strategy}/{spec.training.finetune}, workers "
              f"{spec.scaling.worker_range}, run dir {spec.run_dir}, mlflow run {run_id} at {tracking.tracking_uri(spec)}",
              flush=True)
        planned = prepare.plan_inputs(spec)
        if latest:  # positions in other data would be other rows
            latest.require_same_data(planned["key"], where)
        forward = secrets_the_cluster_lacks()
        if forward:
            print(f"[raytrain] forwarding {', '.join(forward)} from this shell to the workers: the cluster's nodes lack "
                  "them, and a forwarded value is readable in Ray's dashboard; set them on the nodes instead "
                  "(k8s: the Secret raytrain-secrets)", flush=True)
        result = _prepare_and_fit(spec, job_control, lambda: build_trainer(spec, run_id, planned, forward, timeline))
        verdict = ray.get(job_control.verdict.remote())
        if verdict:  # the workers stopped restarting: the failure budget is spent, or a job error
            raise JobError(verdict)
    except BaseException as exc:
        _close(spec, run_id, job_control, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        message = user_message(exc) or (f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else None)
        if message:
            raise JobError(message) from None
        raise
    ckpt = result.checkpoint.path if result.checkpoint else None
    goodput = _close(spec, run_id, job_control, "FINISHED", {"raytrain.latest_checkpoint": str(ckpt)})
    return JobResult(run_id, spec.run_dir, ckpt, dict(result.metrics or {}), time.time() - started, goodput)


def _prepare_and_fit(spec: JobSpec, job_control, make_trainer):
    """Prepare the token stores and train. Where Ray Data keeps CPUs beside the training workers,
    the workers start and build the model while the stores are prepared (they wait for the
    manifests, or for the verdict if preparing fails); where the workers would hold every CPU,
    the stores come first, since Ray Data's tasks could never be scheduled beside them."""
    import ray

    lo, hi = spec.scaling.worker_range
    if ray.cluster_resources().get("CPU", 0) - hi * spec.scaling.cpus_per_worker < 1:
        prepare.ensure_inputs(spec)
        return _Fit(make_trainer()).wait()
    fit = _Fit(make_trainer())
    try:
        prepare.ensure_inputs(spec)
    except BaseException as exc:
        ray.get(job_control.failed.remote(user_message(exc) or f"{type(exc).__name__}: {exc}", retry=False))
        fit.wait(raise_error=False)
        raise
    return fit.wait()


def _start_run(spec: JobSpec, timeline: Timeline) -> str:
    run_id = tracking.start_run(spec)
    timeline.mark("mlflow")
    return run_id


class _Fit:
    """TorchTrainer.fit() off the main thread: on the main thread it installs Ray Train's own
    SIGINT handler (abort the run, no checkpoint) over raytrain's; off it, Ctrl-C means what
    `ray job stop` means: checkpoint at the next step, then stop. The main thread prepares the
    data meanwhile, then only waits (in short joins, so that it runs the signal handlers)."""

    def __init__(self, trainer):
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._fit, args=(trainer,), name="raytrain-fit", daemon=True)
        self.thread.start()  # daemon: a second Ctrl-C exits at once

    def _fit(self, trainer) -> None:
        try:
            self.outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread, which raises it
            self.outcome["error"] = exc

    def wait(self, raise_error: bool = True):
        while self.thread.is_alive():
            self.thread.join(0.2)
        if "error" in self.outcome and raise_error:
            raise self.outcome["error"]
        return self.outcome.get("result")


def _close(spec: JobSpec, run_id: str, job_control, status: str, tags: dict | None = None) -> dict:
    """Record goodput and the attempts, then end the MLflow run."""
    import ray

    goodput = {}
    if job_control is not None:  # None: the job failed before its control actor started
        goodput = ray.get(job_control.goodput.remote())
        if status == "FINISHED" and ray.get(job_control.stop_requested.remote()):
            status = "KILLED"  # stopped on request: resumable from its last checkpoint
        tracking.log_goodput(spec, run_id, goodput)
        ray.kill(job_control)
    tracking.end_run(spec, run_id, status, tags)
    return goodput
