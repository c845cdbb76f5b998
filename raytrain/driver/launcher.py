"""The only module that builds Ray Train objects: connect to (or start) Ray, open the
MLflow run, build the dataset, run the TorchTrainer, close the run."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from raytrain.data import prepare
from raytrain.driver import control
from raytrain.driver.trainer import build_trainer
from raytrain.driver.worker_env import (
    cluster_address,
    connected,
    controller_env,
    relay_secrets,
    start_fork_server,
    warm_nodes,
)
from raytrain.errors import JobError, forward_worker_stdout_only, user_message
from raytrain.job.agents import ACTOR_NAMESPACE, actor_prefix
from raytrain.job.spec import JobSpec
from raytrain.model import hub
from raytrain.rundir import checkpoints, lease, metrics_backlog, signing
from raytrain.rundir.checkpoints import TrainState, forget_deleted, latest_checkpoint
from raytrain.rundir.job_file import read_job_file, write_job_file
from raytrain.tracking import mlflow_run
from raytrain.tracking.timeline import Timeline


@dataclass
class JobResult:
    run_id: str
    run_dir: str
    checkpoint: str | None
    metrics: dict
    wall_s: float
    goodput: dict


def connect(spec: JobSpec, address: str | None = None, trains: bool = True) -> None:
    """RAY_ADDRESS (set by `ray job submit`) or --address: join that cluster. Otherwise
    start a private local cluster sized so Ray Data gets CPUs beside the training workers (and,
    where it `trains`, the machine's fork server first, which only train workers use)."""
    import ray

    if connected():
        return
    address = cluster_address(address)
    if address:
        ray.init(address=address, log_to_driver=True)
        forward_worker_stdout_only()
        return
    lo, hi = spec.scaling.worker_range
    cpus = max(os.cpu_count() or 1, int(hi * spec.scaling.cpus_per_worker)) + 2  # +2 logical CPUs for Ray Data
    # A private cluster on this machine: Ray's notices of its own start (token authentication on,
    # "Started a local Ray instance") do not concern the job; its warnings and errors still show.
    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
    if trains:
        start_fork_server(spec)  # its imports beside Ray's start (`raytrain run` started it already)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    forward_worker_stdout_only()  # no worker tracebacks on the console: the failure is said in one line


def prepare_data(spec: JobSpec, address: str | None = None) -> dict:
    """`raytrain prepare`: the token stores alone, on the cluster's CPUs."""
    connect(spec, address, trains=False)
    try:
        return prepare.ensure_inputs(spec)
    except BaseException as exc:
        message = user_message(exc)
        if message:
            raise JobError(message) from None
        raise


def _latest_state(spec: JobSpec) -> tuple[TrainState | None, str | None]:
    """(the state of the run directory's latest checkpoint, its folder), or Nones."""
    try:
        latest = latest_checkpoint(spec.run_dir)
    except FileNotFoundError:
        return None, None
    with signing.SignedCheckpoint(latest, spec.run_dir, latest.rstrip("/").rsplit("/", 1)[-1]) as checkpoint:
        return TrainState.read(checkpoint, with_metrics=True), latest


def sync_metrics(run_dir: str) -> tuple[int, str | None]:
    """`raytrain sync-metrics RUN_DIR`: what MLflow missed (the latest checkpoint's unwritten steps,
    a close kept while it was unreachable) written into the job's run; (steps written, run id)."""
    spec = read_job_file(run_dir)
    latest, _ = _latest_state(spec)
    run_id = latest.run_id if latest else None
    return mlflow_run.sync_pending(spec, metrics_backlog.unwritten(spec.run_dir, latest), run_id, resume=False), run_id


def pin_model(spec: JobSpec, latest: TrainState | None, where: str | None) -> JobSpec:
    """The job with model.revision fixed to one hub commit for its whole life: the one its
    checkpoints were trained on when it resumes, else the one model.revision names now."""
    saved = latest.model_commit if latest else None
    if saved and hub.COMMIT.fullmatch(spec.model.revision or "") and spec.model.revision != saved:
        raise JobError(
            f"model.revision {spec.model.revision} differs from commit {saved} that {where} was trained on; "
            "a resumed run keeps its base model. Remove model.revision (or set it to that commit), "
            "or start a new run (a new name or checkpoint.storage_path)"
        )
    commit = saved or hub.resolve_commit(spec)
    if commit is None:
        return spec
    if saved and spec.model.revision != saved:
        print(f"[raytrain] resuming on commit {saved} of {spec.model.path}, the one {where} was trained on", flush=True)
    return spec.model_copy(update={"model": spec.model.model_copy(update={"revision": commit})})


def _stop_on_signals(job_control) -> None:
    """`ray job stop` sends the driver SIGTERM: ask the workers to checkpoint and finish.
    A second signal falls through to the default (immediate) behaviour."""

    def on_signal(signum, frame):
        print(
            f"[raytrain] {signal.Signals(signum).name}: checkpointing at the next step, then stopping "
            "(send again to stop at once)",
            flush=True,
        )
        job_control.request_stop.remote(signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)


def run(spec: JobSpec, address: str | None = None, takeover: bool = False) -> JobResult:
    import ray

    started = time.time()
    timeline = Timeline(started)
    signing.ensure_key()
    # In this process's environment too, so that the secret relay below can give it to workers on
    # nodes that would sign with another key (or none); nodes that have the same key get nothing.
    os.environ.setdefault(signing.KEY_ENV, signing.key().decode())
    os.environ.update(controller_env(spec))
    with ThreadPoolExecutor(1) as pool:  # a new MLflow store migrates its schema while Ray starts
        seeding = pool.submit(mlflow_run.seed_store, spec)
        connect(spec, address)
        timeline.mark("ray")
        warm_nodes(spec)  # the nodes' fork servers import a worker's modules while the run is opened
        seeding.result()
    # The lease first: a second driver of a running job is refused before it changes anything
    # (the run snapshot, job.json, the MLflow run's status).
    held = job_control = run_id = None
    try:  # once the MLflow run is open, whatever happens ends it: it never stays RUNNING
        held = control.start_actor(
            spec.run_dir,
            spec.failure.max_failures,
            takeover,
            window=spec.checkpoint.every_n_steps * (spec.checkpoint.keep_last + 1),
        )
        job_control = held.actor
        checkpoints.await_committed(spec.run_dir, (lease.read(spec.run_dir) or {}).get("committed"), lease.TTL_S)
        gone = forget_deleted(spec.run_dir)
        latest, where = _latest_state(spec)
        if gone:
            print(f"[raytrain] checkpoint {', '.join(gone)} of {spec.run_dir} was deleted", flush=True)
        if latest:  # the one the workers restore: both read Ray Train's registration (checkpoint.latest_checkpoint)
            print(f"[raytrain] resuming from {where} (step {latest.step})", flush=True)
        spec = pin_model(spec, latest, where)
        run_id = _start_run(spec, timeline)
        if hub.COMMIT.fullmatch(spec.model.revision or ""):
            mlflow_run.set_tags(spec, run_id, {"raytrain.model_commit": spec.model.revision})
        write_job_file(spec)
        try:
            written = mlflow_run.sync_pending(
                spec, metrics_backlog.unwritten(spec.run_dir, latest), run_id, resume=True
            )
        except Exception as exc:  # MLflow just opened the run; if it fails now, what is kept stays kept
            written = 0
            print(
                f"[raytrain] metrics MLflow missed earlier not written yet ({type(exc).__name__}); they stay kept in "
                f"{spec.run_dir}",
                flush=True,
            )
        if written:
            print(
                f"[raytrain] wrote {written} steps' metrics that MLflow missed in an earlier run of this job",
                flush=True,
            )
        _stop_on_signals(job_control)
        print(
            f"[raytrain] job {spec.name}: {spec.training.strategy}/{spec.training.finetune}, workers "
            f"{spec.scaling.worker_range}, run dir {spec.run_dir}, mlflow run {run_id} at "
            f"{mlflow_run.tracking_uri(spec)}",
            flush=True,
        )
        planned = prepare.plan_inputs(spec)
        if latest:  # positions in other data would be other rows
            latest.require_same_data(planned["key"], where)
        # Secrets never ride in the workers' runtime_env (Ray's dashboard shows it): a worker whose
        # node lacks some, a spot node added mid-run included, asks this relay for them and says so.
        relay = relay_secrets(job_control)
        result = _prepare_and_fit(
            spec, job_control, lambda: build_trainer(spec, run_id, planned, job_control, relay, timeline, held.token)
        )
        verdict = ray.get(job_control.verdict.remote())
        if verdict:  # the workers stopped restarting: the failure budget is spent, or a job error
            raise JobError(verdict)
    except BaseException as exc:
        # No MLflow run yet, or a fenced driver (another took the lease): nothing of the run to end
        # here (its MLflow run is the new driver's now), only this driver's hold to give back.
        if job_control is not None and (run_id is None or held.taken_over(spec.run_dir)):
            control.release(spec.run_dir, held)
        elif run_id is not None:
            _close(spec, run_id, held, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        message = user_message(exc) or (f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else None)
        if message:
            raise JobError(message) from None
        raise
    ckpt = result.checkpoint.path if result.checkpoint else None
    goodput = _close(spec, run_id, held, "FINISHED", {"raytrain.latest_checkpoint": str(ckpt)})
    return JobResult(run_id, spec.run_dir, ckpt, dict(result.metrics or {}), time.time() - started, goodput)


def _prepare_and_fit(spec: JobSpec, job_control, make_trainer):
    """Prepare the token stores and train. Where Ray Data keeps CPUs beside the training workers,
    the workers start and build the model while the stores are prepared (they wait on the control
    actor for the word that the stores are ready, or for the verdict if preparing fails); where the
    workers would hold every CPU, the stores come first, since Ray Data's tasks could never be
    scheduled beside them. Said once, it holds for every group Ray restarts later."""
    import ray

    lo, hi = spec.scaling.worker_range
    if ray.cluster_resources().get("CPU", 0) - hi * spec.scaling.cpus_per_worker < 1:
        prepare.ensure_inputs(spec)
        ray.get(job_control.data_prepared.remote())
        return _Fit(make_trainer()).wait()
    fit = _Fit(make_trainer())
    try:
        prepare.ensure_inputs(spec)
    except BaseException as exc:
        ray.get(job_control.failed.remote(user_message(exc) or f"{type(exc).__name__}: {exc}", retry=False))
        fit.wait(raise_error=False)
        raise
    ray.get(job_control.data_prepared.remote())
    return fit.wait()


def _start_run(spec: JobSpec, timeline: Timeline) -> str:
    run_id = mlflow_run.start_run(spec)
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


def _close(spec: JobSpec, run_id: str, held, status: str, tags: dict | None = None) -> dict:
    """Record goodput and the attempts, the steps rank 0 had not written, then end the MLflow run
    (or keep all that in the run directory while MLflow is unreachable), and free the run directory."""
    import ray

    job_control = held.actor
    goodput = ray.get(job_control.goodput.remote())
    if status == "FINISHED" and ray.get(job_control.stop_requested.remote()):
        status = "KILLED"  # stopped on request: resumable from its last checkpoint
    try:
        latest, _ = _latest_state(spec)
    except JobError:  # a refused checkpoint was said where it was met; its steps stay unwritten
        latest = None
    mlflow_run.close_run(spec, run_id, status, tags or {}, goodput, metrics_backlog.unwritten(spec.run_dir, latest))
    _remove_environment_actors(spec)
    control.release(spec.run_dir, held)
    return goodput


def _remove_environment_actors(spec: JobSpec) -> None:
    """The run's environment actors (training.grpo.environment_workers) outlive its workers by design
    (rl/env_actors.py): they end with the run."""
    import ray

    g = spec.training.grpo
    if not (spec.rl and g.environment_workers):
        return
    prefix = actor_prefix(spec.run_dir)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == ACTOR_NAMESPACE and actor["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=ACTOR_NAMESPACE))
            except ValueError:  # gone already
                pass
