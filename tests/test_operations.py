"""The operational faults of a long job on a shared cluster, on the suite's real local Ray cluster:
the tracking server down for a while or until the end (a real `mlflow server`, stopped and
started again), and the same job submitted twice, taken over, and its driver SIGKILLed right
after an asynchronous checkpoint registered (real driver processes, `python -m raytrain run`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import free_port, make_job, mlflow_server_env, ray_train_workers, session_of

BIN = Path(sys.executable).parent
SNAPSHOT = "checkpoint_manager_snapshot.json"


def registered(run_dir: str) -> list[str]:
    """The checkpoints Ray Train registered and still keeps (its run snapshot), oldest first."""
    try:
        snapshot = json.loads(Path(run_dir, SNAPSHOT).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not yet, or being rewritten
        return []
    return sorted(r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"])


def latest_step(run_dir: str) -> int:
    return max((int(name.split("_")[1].split("-")[0]) for name in registered(run_dir)), default=0)  # step_N[-gG]


def worker_said(line: str) -> int:
    """How many times the local cluster's workers printed `line` (Ray's worker log files: what
    reaches the driver's console through Ray's log monitor is not reliably captured by a test)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path(), "logs")
    return sum(f.read_text(errors="replace").count(line) for f in logs.glob("worker-*.out"))


def wait_until(condition, timeout: float = 300, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class MlflowServer:
    """A real `mlflow server` on loopback whose process the test stops and starts again (same
    port, same store), as an outage of the tracking service looks to a job."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        root.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import urllib.request

        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination",
                str(self.root / "artifacts"),
            ],
            stdout=log,
            stderr=log,
            cwd=self.root,
            env={**os.environ, **mlflow_server_env()},
            start_new_session=True,
        )

        def up() -> bool:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return True
            except OSError:
                return False

        wait_until(up, 300, "mlflow server")  # a cold start on a loaded lane: 130 s (446 s with its job runner)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # gone at once, as a crashed or unreachable server
        self.proc.wait(timeout=30)


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    yield server
    if server.proc.poll() is None:
        server.stop()


def history(server: MlflowServer, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run, [m.step for m in client.get_metric_history(run.info.run_id, "loss")]


def run_in_thread(spec):
    from raytrain.driver import launcher

    box: dict = {}

    def target():
        try:
            box["result"] = launcher.run(spec)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_training_goes_on_through_mlflow_outages_and_what_it_missed_is_written_later(
    ray_address, inject_faults, mlflow_server, assets, tmp_path, capfd
):
    # Before: committed metrics were written on rank 0's training thread at every checkpoint; an
    # outage longer than MLflow's own retries failed rank 0, and every restart failed the same way.
    import ray

    from raytrain.driver import control

    inject_faults([{"at": "step", "step": "*", "rank": 0, "action": "pause", "seconds": 0.3}])
    spec = make_job(
        assets,
        tmp_path / "runs",
        name="outage",
        training={"max_steps": 400},
        checkpoint={"every_n_steps": 2, "export_final": False},
        tracking={"uri": mlflow_server.uri, "experiment": "outage"},
    )
    before = {line: worker_said(line) for line in ("MLflow unreachable (", "MLflow reachable again")}
    thread, box = run_in_thread(spec)
    try:
        _outages(spec, thread, box, mlflow_server, before, capfd)
    finally:  # a failed wait must not leave its 400-step job training beside the lane's next tests
        if thread.is_alive():
            with contextlib.suppress(Exception):
                ray.get(control.find_actor(spec.run_dir).request_stop.remote("the test failed"), timeout=30)
            thread.join(timeout=300)


def _outages(spec, thread, box, mlflow_server, before, capfd):
    import ray
    from mlflow.tracking import MlflowClient

    from raytrain import cli
    from raytrain.driver import control

    # 1. Down over two checkpoints, then back: the job neither waits nor restarts, and writes the
    # steps MLflow missed once it is back.
    wait_until(lambda: latest_step(spec.run_dir) >= 2, what="the first checkpoint")
    mlflow_server.stop()
    down_at = latest_step(spec.run_dir)
    wait_until(lambda: latest_step(spec.run_dir) >= down_at + 4, what="two checkpoints while MLflow is down")
    back_from = latest_step(spec.run_dir)
    mlflow_server.start()
    client = MlflowClient(mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    wait_until(
        lambda: max((m.step for m in client.get_metric_history(run.info.run_id, "loss")), default=0) > back_from,
        what="the kept steps written",
    )
    # ... and rank 0's writer retried and found it (its pause after a failed write doubles to 30 s, and
    # the driver may write the kept steps first): the next outage is one of its own, not this one's.
    wait_until(
        lambda: worker_said("MLflow reachable again") > before["MLflow reachable again"], what="rank 0 to find MLflow"
    )

    # 2. Down again until the job ends (stopped as `ray job stop` stops it): it ends by its training,
    # says where its metrics are kept, and `raytrain sync-metrics` writes them once MLflow is back.
    mlflow_server.stop()
    down_at = latest_step(spec.run_dir)
    wait_until(lambda: latest_step(spec.run_dir) > down_at, what="a checkpoint while MLflow is down again")
    ray.get(control.find_actor(spec.run_dir).request_stop.remote("SIGTERM"))
    thread.join(timeout=600)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.goodput["failures"] == []  # nothing restarted, nothing charged to the failure budget
    said = capfd.readouterr()
    said_by_rank_0 = {line: worker_said(line) - n for line, n in before.items()}
    assert said_by_rank_0 == {"MLflow unreachable (": 2, "MLflow reachable again": 1}  # once an outage, once back
    assert f"`raytrain sync-metrics {spec.run_dir}`" in said.err
    # The steps MLflow missed are kept in storage, each step written once: a checkpoint's own in a
    # file of their own (which rank 0 and the driver read; train_state.json, which every rank of a
    # restore reads, stays small), those of earlier checkpoints in the run directory's backlog.
    # Before, every checkpoint rewrote all the outage's steps.
    from raytrain.rundir.checkpoints import METRICS_FILE, STATE_FILE, latest_checkpoint
    from raytrain.rundir.metrics_backlog import FOLDER

    last = Path(latest_checkpoint(spec.run_dir))
    assert "metrics" not in json.loads((last / STATE_FILE).read_text())
    own = [step for step, _ in json.loads((last / METRICS_FILE).read_text())]
    assert own[-1] == result.metrics["step"] and own[0] > result.metrics["step"] - 2  # every_n_steps 2 (or the stop's)
    kept = [
        (step, *sorted(metrics))
        for f in sorted(Path(spec.run_dir, FOLDER).glob("steps_*.json"))
        for step, metrics in json.loads(f.read_text())["steps"]
    ]  # a step's metrics, and its checkpoint_step
    assert kept and len(kept) == len(set(kept)) and max(kept)[0] < own[0], (kept, own)
    assert cli.main(["sync-metrics", spec.run_dir]) == cli.EXIT_FAILED  # still down: nothing changes
    mlflow_server.start()
    assert cli.main(["sync-metrics", spec.run_dir]) == cli.EXIT_OK, capfd.readouterr().err[-3000:]
    run = client.get_run(run.info.run_id)
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(logged) == list(range(1, result.metrics["step"] + 1))  # every step once
    assert run.info.status == "KILLED"  # a stopped job's status, set once MLflow took it
    assert json.loads(run.data.tags["raytrain.goodput"])["failures"] == []
    assert not Path(spec.run_dir, "mlflow_pending.json").exists()
    assert not list(Path(spec.run_dir, FOLDER).glob("steps_*.json"))  # MLflow has them: the backlog is gone


def test_which_steps_mlflow_has_is_one_read_of_the_run_not_its_history(tmp_path):
    # Every write that may have landed (a failed request, a restore, the driver's close) used to
    # read the whole `loss` history to find which steps the run had: ~10 MB at 100k steps.
    import shutil
    from importlib import metadata

    from mlflow.tracking import MlflowClient

    from raytrain.tracking import mlflow_run

    class Counting(MlflowClient):  # the real client, counting the history reads it is asked for
        histories = 0

        def get_metric_history(self, *args, **kwargs):
            Counting.histories += 1
            return super().get_metric_history(*args, **kwargs)

    shutil.copyfile(mlflow_run._template(metadata.version("mlflow")), tmp_path / "mlflow.db")
    client = Counting(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = client.create_run(client.create_experiment("watermark")).info.run_id
    steps = [(s, {"loss": 1 / s, "lr": 0.1, "grad_norm": 2.0}) for s in range(1, 1201)]  # 4 requests' worth
    assert mlflow_run.log_missing(client, run_id, steps[:700]) == 700
    assert mlflow_run.log_missing(client, run_id, steps) == 500  # the first 700 landed: only the rest
    assert mlflow_run.log_missing(client, run_id, steps) == 0
    assert Counting.histories == 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 1201))  # each once
    assert client.get_run(run_id).data.metrics[mlflow_run.LOGGED_THROUGH] == 1200

    # A server that dies inside a request: MLflow commits log_batch's metrics in one transaction
    # and its tags in another, so a request can land without its tags (CI saw 12 steps twice when
    # the watermark was a tag). The next write must still see the steps that landed.
    class Dying(MlflowClient):
        def log_batch(self, run_id, metrics=(), params=(), tags=(), **kwargs):
            super().log_batch(run_id, metrics=metrics)  # the first transaction commits ...
            raise ConnectionError("the server died before the request's tags")  # ... then the server dies

    run_id = client.create_run(client.get_experiment_by_name("watermark").experiment_id).info.run_id
    assert mlflow_run.log_missing(client, run_id, steps[:5]) == 5
    with pytest.raises(ConnectionError):
        mlflow_run.log_missing(Dying(client.tracking_uri), run_id, steps[:10])
    assert mlflow_run.log_missing(client, run_id, steps[:20]) == 10  # what landed is not written again
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 21))


def test_sync_metrics_of_a_folder_that_is_no_run_directory_says_so(tmp_path, capsys):
    from raytrain import cli

    assert cli.main(["sync-metrics", str(tmp_path)]) == cli.EXIT_INVALID
    said = capsys.readouterr().err
    assert f"{tmp_path} is not a run directory (it has no job.json)" in said and "Traceback" not in said


class Driver:
    """`python -m raytrain run job.yaml` as a user's shell (or a RayJob) starts it."""

    started: list[Driver] = []  # by the running test: `no_driver_left` ends those it left

    def __init__(self, job_file: Path, log: Path, address: str | None, *extra: str):
        """`address` None: no cluster to join, so the driver starts a local Ray instance of its own."""
        self.log = log
        Driver.started.append(self)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain", "run", str(job_file), *extra],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env={**env, **({"RAY_ADDRESS": address} if address else {})},
        )

    @property
    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, line: str, timeout: float = 300) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None or line in self.text, self.text[-3000:]
            return line in self.text

        wait_until(seen, timeout, line)

    def wait(self, timeout: float = 600) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture(autouse=True)
def no_driver_left():
    """A test that failed part-way must not leave its drivers (and a driver's own Ray instance, its
    workers) training beside the lane's next tests: their load fails those too."""
    import psutil

    yield
    for driver in Driver.started:
        if driver.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                family = [psutil.Process(driver.proc.pid), *psutil.Process(driver.proc.pid).children(recursive=True)]
                for p in family:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGCONT)  # a frozen one takes the kill too
                        p.kill()
            driver.proc.wait(timeout=60)
    Driver.started.clear()


def slow_job(inject_faults, assets, tmp_path, name: str, steps: int, keep_last: int, faults=()):
    """(spec, its YAML file, a folder for drivers' logs) of a job whose steps take 0.3 s more
    (long enough for a second driver to meet it), checkpointing every 3 steps in the background."""
    inject_faults([{"at": "step", "step": "*", "rank": 0, "action": "pause", "seconds": 0.3}, *faults])
    spec = make_job(
        assets,
        tmp_path / "runs",
        name=name,
        training={"max_steps": steps},
        checkpoint={"every_n_steps": 3, "keep_last": keep_last, "async_save": True, "export_final": False},
        tracking={"experiment": name},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    (tmp_path / "drivers").mkdir()
    return spec, job_file, tmp_path / "drivers"


def test_one_job_one_driver_a_takeover_and_a_killed_driver_resumed_where_its_workers_resume(
    ray_address, inject_faults, assets, tmp_path
):
    # Before: a second submit killed the first's control actor and trained into the same run
    # directory beside it; and with async saves and keep_last 1 the driver looked for a COMMITTED
    # marker that Ray's pruning could leave on no folder, while the workers restored Ray's latest.
    from mlflow.tracking import MlflowClient

    from raytrain.tracking.mlflow_run import tracking_uri

    steps = 24
    spec, job_file, logs = slow_job(inject_faults, assets, tmp_path, "lease", steps, keep_last=1)

    first = Driver(job_file, logs / "first.log", ray_address)
    first.wait_for(f"[raytrain] step 1/{steps}")
    job_json = Path(spec.run_dir, "job.json").read_text()
    second = Driver(job_file, logs / "second.log", ray_address)
    assert second.wait(timeout=120) == 1  # refused
    assert "is in use by another driver of this job" in second.text and f"pid {first.proc.pid} " in second.text
    assert "--takeover" in second.text and "Traceback" not in second.text
    assert first.proc.poll() is None and Path(spec.run_dir, "job.json").read_text() == job_json  # untouched

    third = Driver(job_file, logs / "third.log", ray_address, "--takeover")
    assert first.wait() == 0  # asked to checkpoint and stop: it did, and ended as a stopped job ends
    stopped_at = int(first.text.split("[raytrain] done in ")[1].split("step ")[1].split()[0])
    assert 1 <= stopped_at < steps - 3
    third.wait_for("[raytrain] step ")
    assert f"resuming from {spec.run_dir}/step_{stopped_at:08d} (step {stopped_at})" in third.text
    after = next(s for s in range(stopped_at + 1, steps) if s % 3 == 0)  # its next (asynchronous) save
    # The run directory's second driver (generation 2) writes its checkpoints in folders of its own
    wait_until(
        lambda: f"step_{after:08d}-g2" in registered(spec.run_dir) or third.proc.poll() is not None,
        what=f"step {after}'s asynchronous checkpoint",
    )
    third.proc.send_signal(signal.SIGKILL)  # right after Ray registered it, before the next save marked anything
    third.wait()

    fourth = Driver(job_file, logs / "fourth.log", ray_address)
    assert fourth.wait() == 0, fourth.text[-3000:]
    assert "taking over the run directory from" in fourth.text and f"pid {third.proc.pid} " in fourth.text
    # The driver (its data and model checks) and the workers (what they load) use one checkpoint.
    assert f"resuming from {spec.run_dir}/step_{after:08d}-g2 (step {after})" in fourth.text
    assert f"restored step {after} from {spec.run_dir}/step_{after:08d}-g2" in fourth.text
    client = MlflowClient(tracking_uri(spec))
    (run,) = client.search_runs([client.get_experiment_by_name("lease").experiment_id])  # one run for the job
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, steps + 1))
    assert run.info.status == "FINISHED"


def test_drivers_on_two_ray_clusters_leave_one_writer(ray_address, inject_faults, assets, tmp_path):
    # Before: a driver with no cluster to join starts a local Ray instance, where the first
    # driver's control actor is invisible; it read driver.json as a dead holder's, took over and
    # trained into the first's run beside it. Now the lease in storage refuses it, naming the first.
    # With --takeover while the first job hangs (its driver and workers stopped, as a frozen VM or
    # a long GC pause leaves them), the lease's generation moves on; resumed, the first's workers
    # commit nothing more (each commit is a conditional write on the lease: lease.commit), and the
    # new driver resumes from the last checkpoint they committed.
    from mlflow.tracking import MlflowClient

    from raytrain.rundir.signing import MANIFEST
    from raytrain.tracking.mlflow_run import tracking_uri

    steps = 30
    run_dir = tmp_path / "runs" / "fence"
    # The first job hangs after step 10, once step 9's background checkpoint is registered: the
    # pause, then SIGSTOP of its driver and workers. (A group frozen mid-upload of a checkpoint it
    # committed before the takeover is waited for by the new driver, checkpoint.await_committed.)
    hang = {
        "at": "step",
        "step": 10,
        "rank": 0,
        "action": "pause",
        "seconds": 8,
        "after_commit": {"run_dir": str(run_dir), "step": 9},
    }
    spec, job_file, logs = slow_job(inject_faults, assets, tmp_path, "fence", steps, keep_last=20, faults=[hang])
    assert spec.run_dir == str(run_dir)

    first = Driver(job_file, logs / "first.log", None)  # its own local Ray instance
    first.wait_for("[raytrain] step 4/", timeout=400)
    second = Driver(job_file, logs / "second.log", ray_address)  # the tests' cluster: another one
    assert second.wait(timeout=120) == 1, second.text[-3000:]
    assert "is in use by another driver of this job" in second.text and f"pid {first.proc.pid} " in second.text
    assert "on another Ray cluster" in second.text and "--takeover" in second.text and "Traceback" not in second.text
    assert first.proc.poll() is None

    workers = sorted(ray_train_workers(session_of(first.proc.pid)))  # of its own local Ray instance
    hung = [first.proc.pid, *workers]
    assert len(workers) == 2, workers
    first.wait_for("[test] fault injection: pause rank 0 at step of step 10")
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)
    third = Driver(job_file, logs / "third.log", ray_address, "--takeover")
    third.wait_for("[raytrain] step ", timeout=400)
    resumed = int(third.text.split("(step ")[1].split(")")[0]) if "resuming from" in third.text else 0
    after = next(s for s in range(resumed + 1, steps) if s % 3 == 0)
    wait_until(
        lambda: f"step_{after:08d}-g2" in registered(spec.run_dir) or third.proc.poll() is not None,
        what=f"the new driver's first checkpoint (step {after})",
    )
    for pid in hung:
        os.kill(pid, signal.SIGCONT)
    assert first.wait(timeout=300) != 0
    assert "was taken over by" in first.text and f"pid {third.proc.pid} " in first.text, first.text[-3000:]
    assert third.wait() == 0, third.text[-3000:]

    # Every committed checkpoint (its signed manifest) is the first driver's (generation 1, step_N) up
    # to where the third resumed, the third's (step_N-g2) after: the fenced group committed nothing
    # after the takeover (goal 0). Its files may have landed, in its own folders, never signed.
    signed = sorted(f.name for f in Path(spec.run_dir).glob("step_*") if (f / MANIFEST).exists())
    firsts = [int(n[5:]) for n in signed if "-g" not in n]
    thirds = [int(n[5:].removesuffix("-g2")) for n in signed if n.endswith("-g2")]
    assert resumed >= 3 and max(firsts) == resumed and min(thirds) > resumed, (resumed, signed)
    assert len(firsts) + len(thirds) == len(signed) and thirds[-1] == steps, signed
    client = MlflowClient(tracking_uri(spec))
    (run,) = client.search_runs([client.get_experiment_by_name("fence").experiment_id])  # one run for the job
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, steps + 1))
