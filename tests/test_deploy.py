"""Deploying for real, on loopback: a head started by cluster/local-cluster.sh (`ray start
--head`), jobs sent with the real `ray job submit` / `ray job stop` CLI, a real `mlflow server`
for tracking, and a real S3-compatible server (moto's server mode) for data and checkpoints.

One job, as a user runs it: `ray job submit --working-dir . -- python -m raytrain run job.yaml`
with its data and checkpoints on s3://; a training worker is SIGKILLed mid-run (the job resumes
from the checkpoint on S3, never from scratch); `ray job stop` (the job commits its last step
before it ends); the same job submitted again resumes there and runs to SUCCEEDED, its checkpoints,
its final model and its one MLflow run (read back from the server) all there.
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


# ---------------------------------------------------------------- submit, a worker killed, stop, submit again
def test_a_job_on_s3_survives_a_killed_worker_and_a_stop_and_a_second_submit_finishes_its_run(
        cluster, s3, mlflow_server, assets, tmp_path, monkeypatch):
    s3_env, client = s3
    client.upload_file(str(assets / "text.jsonl"), BUCKET, "data/text.jsonl")

    def submit(max_steps: int, *flags: str) -> tuple[str, str]:
        job = write_job(tmp_path / "job.yaml", assets, f"s3://{BUCKET}/runs", name="on-s3",
                        data={"path": f"s3://{BUCKET}/data/text.jsonl"}, training={"max_steps": max_steps},
                        checkpoint={"every_n_steps": 5}, failure={"max_failures": 1},
                        tracking={"uri": mlflow_server[0], "experiment": "deploy-s3", "log_model": True})
        job_id = submission_id("on-s3")
        return job_id, cluster.ray("job", "submit", *flags, "--submission-id", job_id, "--working-dir", ".", "--",
                                   "python", "-m", "raytrain", "run", str(job), timeout=600)

    def committed_step() -> int:  # the latest checkpoint Ray Train registered, read from S3
        try:
            body = client.get_object(Bucket=BUCKET, Key="runs/on-s3/checkpoint_manager_snapshot.json")["Body"].read()
        except client.exceptions.NoSuchKey:
            return 0
        latest = json.loads(body)["latest_checkpoint_result"]
        return int(latest["checkpoint_dir_name"].removeprefix("step_")) if latest else 0

    def wait_until(ready, job_id: str) -> None:
        deadline = time.monotonic() + 420
        while not ready():
            assert cluster.status(job_id) not in TERMINAL and time.monotonic() < deadline, \
                cluster.ray("job", "logs", job_id)[-3000:]
            time.sleep(0.5)

    # 1. Submitted; once a checkpoint is committed on S3, a training worker is SIGKILLed.
    first, _ = submit(400, "--no-wait")
    wait_until(lambda: committed_step() >= 5, first)
    before, old = committed_step(), cluster.train_workers()
    assert old, "no Ray Train worker process found"
    victim = psutil.Process(min(old))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    # The group restarts from S3 and commits a later checkpoint; then `ray job stop`.
    wait_until(lambda: bool(cluster.train_workers() - old) and committed_step() > before, first)
    cluster.ray("job", "stop", first, timeout=300)
    assert cluster.wait(first) == "STOPPED"
    stopped_at = committed_step()
    mlflow, run, history = mlflow_run(mlflow_server, "deploy-s3")
    live = {m.step for m in mlflow.get_metric_history(run.info.run_id, "live/loss")}
    assert run.info.status == "KILLED" and stopped_at == max(live)  # the stop committed the last step trained
    state = json.loads(client.get_object(Bucket=BUCKET, Key=f"runs/on-s3/step_{stopped_at:08d}/train_state.json")["Body"].read())
    assert state["step"] == stopped_at

    # 2. The same job submitted again with 3 more steps: it resumes there and finishes the same MLflow run.
    second, out = submit(stopped_at + 3)
    assert f"Job '{second}' succeeded" in out, out[-3000:]
    assert cluster.status(second) == "SUCCEEDED"
    logs = cluster.ray("job", "logs", second)
    assert "[raytrain] done" in logs
    assert "forwarding" not in logs  # the nodes have the MLflow login and the signing key: nothing rides in runtime_env
    last = stopped_at + 3
    assert committed_step() == last
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="runs/on-s3/")["Contents"]}
    assert {f"runs/on-s3/step_{last:08d}/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json")} <= keys
    assert "runs/on-s3/final_model/adapter_config.json" in keys

    # One MLflow run saw every step; the steps up to the checkpoint committed before the kill ran
    # once: the restart resumed from S3, not from scratch.
    mlflow, run, history = mlflow_run(mlflow_server, "deploy-s3")
    steps = [step for step, _ in history]
    assert run.info.status == "FINISHED" and run.info.run_name == "on-s3" and set(steps) == set(range(1, last + 1))
    assert all(steps.count(s) == 1 for s in range(1, before + 1)), (before, sorted(steps))
    assert run.data.params["training.strategy"] == "fsdp2" and run.data.tags["raytrain.run_dir"] == f"s3://{BUCKET}/runs/on-s3"
    for key, value in s3_env.items():  # the run's artifacts are on S3 too: read with the nodes' S3 settings
        monkeypatch.setenv(key, value)
    assert run.data.tags["raytrain.final_model"] == f"s3://{BUCKET}/runs/on-s3/final_model"
    assert "final_model" in {a.path for a in mlflow.list_artifacts(run.info.run_id)}  # tracking.log_model: true
