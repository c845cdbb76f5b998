"""MLflow, through this one module: one run per job.

The driver opens the run before any worker starts and closes it (FINISHED or FAILED)
after `fit` returns, so Ray's worker restarts all log into the same run; rank 0 alone
logs step metrics and the exported model. Params are the flattened spec: the spec has no
secrets in it (pre-flight refuses them), and keys that look like secrets are dropped anyway.
"""

from __future__ import annotations

import os
import queue
import shutil
import sqlite3
import sys
import threading
import time
from contextlib import closing
from importlib import metadata
from pathlib import Path

from . import storage
from .config import JobSpec
from .problems import SECRET_KEY  # pre-flight refuses secrets in a job file; they are never logged either


# The default store is a sqlite file beside the checkpoints; with checkpoints on an object
# store there is no file every process of the job can open (the driver and rank 0 each made
# one in their own working directory, and rank 0 could not find the run).
REMOTE_WITHOUT_SERVER = ("checkpoint.storage_path is remote and tracking.uri is unset: the default MLflow store is a "
                         "sqlite file, which the job's processes on other nodes cannot share; set tracking.uri to an "
                         "MLflow server (http://mlflow:5000, as the k8s/ manifests run one)")


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


def _client(spec: JobSpec):
    from mlflow.tracking import MlflowClient

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
            conn.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                         (f"{artifact_root(spec)}/0",))
        os.link(copy, db)  # never over a store another process created meanwhile
    except FileExistsError:
        pass
    finally:
        copy.unlink(missing_ok=True)


def start_run(spec: JobSpec) -> str:
    """Driver: the job's run; a job resubmitted to the same run directory continues its run."""
    seed_store(spec)
    client = _client(spec)
    experiment = client.get_experiment_by_name(spec.tracking.experiment)
    if experiment is None:
        experiment_id = client.create_experiment(spec.tracking.experiment, artifact_location=artifact_root(spec))
    else:
        experiment_id = experiment.experiment_id
    previous = client.search_runs([experiment_id], f"tags.`raytrain.run_dir` = '{spec.run_dir}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
    if previous and previous[0].info.status != "FINISHED":
        run_id = previous[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    run = client.create_run(experiment_id, run_name=spec.name, tags={"raytrain.run_dir": spec.run_dir,
                                                                      "raytrain.strategy": spec.training.strategy})
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in flatten(spec.model_dump(mode="json")).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    return run.info.run_id


def set_tags(spec: JobSpec, run_id: str, tags: dict) -> None:
    client = _client(spec)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def end_run(spec: JobSpec, run_id: str, status: str, tags: dict | None = None) -> None:
    set_tags(spec, run_id, tags or {})
    _client(spec).set_terminated(run_id, status=status)


def log_goodput(spec: JobSpec, run_id: str, goodput: dict) -> None:
    """Productive vs wasted time and, per failure, steps lost and recovery time."""
    import json

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"goodput_{k}", float(goodput[k]), now, 0) for k in ("wall_s", "productive_s", "wasted_s")]  # host: Python numbers
    metrics.append(Metric("failures", float(len(goodput["failures"])), now, 0))  # host: Python numbers
    for i, failure in enumerate(goodput["failures"]):
        metrics += [Metric("failure_steps_lost", float(failure["steps_lost"]), now, i + 1),  # host: Python numbers
                    Metric("failure_recovery_s", float(failure["recovery_s"]), now, i + 1)]  # host: Python numbers
    client = _client(spec)
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, "raytrain.goodput", json.dumps(goodput)[:5000])


LIVE_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eval_loss", "mfu")


class StepLogger:
    """Rank 0's metric logger: batches of step metrics into the job's run.

    Two histories: the committed one (`loss`, ...: each step once, written when its checkpoint
    commits, so rolled-back steps never appear) and a live one (`live/loss`, ...: written by a
    background thread within moments of each step, never waited for; after a restart a
    rolled-back step may appear there twice)."""

    def __init__(self, spec: JobSpec, run_id: str):
        self.spec, self.run_id, self.client = spec, run_id, _client(spec)
        self._live: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write_live, name="raytrain-live-metrics", daemon=True).start()

    def log_live(self, step: int, metrics: dict[str, float]) -> None:
        """Queue a step's live metrics; the training thread never waits for MLflow."""
        self._live.put((step, {f"live/{k}": metrics[k] for k in LIVE_KEYS if k in metrics}))

    def _write_live(self) -> None:
        from mlflow.entities import Metric

        warned = False
        while True:
            items = [self._live.get()]
            while not self._live.empty():
                items.append(self._live.get())
            now = int(time.time() * 1000)
            try:
                self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for step, m in items  # host: metric values, read once a step
                                                            for k, v in m.items()][:1000])
            except Exception as exc:  # live values are a convenience: training never stops for them
                if not warned:
                    print(f"[raytrain] live metrics not written ({type(exc).__name__}: {exc}); committed ones still "
                          "are", file=sys.stderr, flush=True)
                    warned = True

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])  # host: metric values, read once a step

    def log_many(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for step, metrics in steps for k, v in metrics.items()]  # host: metric values, read once a step
        for i in range(0, len(batch), 1000):  # MLflow's log_batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_missing(self, steps: list) -> int:
        """Log the (step, metrics) pairs whose step MLflow does not have yet; returns how many."""
        have = {m.step for m in self.client.get_metric_history(self.run_id, "loss")}
        missing = [(step, metrics) for step, metrics in steps if step not in have and "loss" in metrics]
        self.log_many(missing)
        return len(missing)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def log_model_dir(self, local_dir: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path="final_model")
