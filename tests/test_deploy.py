"""Deploying for real, on loopback: a head started by cluster/local-cluster.sh (`ray start
--head`), jobs sent with the real `ray job submit` / `ray job stop` CLI, a real `mlflow server`
for tracking, and a real S3-compatible server (moto's server mode) for data and checkpoints.

1. `ray job submit --working-dir . -- python -m raytrain run job.yaml`, then `ray job stop`: the
   job commits a checkpoint before it ends; the same job submitted again resumes there and runs
   to SUCCEEDED, its checkpoints and its one MLflow run (read back from the server) all there.
2. Data and checkpoints on s3://: a training worker is SIGKILLed mid-run; the job resumes
   from the checkpoint on S3 (never from scratch) and finishes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import REPO, free_port, make_job

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
BUCKET = "raytrain-test"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- real servers on 127.0.0.1
@pytest.fixture(scope="module")
def s3(s3_server):
    env, client = s3_server
    client.create_bucket(Bucket=BUCKET)
    return env, client


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` as k8s/mlflow.yaml runs it: the basic-auth app, its admin and CSRF key from
    the environment (the Secret mlflow-auth there). Yields (uri, the login every client uses:
    the cluster's nodes and this process, as raytrain-secrets gives it to the pods)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    login = {"MLFLOW_TRACKING_USERNAME": "raytrain", "MLFLOW_TRACKING_PASSWORD": secrets.token_hex(12)}
    server_env = {**os.environ, "MLFLOW_AUTH_ADMIN_USERNAME": login["MLFLOW_TRACKING_USERNAME"],
                  "MLFLOW_AUTH_ADMIN_PASSWORD": login["MLFLOW_TRACKING_PASSWORD"],
                  "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts")], stdout=log, stderr=log, cwd=root,
                            env=server_env)
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(urllib.error.HTTPError, match="401"):  # no login, no runs
        urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in login.items():
            patch.setenv(key, value)
        yield uri, login
    stop(proc)
    log.close()


@dataclass
class Cluster:
    env: dict
    state: Path

    def ray(self, *args: str, timeout: float = 180, check: bool = True) -> str:
        proc = subprocess.run([str(BIN / "ray"), *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # the CLI colours some lines
        assert not check or proc.returncode == 0, out
        return out

    def status(self, job_id: str) -> str:
        """`ray job status`: 'Status for job ...: RUNNING' while it runs, a sentence once it ended."""
        text = self.ray("job", "status", job_id)
        if match := re.search(r"Status for job '[^']+': (\w+)", text):
            return match.group(1)
        for words, status in (("succeeded", "SUCCEEDED"), ("was stopped", "STOPPED"), ("failed", "FAILED")):
            if f"Job '{job_id}' {words}" in text:
                return status
        raise AssertionError(f"unexpected `ray job status` output:\n{text}")

    def wait(self, job_id: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while (status := self.status(job_id)) not in TERMINAL:
            assert time.monotonic() < deadline, f"job {job_id} still {status}:\n{self.ray('job', 'logs', job_id)[-3000:]}"
            time.sleep(3)
        return status

    def train_workers(self) -> set[int]:
        """PIDs of the Ray Train worker processes of this cluster (children of its raylet)."""
        pids = set()
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] == "raylet" and str(self.state) in " ".join(proc.info["cmdline"] or []):
                for child in proc.children():
                    with contextlib.suppress(psutil.Error):  # it may exit meanwhile
                        if " ".join(child.cmdline()).startswith("ray::RayTrainWorker"):
                            pids.add(child.pid)
        return pids


@pytest.fixture(scope="module")
def cluster(s3, mlflow_server):
    """The local cluster script, exactly as the README uses it, on free ports and a short state
    dir (Ray's socket paths must stay under 107 characters). The S3 endpoint, its dummy
    credentials and the MLflow login are in the head's environment, as a Secret's would be in a pod's."""
    state = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(s3[0], **mlflow_server[1], RAYTRAIN_CLUSTER_DIR=str(state), RAYTRAIN_NUM_CPUS="6", RAYTRAIN_STOP_WAIT_S="120",
               RAYTRAIN_GCS_PORT=str(free_port()), RAYTRAIN_DASHBOARD_PORT=str(free_port()),
               RAYTRAIN_CLIENT_PORT=str(free_port()), RAYTRAIN_AGENT_PORT=str(free_port()), RAY_DEDUP_LOGS="0",
               # A user's shell after the README's command 1: the venv is not activated.
               PATH=":".join(p for p in env.get("PATH", "").split(":") if p and Path(p).resolve() != BIN.resolve()))
    script = str(REPO / "cluster" / "local-cluster.sh")
    started = subprocess.run([script, "start"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    for line in started.stdout.splitlines():  # `export KEY=VALUE` lines: how a user's shell gets them via eval
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.replace("$PATH", env["PATH"])
    yield Cluster(env, state)
    subprocess.run([script, "stop"], cwd=REPO, env=env, capture_output=True, timeout=120)
    shutil.rmtree(state, ignore_errors=True)


def write_job(path: Path, assets: Path, storage: str, **over) -> Path:
    spec = make_job(assets, storage, **over)  # the conftest's tiny job, as a YAML file a user would write
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return path


def submission_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def mlflow_run(server: tuple[str, dict], experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server[0])  # logs in with MLFLOW_TRACKING_USERNAME/PASSWORD from the environment
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    return client, run, history


# ---------------------------------------------------------------- 1. ray job submit, stop, submit again
def test_ray_job_stop_commits_a_checkpoint_and_a_second_submit_finishes_the_same_run(cluster, mlflow_server, assets,
                                                                                     tmp_path):
    # every_n_steps beyond max_steps: the only checkpoint there can be is the one the stop commits.
    def submit(max_steps: int, *flags: str) -> tuple[str, str]:
        job = write_job(tmp_path / "job.yaml", assets, str(tmp_path / "runs"), name="submitted",
                        training={"max_steps": max_steps}, checkpoint={"every_n_steps": 1000},
                        tracking={"uri": mlflow_server[0], "experiment": "deploy-submit"})
        job_id = submission_id("submitted")
        return job_id, cluster.ray("job", "submit", *flags, "--submission-id", job_id, "--working-dir", ".", "--",
                                   "python", "-m", "raytrain", "run", str(job), timeout=600)

    first, _ = submit(400, "--no-wait")
    deadline = time.monotonic() + 300
    while not re.search(r"step ([3-9]|\d\d+)/400", logs := cluster.ray("job", "logs", first)):
        assert cluster.status(first) not in TERMINAL and time.monotonic() < deadline, logs[-3000:]
        time.sleep(2)
    cluster.ray("job", "stop", first, timeout=300)
    assert cluster.wait(first) == "STOPPED"
    run_dir = tmp_path / "runs" / "submitted"
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    committed = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]  # registered by Ray Train
    stopped_at = json.loads((run_dir / committed / "train_state.json").read_text())["step"]
    assert 3 <= stopped_at < 400 and (run_dir / committed / ".metadata").is_file()
    client, run, history = mlflow_run(mlflow_server, "deploy-submit")
    assert run.info.status == "KILLED" and sorted(step for step, _ in history) == list(range(1, stopped_at + 1))

    # The same job, submitted again with 3 more steps: it resumes there and finishes the same MLflow run.
    second, out = submit(stopped_at + 3)
    assert f"Job '{second}' succeeded" in out, out[-3000:]
    assert cluster.status(second) == "SUCCEEDED"
    logs = cluster.ray("job", "logs", second)
    assert "[raytrain] done" in logs
    assert "forwarding" not in logs  # the nodes have the MLflow login and the signing key: nothing rides in runtime_env
    final = run_dir / f"step_{stopped_at + 3:08d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"} <= {p.name for p in final.iterdir()}
    assert json.loads((final / "train_state.json").read_text())["step"] == stopped_at + 3
    assert (run_dir / "final_model" / "adapter_config.json").is_file()

    client, run, history = mlflow_run(mlflow_server, "deploy-submit")  # still the one run
    assert run.info.status == "FINISHED" and run.info.run_name == "submitted"
    assert sorted(step for step, _ in history) == list(range(1, stopped_at + 4))  # each step once
    assert run.data.params["training.strategy"] == "fsdp2" and run.data.tags["raytrain.run_dir"] == str(run_dir)
    assert "final_model" in {a.path for a in client.list_artifacts(run.info.run_id)}


# ---------------------------------------------------------------- 2. S3 + a worker killed mid-run
def test_s3_data_and_checkpoints_resume_after_a_worker_is_killed(cluster, s3, mlflow_server, assets, tmp_path):
    _, client = s3
    client.upload_file(str(assets / "text.jsonl"), BUCKET, "data/text.jsonl")
    job = write_job(tmp_path / "job.yaml", assets, f"s3://{BUCKET}/runs", name="on-s3",
                    data={"path": f"s3://{BUCKET}/data/text.jsonl"}, training={"max_steps": 20},
                    checkpoint={"every_n_steps": 5}, failure={"max_failures": 1},
                    tracking={"uri": mlflow_server[0], "experiment": "deploy-s3"})
    job_id = submission_id("on-s3")
    cluster.ray("job", "submit", "--no-wait", "--submission-id", job_id, "--working-dir", ".", "--",
                "python", "-m", "raytrain", "run", str(job))

    def committed_step() -> int:
        try:
            body = client.get_object(Bucket=BUCKET, Key="runs/on-s3/checkpoint_manager_snapshot.json")["Body"].read()
        except client.exceptions.NoSuchKey:
            return 0
        latest = json.loads(body)["latest_checkpoint_result"]
        return int(latest["checkpoint_dir_name"].removeprefix("step_")) if latest else 0

    deadline = time.monotonic() + 420
    while (before := committed_step()) < 5:  # a checkpoint on S3, committed by Ray Train
        assert cluster.status(job_id) not in TERMINAL and time.monotonic() < deadline, \
            cluster.ray("job", "logs", job_id)[-3000:]
        time.sleep(0.5)
    old = cluster.train_workers()
    assert old, "no Ray Train worker process found"
    victim = psutil.Process(min(old))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)

    restarted = False
    while (status := cluster.status(job_id)) not in TERMINAL:
        restarted = restarted or bool(cluster.train_workers() - old)
        assert time.monotonic() < deadline + 300, cluster.ray("job", "logs", job_id)[-3000:]
        time.sleep(1)
    logs = cluster.ray("job", "logs", job_id)
    assert status == "SUCCEEDED", logs[-3000:]
    assert restarted, "the worker group was never restarted after the kill"

    # The run finished on S3: last checkpoint committed there, the final model exported there.
    assert committed_step() == 20
    state = json.loads(client.get_object(Bucket=BUCKET, Key="runs/on-s3/step_00000020/train_state.json")["Body"].read())
    assert state["step"] == 20
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="runs/on-s3/")["Contents"]}
    assert "runs/on-s3/step_00000020/.metadata" in keys
    assert any(k.startswith("runs/on-s3/final_model/") for k in keys)

    # One MLflow run saw every step; the steps up to the checkpoint committed before the kill
    # ran once: the restart resumed from S3, not from scratch.
    _, run, history = mlflow_run(mlflow_server, "deploy-s3")
    steps = [step for step, _ in history]
    assert run.info.status == "FINISHED" and set(steps) == set(range(1, 21))
    assert all(steps.count(s) == 1 for s in range(1, before + 1)), (before, sorted(steps))
