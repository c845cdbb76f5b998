"""Deploying for real, on loopback: a head started by cluster/local-cluster.sh (`ray start
--head`), jobs sent with the real `ray job submit` / `ray job stop` CLI, a real `mlflow server`
for tracking, and a real S3-compatible server (moto's server mode) for data and checkpoints.

One job, as a user runs it: `ray job submit --working-dir . -- python -m raytrain run job.yaml`
with its data and checkpoints on s3://; a training worker is SIGKILLed mid-run (the job resumes
from the checkpoint on S3, never from scratch); a driver of the same job on another Ray cluster is
refused by the lease on S3, naming the first; `ray job stop` (the job commits its last step
before it ends); the same job submitted again resumes there and runs to SUCCEEDED, its checkpoints,
its final model and its one MLflow run (read back from the server) all there.

A node that joins after the submit, without the cluster's secrets: the job's worker there gets
them from the driver (names in the log, no value in the job's runtime_env) and signs with its key.
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
from conftest import REPO, free_port, make_job, mlflow_server_env, ray_train_workers

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
    server_env = {
        **os.environ,
        **mlflow_server_env(),
        "MLFLOW_AUTH_ADMIN_USERNAME": login["MLFLOW_TRACKING_USERNAME"],
        "MLFLOW_AUTH_ADMIN_PASSWORD": login["MLFLOW_TRACKING_PASSWORD"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
    }
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        stdout=log,
        stderr=log,
        cwd=root,
        env=server_env,
    )
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
        proc = subprocess.run(
            [str(BIN / "ray"), *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
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
            assert time.monotonic() < deadline, (
                f"job {job_id} still {status}:\n{self.ray('job', 'logs', job_id)[-3000:]}"
            )
            time.sleep(3)
        return status

    def train_workers(self) -> set[int]:
        """PIDs of the Ray Train worker processes of this cluster."""
        return ray_train_workers(str(self.state))


@pytest.fixture(scope="module")
def cluster(s3, mlflow_server):
    """The local cluster script, exactly as the README uses it, on free ports and a short state
    dir (Ray's socket paths must stay under 107 characters). The S3 endpoint, its dummy
    credentials and the MLflow login are in the head's environment, as a Secret's would be in a pod's."""
    state = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(
        s3[0],
        **mlflow_server[1],
        RAYTRAIN_CLUSTER_DIR=str(state),
        RAYTRAIN_NUM_CPUS="6",
        RAYTRAIN_STOP_WAIT_S="120",
        RAYTRAIN_GCS_PORT=str(free_port()),
        RAYTRAIN_DASHBOARD_PORT=str(free_port()),
        RAYTRAIN_CLIENT_PORT=str(free_port()),
        RAYTRAIN_AGENT_PORT=str(free_port()),
        RAY_DEDUP_LOGS="0",
        # A user's shell after the README's command 1: the venv is not activated.
        PATH=":".join(p for p in env.get("PATH", "").split(":") if p and Path(p).resolve() != BIN.resolve()),
    )
    script = str(REPO / "cluster" / "local-cluster.sh")
    started = subprocess.run([script, "start"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    for line in started.stdout.splitlines():  # `export KEY=VALUE` lines: how a user's shell gets them via eval
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.replace("$PATH", env["PATH"])
    yield Cluster(env, state)
    subprocess.run([script, "stop"], cwd=REPO, env=env, capture_output=True, timeout=120)
    shutil.rmtree(state, ignore_errors=True)


def stop_node(proc: subprocess.Popen) -> None:
    """A `ray start --block` node started in a session of its own, stopped as local-cluster.sh
    stops a head: SIGTERM to its process group (raylet, agents), SIGKILL to what is left after 3 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


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
    cluster, s3, mlflow_server, assets, tmp_path, monkeypatch
):
    s3_env, client = s3
    client.upload_file(str(assets / "text.jsonl"), BUCKET, "data/text.jsonl")

    def submit(max_steps: int, *flags: str) -> tuple[str, str]:
        job = write_job(
            tmp_path / "job.yaml",
            assets,
            f"s3://{BUCKET}/runs",
            name="on-s3",
            data={"path": f"s3://{BUCKET}/data/text.jsonl"},
            training={"max_steps": max_steps},
            checkpoint={"every_n_steps": 5},
            failure={"max_failures": 1},
            tracking={"uri": mlflow_server[0], "experiment": "deploy-s3", "log_model": True},
        )
        job_id = submission_id("on-s3")
        return job_id, cluster.ray(
            "job",
            "submit",
            *flags,
            "--submission-id",
            job_id,
            "--working-dir",
            ".",
            "--",
            "python",
            "-m",
            "raytrain",
            "run",
            str(job),
            timeout=600,
        )

    def committed_step() -> int:  # the latest checkpoint Ray Train registered, read from S3
        try:
            body = client.get_object(Bucket=BUCKET, Key="runs/on-s3/checkpoint_manager_snapshot.json")["Body"].read()
        except client.exceptions.NoSuchKey:
            return 0
        latest = json.loads(body)["latest_checkpoint_result"]
        return int(latest["checkpoint_dir_name"][5:13]) if latest else 0  # step_N, or step_N-gG by a later driver

    def wait_until(ready, job_id: str) -> None:
        deadline = time.monotonic() + 420
        while not ready():
            assert cluster.status(job_id) not in TERMINAL and time.monotonic() < deadline, cluster.ray(
                "job", "logs", job_id
            )[-3000:]
            time.sleep(0.5)

    # 1. Submitted; once a checkpoint is committed on S3, a training worker is SIGKILLed.
    first, _ = submit(400, "--no-wait")
    wait_until(lambda: committed_step() >= 5, first)
    # Meanwhile a driver of the same job on another Ray cluster (a local instance of its own, as a
    # second `raytrain run` on a laptop starts), sharing the bucket: the lease on S3 refuses it,
    # naming the first, once it saw the first renew (lease.py).
    env = {k: v for k, v in cluster.env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    other = subprocess.Popen(
        [sys.executable, "-m", "raytrain", "run", str(tmp_path / "job.yaml")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    before, old = committed_step(), cluster.train_workers()
    assert old, "no Ray Train worker process found"
    victim = psutil.Process(min(old))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    # The group restarts from S3 and commits a later checkpoint; then `ray job stop`.
    wait_until(lambda: bool(cluster.train_workers() - old) and committed_step() > before, first)
    said = other.communicate(timeout=300)[0]
    assert other.returncode == 1 and "is in use by another driver of this job" in said, said[-3000:]
    assert "on another Ray cluster" in said and "Traceback" not in said
    assert cluster.status(first) == "RUNNING"
    cluster.ray("job", "stop", first, timeout=300)
    assert cluster.wait(first) == "STOPPED"
    stopped_at = committed_step()
    mlflow, run, history = mlflow_run(mlflow_server, "deploy-s3")
    live = {m.step for m in mlflow.get_metric_history(run.info.run_id, "live/loss")}
    assert run.info.status == "KILLED" and stopped_at == max(live)  # the stop committed the last step trained
    state = json.loads(
        client.get_object(Bucket=BUCKET, Key=f"runs/on-s3/step_{stopped_at:08d}/train_state.json")["Body"].read()
    )
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
    assert {
        f"runs/on-s3/step_{last:08d}-g2/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json")
    } <= keys
    assert "runs/on-s3/final_model/adapter_config.json" in keys

    # One MLflow run saw every step; the steps up to the checkpoint committed before the kill ran
    # once: the restart resumed from S3, not from scratch.
    mlflow, run, history = mlflow_run(mlflow_server, "deploy-s3")
    steps = [step for step, _ in history]
    assert run.info.status == "FINISHED" and run.info.run_name == "on-s3" and set(steps) == set(range(1, last + 1))
    assert all(steps.count(s) == 1 for s in range(1, before + 1)), (before, sorted(steps))
    assert (
        run.data.params["training.strategy"] == "fsdp2"
        and run.data.tags["raytrain.run_dir"] == f"s3://{BUCKET}/runs/on-s3"
    )
    for key, value in s3_env.items():  # the run's artifacts are on S3 too: read with the nodes' S3 settings
        monkeypatch.setenv(key, value)
    assert run.data.tags["raytrain.final_model"] == f"s3://{BUCKET}/runs/on-s3/final_model"
    assert "final_model" in {a.path for a in mlflow.list_artifacts(run.info.run_id)}  # tracking.log_model: true


# ---------------------------------------------------------------- a node that joins after the submit
def test_a_node_that_joins_after_the_submit_gets_the_secrets_it_lacks_from_the_driver(
    cluster, s3, mlflow_server, assets, tmp_path, monkeypatch
):
    """A spot node the autoscaler adds mid-run, without the cluster's secrets (no signing key, no
    MLflow login, no S3 keys): the job's worker runs there (only that node has the resource it
    asks for), gets what the node lacks from the driver as it starts, says so by name, and its
    checkpoints verify with the driver's key. No secret value is in the job's runtime_env."""
    from raytrain import cli
    from raytrain.driver import worker_env
    from raytrain.rundir import signing
    from raytrain.train import entry

    s3_env, client = s3
    if "Contents" not in client.list_objects_v2(Bucket=BUCKET, Prefix="data/text.jsonl"):
        client.upload_file(str(assets / "text.jsonl"), BUCKET, "data/text.jsonl")  # as the first test has
    job = write_job(
        tmp_path / "job.yaml",
        assets,
        f"s3://{BUCKET}/runs",
        name="late-node",
        data={"path": f"s3://{BUCKET}/data/text.jsonl"},
        training={"max_steps": 4},
        checkpoint={"every_n_steps": 2},
        scaling={"num_workers": 1, "resources_per_worker": {"late": 1}},
        tracking={"uri": mlflow_server[0], "experiment": "deploy-late"},
    )
    job_id = submission_id("late-node")
    cluster.ray(
        "job",
        "submit",
        "--no-wait",
        "--submission-id",
        job_id,
        "--working-dir",
        ".",
        "--",
        "python",
        "-m",
        "raytrain",
        "run",
        str(job),
    )

    # The node joins once the token store is ready: Ray Data's prepare tasks (spread over the
    # nodes) are no train workers and get nothing from the relay (on a cloud, S3 comes from the
    # instance's role; here a prepare task there was refused by S3).
    deadline = time.monotonic() + 300
    while "token store" not in (logs := cluster.ray("job", "logs", job_id)):  # each CLI call takes ~1 s
        assert time.monotonic() < deadline and cluster.status(job_id) not in TERMINAL, logs[-3000:]
    secrets_here = [k for k in worker_env.SECRETS_ENV if k in cluster.env]
    node_env = {k: v for k, v in cluster.env.items() if k not in worker_env.SECRETS_ENV}
    home, temp = (
        tmp_path / "late-home",
        Path(tempfile.mkdtemp(prefix="rt-late-", dir="/tmp")),
    )  # socket paths stay short
    home.mkdir()
    node_env.update(HOME=str(home), AWS_EC2_METADATA_DISABLED="true")  # no ~/.raytrain/checkpoint.key; not on EC2
    node = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--address",
            f"127.0.0.1:{cluster.env['RAYTRAIN_GCS_PORT']}",
            "--node-ip-address",
            "127.0.0.1",
            "--resources",
            '{"late": 2}',
            "--num-cpus",
            "2",
            "--temp-dir",
            str(temp),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--disable-usage-stats",
            "--block",
        ],
        cwd=tmp_path,
        env=node_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        status = cluster.wait(job_id, timeout=300)
        logs = cluster.ray("job", "logs", job_id)
        assert status == "SUCCEEDED", logs[-3000:]
        # The worker ran on the late node (its log is there), and said what it got, by name.
        said = f"[raytrain] this node lacks {', '.join(secrets_here)}: received from the driver"
        assert signing.KEY_ENV in secrets_here and "MLFLOW_TRACKING_PASSWORD" in secrets_here
        assert said in logs, logs[-3000:]
        _, run, history = mlflow_run(mlflow_server, "deploy-late")  # the worker logged in with the login it got
        assert run.info.status == "FINISHED" and sorted(step for step, _ in history) == [1, 2, 3, 4]
        late_logs = " ".join(p.read_text(errors="replace") for p in temp.glob("session_*/logs/worker-*.out"))
        assert "RayTrainWorker" in late_logs and said in late_logs
        # No value in the workers' runtime_env (Ray's state API and dashboard show it), nor in the log.
        shown = cluster.ray("list", "tasks", "--filter", "name=RayTrainWorker.__init__", "--detail", "--format", "json")
        assert entry.WANTED_ENV in shown and "runtime_env" in shown, shown[-3000:]
        for name in secrets_here:
            value = cluster.env[name]
            assert len(value) < 12 or (value not in shown and value not in logs), (
                name
            )  # S3's dummy "testing" is no secret
    finally:
        stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)
    # The checkpoints the worker signed verify with the driver's key: export reads the latest.
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["export", f"s3://{BUCKET}/runs/late-node", "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "adapter_config.json").exists()
