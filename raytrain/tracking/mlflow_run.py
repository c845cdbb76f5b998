"""MLflow, through this one module: one run per job.

The driver opens the run before any worker starts and closes it (FINISHED or FAILED)
after `fit` returns, so Ray's worker restarts all log into the same run; rank 0 alone
logs step metrics and the exported model. Params are the flattened spec: the spec has no
secrets in it (pre-flight refuses them), and keys that look like secrets are dropped anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import time
from contextlib import closing
from importlib import metadata
from pathlib import Path

from raytrain.job.spec import (
    SECRET_KEY,  # pre-flight refuses secrets in a job file; they are never logged either
    JobSpec,
)
from raytrain.rundir import metrics_backlog, storage

# The default store is a sqlite file beside the checkpoints; with checkpoints on an object
# store there is no file every process of the job can open (the driver and rank 0 each made
# one in their own working directory, and rank 0 could not find the run).
REMOTE_WITHOUT_SERVER = (
    "checkpoint.storage_path is remote and tracking.uri is unset: the default MLflow store is a "
    "sqlite file, which the job's processes on other nodes cannot share; set tracking.uri to an "
    "MLflow server (http://mlflow:5000, as the k8s/ manifests run one)"
)


def default_store(spec: JobSpec) -> Path:
    """The default store's sqlite file, beside the checkpoints (used when tracking.uri is unset)."""
    root = spec.checkpoint.storage_path
    if storage.is_remote(root):
        raise ValueError(REMOTE_WITHOUT_SERVER)
    return Path(storage.absolute(root)) / "mlflow.db"


def tracking_uri(spec: JobSpec) -> str:
    return spec.tracking.uri or f"sqlite:///{default_store(spec)}"


def artifact_root(spec: JobSpec) -> str:
    return spec.checkpoint.storage_path.rstrip("/") + "/mlartifacts"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif not SECRET_KEY.search(key):
            out[name] = str(value)[:6000]
    return out


# MLflow's own HTTP retries (7, doubling from 2 s: minutes in one call) would hold a call that
# raytrain's callers retry themselves (step_metrics' writer) or give up on and keep for later
# (the driver's close). What the user's environment sets wins.
CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def client(spec: JobSpec):
    from mlflow.tracking import MlflowClient

    for key, value in CLIENT_ENV.items():
        os.environ.setdefault(key, value)
    return MlflowClient(tracking_uri=tracking_uri(spec))


def _template(version: str) -> Path:
    """An empty sqlite store with MLflow's schema, made once per MLflow version in the user's cache."""
    from mlflow.tracking import MlflowClient

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raytrain"
    template = cache / f"mlflow-{version}.db"
    if not template.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f".mlflow-{version}.{os.getpid()}.db"
        MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()  # creates and migrates it
        os.replace(partial, template)  # complete or absent, whoever else makes one at the same time
    return template


def seed_store(spec: JobSpec) -> None:
    """A new default (sqlite) store starts as a copy of an empty, migrated one: MLflow runs its
    schema migrations on every new file, 1-2 s on the critical path of a job's first start in a
    new storage path. Its Default experiment keeps its artifacts beside the job's."""
    if spec.tracking.uri:
        return
    db = default_store(spec)
    if db.exists():
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        template = _template(metadata.version("mlflow"))
    except (OSError, sqlite3.Error):  # no usable cache: MLflow makes and migrates the store itself
        return
    copy = db.with_name(f".{db.name}.{os.getpid()}")
    try:
        shutil.copyfile(template, copy)
        with closing(sqlite3.connect(copy)) as conn, conn:  # closed, and committed
            conn.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (f"{artifact_root(spec)}/0",)
            )
        os.link(copy, db)  # never over a store another process created meanwhile
    except FileExistsError:
        pass
    finally:
        copy.unlink(missing_ok=True)


def start_run(spec: JobSpec) -> str:
    """Driver: the job's run; a job resubmitted to the same run directory continues its run."""
    seed_store(spec)
    mlflow = client(spec)
    experiment = mlflow.get_experiment_by_name(spec.tracking.experiment)
    if experiment is None:
        experiment_id = mlflow.create_experiment(spec.tracking.experiment, artifact_location=artifact_root(spec))
    else:
        experiment_id = experiment.experiment_id
    previous = mlflow.search_runs(
        [experiment_id],
        f"tags.`raytrain.run_dir` = '{spec.run_dir}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if previous and previous[0].info.status != "FINISHED":
        run_id = previous[0].info.run_id
        mlflow.update_run(run_id, status="RUNNING")
        return run_id
    run = mlflow.create_run(
        experiment_id,
        run_name=spec.name,
        tags={"raytrain.run_dir": spec.run_dir, "raytrain.strategy": spec.training.strategy},
    )
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in flatten(spec.model_dump(mode="json")).items()]
    for i in range(0, len(params), 100):
        mlflow.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def set_tags(spec: JobSpec, run_id: str, tags: dict) -> None:
    mlflow = client(spec)
    for key, value in tags.items():
        mlflow.set_tag(run_id, key, value)


def log_goodput(mlflow, run_id: str, goodput: dict) -> None:
    """Productive vs wasted time and, per failure, steps lost and recovery time."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    values = {k: float(goodput[k]) for k in ("wall_s", "productive_s", "wasted_s")}  # host: Python numbers
    metrics = [Metric(f"goodput_{k}", v, now, 0) for k, v in values.items()]
    metrics.append(Metric("failures", float(len(goodput["failures"])), now, 0))  # host: Python numbers
    for i, failure in enumerate(goodput["failures"]):
        metrics += [
            Metric("failure_steps_lost", float(failure["steps_lost"]), now, i + 1),  # host: Python numbers
            Metric("failure_recovery_s", float(failure["recovery_s"]), now, i + 1),  # host: Python numbers
        ]
    mlflow.log_batch(run_id, metrics=metrics)
    mlflow.set_tag(run_id, "raytrain.goodput", json.dumps(goodput)[:5000])


def logged_steps(mlflow, run_id: str, keys) -> dict[str, set[int]]:
    """{key: the steps the run has a value of it for}: whole histories, for per-attempt values only
    (a few an attempt); training steps use `logged_through`."""
    return {key: {m.step for m in mlflow.get_metric_history(run_id, key)} for key in keys}


# Committed step metrics go to MLflow in increasing step order, whole steps a request, each request
# carrying this metric (value: its last step, at that step). MLflow's log_batch commits a request's
# metrics in one transaction and its tags in another (a server that dies between them kept the
# steps without a tag watermark: CI saw 12 steps written twice), so the watermark is a metric of
# the same transaction. A step is in the run iff it is <= the run's latest value of it: after a
# failed write (which may have landed) one read of the run answers, where reading the metric's
# history grew with the run (100k steps: ~10 MB).
LOGGED_THROUGH = "raytrain.logged_through_step"
BATCH = 1000  # MLflow's log_batch limit on metrics and tags together


def logged_through(mlflow, run_id: str) -> int:
    """The last committed step the run has (-1: none)."""
    data = mlflow.get_run(run_id).data
    if LOGGED_THROUGH in data.metrics:
        return int(data.metrics[LOGGED_THROUGH])
    if LOGGED_THROUGH in data.tags:  # a run written before the watermark was a metric
        return int(data.tags[LOGGED_THROUGH])
    if "loss" not in data.metrics:
        return -1
    return max(m.step for m in mlflow.get_metric_history(run_id, "loss"))  # a run written before either


def log_steps(mlflow, run_id: str, steps: list[tuple[int, dict]]) -> None:
    """Committed steps (in increasing order) in requests of whole steps, each with LOGGED_THROUGH."""
    from mlflow.entities import Metric

    now, batch = int(time.time() * 1000), []
    for i, (step, metrics) in enumerate(steps):
        batch += [Metric(k, float(v), now, step) for k, v in metrics.items()]  # host: Python numbers
        following = len(steps[i + 1][1]) if i + 1 < len(steps) else BATCH
        if len(batch) + following + 1 > BATCH:
            through = Metric(LOGGED_THROUGH, float(step), now, step)  # host: a Python int
            mlflow.log_batch(run_id, metrics=batch + [through])
            batch = []


def log_missing(mlflow, run_id: str, steps: list) -> int:
    """Log the (step, metrics) pairs whose step the run does not have yet; returns how many."""
    through = logged_through(mlflow, run_id)
    missing = [(step, metrics) for step, metrics in steps if step > through and "loss" in metrics]
    log_steps(mlflow, run_id, missing)
    return len(missing)


# --- the job's last word, kept in the run directory when MLflow cannot take it ---
PENDING_FILE = "mlflow_pending.json"


def close_run(spec: JobSpec, run_id: str, status: str, tags: dict, goodput: dict, steps: list) -> None:
    """Driver, at the job's end: the steps rank 0 had not written yet (the latest checkpoint's),
    goodput, tags and the run's status. Training's result never depends on it: if MLflow is
    unreachable, all of it is kept in the run directory for `raytrain sync-metrics` (or the next
    run of the job) and the job ends as it trained."""
    from raytrain.rundir import signing

    record = {
        "run_dir": signing.place(spec.run_dir),
        "run_id": run_id,
        "status": status,
        "tags": tags,
        "goodput": goodput,
    }
    try:
        _apply(client(spec), record, steps)
    except Exception as exc:
        storage.write_text(storage.join(spec.run_dir, PENDING_FILE), json.dumps(signing.sign_document(record)))
        print(
            f"[raytrain] MLflow unreachable at the end ({type(exc).__name__}): the run's status ({status}), goodput "
            f"and unwritten step metrics are kept in {spec.run_dir} ({PENDING_FILE}, {metrics_backlog.FOLDER} and the "
            "latest checkpoint); "
            f"`raytrain sync-metrics {spec.run_dir}` or running the job again writes them",
            file=sys.stderr,
            flush=True,
        )
        return
    metrics_backlog.forget(spec.run_dir, max((step for step, _ in steps), default=0))  # MLflow has them all
    storage.delete(storage.join(spec.run_dir, PENDING_FILE))


def _apply(mlflow, record: dict, steps: list) -> int:
    written = log_missing(mlflow, record["run_id"], steps)
    if record.get("goodput"):
        log_goodput(mlflow, record["run_id"], record["goodput"])
    for key, value in record.get("tags", {}).items():
        mlflow.set_tag(record["run_id"], key, value)
    if record.get("status"):
        mlflow.set_terminated(record["run_id"], status=record["status"])
    return written


def sync_pending(spec: JobSpec, steps: list, run_id: str | None, resume: bool) -> int:
    """What an earlier driver could not write (its kept close, the latest checkpoint's unwritten
    steps) into the job's run; returns how many steps were written. `resume`: the job is about to
    run again in the same MLflow run, so its status is left to this run's end."""
    from raytrain.rundir import signing

    uri = storage.join(spec.run_dir, PENDING_FILE)
    record = {"run_id": run_id}
    if storage.exists(uri):
        record = signing.verify_document(json.loads(storage.read_text(uri)), uri)
        signing.require_place(record, "run_dir", signing.place(spec.run_dir), uri)
        if resume:
            record = {"run_id": record["run_id"]}
    if not record.get("run_id"):
        return 0
    written = _apply(client(spec), record, steps)
    metrics_backlog.forget(spec.run_dir, max((step for step, _ in steps), default=0))  # MLflow has them all
    storage.delete(uri)
    return written
