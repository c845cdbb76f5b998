"""The train workers' launcher (train/worker_launch.py) as the raylet runs it (`python -I -S worker_launch.py
default_worker.py ARGS`), against Ray's real default_worker.py and a stand-in raylet (a process whose pid the
launcher's environment names, as the raylet's does), and the node's fork servers (train/forkserver.py): a base
server a stand-in driver started (it goes with that driver) or the first launcher did (it goes with the raylet); a
launcher that finds it importing waits, has it fork the job's server, and is forked by that one with its own streams
and exit code; the jobs' servers go with their raylet; a server that never gets ready costs a launcher WAIT_S, then
the worker runs as Ray would. `--help` makes the worker print its
usage and exit, which is all of a worker that runs without a cluster. What a server refuses to fork (another
program than Ray's worker, another environment, a file it imported that changed since) is checked on its rule.
A train job's workers forked from a warm server are tests/test_spine.py's (the MLflow run's
`raytrain.worker_start`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from raytrain import private_apis
from raytrain.train import forkserver
from raytrain.train import worker_launch as wl

WORKER = Path(ray.__file__).parent / "_private" / "workers" / "default_worker.py"


def launch(env: dict, logs: Path) -> subprocess.CompletedProcess:
    args = [f"--temp-dir={logs.parent.parent}", f"--session-name={logs.parent.name}", "--help"]
    return subprocess.run(
        [sys.executable, "-I", "-S", wl.__file__, str(WORKER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def servers(key: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if key.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_workers_fork_from_a_warm_job_server_with_their_launchers_streams_and_the_servers_go_with_their_owners(
    tmp_path,
):
    logs = tmp_path / "ray" / "session_test" / "logs"
    logs.mkdir(parents=True)
    driver, raylet = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"])
    env = {**os.environ, "RAY_RAYLET_PID": str(raylet.pid), "RAY_JOB_ID": "0a000000", "RAY_ADDRESS": "10.0.0.1:6379"}
    env["HF_RAYTRAIN_TEST"] = str(tmp_path)  # keyed: servers of this test's own, whatever else runs on the machine
    other = {**env, "RAY_JOB_ID": "0b000000"}  # a second job on the node
    third = {**env, "RAY_JOB_ID": "0c000000"}
    base = wl.key(env, job=False)
    try:
        # A driver that starts its own cluster starts the base server before Ray is up: its environment lacks
        # Ray's variables, which the base's key leaves out. It lives while that driver does.
        wl.start_base_server(
            {k: v for k, v in env.items() if not k.startswith("RAY_")}, [f"--temp-dir={logs}"], driver.pid
        )
        # It claims its name while Ray starts: a launcher that came sooner would start a base of its own (living
        # with the raylet), and the first to claim wins (a CI run, under load: this driver's base lost the race).
        wait_until(lambda: wl._lives(base), logs)
        # The first launcher finds it importing: it waits, has it fork the job's server (which imports Ray's
        # worker), and is forked by that one, with its own streams and exit code.
        first = launch(env, logs)
        assert first.returncode == 0 and "usage: default_worker.py" in first.stdout, first
        assert forks(logs, env) == 1
        assert launch(env, logs).stdout == first.stdout and forks(logs, env) == 2
        assert launch(other, logs).returncode == 0 and forks(logs, other) == 1  # another job: its own server
        assert len(servers(base)) == 3  # the base and the two jobs' (forks of it)
        driver.kill()  # the base goes with the driver that started it; the jobs' servers with their raylet
        driver.wait()
        wait_until(lambda: len(servers(base)) == 2, logs)
        # A launcher that finds no base server starts one (living while its raylet does) and waits for it.
        assert launch(third, logs).returncode == 0 and forks(logs, third) == 1
        assert len(servers(base)) == 4
    finally:
        for owner in (driver, raylet):
            owner.kill()
            owner.wait()
    wait_until(lambda: not servers(base), logs, timeout_s=30)


def forks(logs: Path, env: dict) -> int:
    """How many workers that job's server forked (its log says each)."""
    log = logs / f"raytrain-forkserver-{wl.key(env)}.log"
    return log.read_text().count("forked worker") if log.exists() else 0


def test_a_launcher_waits_for_an_importing_server_at_most_wait_s(monkeypatch):
    env = {**os.environ, "RAY_JOB_ID": "0d000000", "HF_RAYTRAIN_TEST": "a key no server has"}
    monkeypatch.setattr(wl, "WAIT_S", 1.0)
    claim = forkserver._claim(wl.key(env))  # a job server that imports and never gets ready
    try:
        assert wl._lives(wl.key(env)) and not wl._lives(wl.key({**env, "RAY_JOB_ID": "0e000000"}))
        began = time.monotonic()
        assert wl._await_job_server(env, []) is None  # the worker then starts as Ray starts it
        assert 1.0 <= time.monotonic() - began < 10
    finally:
        claim.close()
    assert not wl._lives(wl.key(env))


def wait_until(is_ready, logs: Path, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while not is_ready():
        assert time.time() < deadline, "\n".join(f.read_text() for f in logs.glob("raytrain-forkserver-*.log"))
        time.sleep(0.5)


def test_the_server_forks_only_ray_workers_of_its_user_and_environment_on_the_files_it_imported(tmp_path):
    module = tmp_path / "imported.py"
    module.write_text("x = 1\n")
    files = {str(module): (module.stat().st_mtime_ns, module.stat().st_size)}
    env = dict(os.environ)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # a peer of this user

    def refusal(request, kind="worker", threads=1):  # pytest's process may run threads of its own
        return forkserver._refusal(ours, request, kind, wl.key(env, job=kind == "worker"), files, threads)

    try:
        request = {"kind": "worker", "worker": str(WORKER), "env": env}
        assert refusal(request) is None
        assert refusal({"kind": "job", "env": env}, kind="job") is None
        assert refusal(request, kind="job") == "a 'worker' request at a server of jobs"
        assert refusal(request, threads=2) == "a Python thread besides the main one in the server"
        assert refusal({**request, "worker": str(module)}) == "not Ray's default_worker.py"
        assert refusal({**request, "env": {**env, "LD_PRELOAD": "x"}}) == "another environment"
        assert refusal({**request, "env": {**env, "RAY_JOB_ID": "0b000000"}}) == "another environment"
        assert refusal({"kind": "job", "env": {**env, "RAY_JOB_ID": "0b000000"}}, kind="job") is None  # every job
        module.write_text("x = 2\n")  # an upgrade or an edit under a running server
        assert refusal(request) == f"changed since it was imported: {module}"
    finally:
        ours.close()
        theirs.close()


def test_the_server_key_takes_what_imports_read_and_leaves_per_job_values():
    # What Ray Train copies into its workers is per job (a timeout, a health-check interval) and read when called.
    assert not [name for name in private_apis.ray_train_propagated_env() if wl.keyed(name)]
    env = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/libmimalloc.so", "RAY_RAYLET_PID": "7", "HOME": "/root"}
    same = {
        **env,
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
        "RAYTRAIN_KEY_ID": "salt:id",
        "PYTEST_CURRENT_TEST": "x",
    }
    assert wl.key(same) == wl.key(env)
    for name, value in [
        ("LD_PRELOAD", ""),
        ("RAY_RAYLET_PID", "8"),
        ("RAY_JOB_ID", "05000000"),  # `import ray` reads it into Ray's C++ config: a server serves one job
        ("HF_HUB_OFFLINE", "1"),
        ("PYTHONPATH", "/x"),
    ]:
        assert wl.key({**env, name: value}) != wl.key(env), name
    # The base imports no Ray: every job's, and a driver's before its cluster is up (no RAY_ variable yet).
    assert wl.key({**env, "RAY_JOB_ID": "05000000", "RAY_RAYLET_PID": "8"}, job=False) == wl.key(env, job=False)
    assert wl.key({**env, "LD_PRELOAD": ""}, job=False) != wl.key(env, job=False)


RANDOM_IDS = """
import os, sys
from raytrain import private_apis
if sys.argv[1] == "server":
    private_apis.actor_class_ids_from_urandom()  # what the fork server does before its imports
import ray.train  # defines actor classes as it loads
from ray._raylet import ObjectID
ids = []
for _ in range(2):
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, ObjectID.from_random().binary())
        os._exit(0)
    os.close(w)
    ids.append(os.read(r, 64))
    os.wait()
print("same" if ids[0] == ids[1] else "different")
"""


def test_forked_workers_make_their_own_random_ids():
    """Ray's C++ id generator is seeded at its first call; children forked after it make each other's ids."""
    said = {
        how: subprocess.run(
            [sys.executable, "-c", RANDOM_IDS, how], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        for how in ("plain", "server")
    }
    assert said == {"plain": "same", "server": "different"}, said
