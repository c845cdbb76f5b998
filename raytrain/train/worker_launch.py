"""The train workers' launcher: Ray runs a worker as `<py_executable> default_worker.py ARGS`, and the workers'
runtime_env names this file as that executable (driver/worker_env.launcher). Run so (`python -I -S
worker_launch.py default_worker.py ARGS`: the standard library alone, no site-packages), it asks its node's fork
server (train/forkserver.py) for the worker and stands in for it until it exits. Where there is none yet, it starts
one and waits while it imports (WAIT_S at most, then it runs the worker as Ray would: a slower start, never a failed
one): on a node of few cores a fresh worker's imports beside the server's would slow both.

A worker starts so with torch, transformers' modelling, peft, Ray's worker, Ray Train's actors and raytrain's
worker already imported, where Ray would start a fresh interpreter that imports them (about 8 CPU-seconds a
worker on this project's CPU machine, at every start and restart). The child takes the launcher's environment,
working directory, standard streams, niceness and ignored signals, reports its own pid when it registers, and the
raylet tracks, signals and kills that pid (Ray does the same for workers in containers).

The protocol both sides speak lives here: a length-prefixed JSON message, with descriptors beside it."""

from __future__ import annotations

import array
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time

# What every train worker imports before its first step, slowest last (measured on a CPU worker: torch 1.7 s,
# raytrain's worker 0.5 s, transformers' modelling 3.9 s, peft 0.5 s): the node's base server imports them once,
# and a worker that starts without it imports them in a thread while Ray Train sets the group up (train/entry.py).
STEP_IMPORTS = ("torch", "raytrain.train.worker", "transformers.modeling_utils", "peft")
# Variables that imports read once, as they load (a library's constants, the allocator, the paths, Ray's C++
# config): a server serves only launchers that agree with it on each. The rest is read after the fork, from the
# launcher's environment, which the child takes.
_KEY_PREFIXES = (
    "PYTHON", "LD_", "MIMALLOC_", "MALLOC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH",
    "PYTORCH_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "RAY_", "DS_", "PATH", "VIRTUAL_ENV",
)  # fmt: skip
# Read when called, never as a module loads: what Ray Train copies from the driver into its workers
# (private_apis.ray_train_propagated_env; tests/test_forkserver.py holds the two equal).
_NOT_KEYED = ("RAY_TRAIN_", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "TORCHFT_LIGHTHOUSE")
# `import ray` builds Ray's C++ config from the environment, the job id among it: the job server that imports Ray
# serves one job, the base server it is forked from (which imports no Ray, so reads none of Ray's variables) every
# job of its node, and of any other Ray cluster on the machine.
JOB_ENV = "RAY_JOB_ID"
OWNER_ENV = "RAYTRAIN_FORKSERVER_OWNER"  # the pid a base server lives with: its raylet's, or the driver that started it
# A launcher waits this long for its node's servers to import (the base's 8 CPU-s, the job's 2, on a busy node more)
# before it runs its worker as Ray would: well inside the raylet's 60 s for a worker to register.
WAIT_S = 20.0
FORKED_ENV = "RAYTRAIN_FORKED_FROM"  # in a forked worker: its job server's pid (the start-up line says so)
REPLY_TIMEOUT_S = 60.0  # a fork, on a loaded node
_HEADER = struct.Struct("!I")
# Dispositions a process inherits from its parent (the raylet ignores SIGCHLD, for one): the child takes its launcher's.
INHERITED = (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forked() -> bool:
    """Whether this process was forked by a job server (driver/worker_env.warm_nodes's task: the node's servers
    are started by the first launchers that find none, and ready once a task runs forked)."""
    return FORKED_ENV in os.environ


def keyed(name: str) -> bool:
    return name.startswith(_KEY_PREFIXES) and not name.startswith(_NOT_KEYED)


def key(env: dict[str, str], job: bool = True) -> str:
    """The server for this interpreter and the environment its imports read: the job's, or (job=False) the
    node's base server, which imports no Ray."""
    read = sorted((k, v) for k, v in env.items() if keyed(k) and (job or not k.startswith("RAY_")))
    return hashlib.sha256(json.dumps([sys.executable, job, read]).encode()).hexdigest()[:20]


def address(server_key: str, role: str = "ready") -> str:
    return f"\0raytrain-forkserver-{server_key}-{role}"  # Linux's abstract namespace: no file to clean up


def log_file(args: list[str], server_key: str) -> str:
    """The server's log, in the Ray session's log folder (the worker's --temp-dir and --session-name), or in Ray's
    temporary folder for one a driver starts before its session exists."""
    opts = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)
    temp = opts.get("temp-dir", "/tmp/ray")
    logs = os.path.join(temp, opts["session-name"], "logs") if "session-name" in opts else temp
    return os.path.join(logs, f"raytrain-forkserver-{server_key}.log")


def send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    conn.sendmsg([_HEADER.pack(len(data)), data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, fds) at the end of the stream."""
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 8)
    if not head:
        return None, fds
    try:
        (size,) = _HEADER.unpack(_exactly(conn, _HEADER.size, head))
        return json.loads(_exactly(conn, size)), fds
    except EOFError:
        return None, fds


def _exactly(conn: socket.socket, n: int, data: bytes = b"") -> bytes:
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def launch(worker_file: str, args: list[str]) -> None:
    """Run Ray's worker forked from the node's job server, or exec it as Ray would where that cannot be."""
    env = dict(os.environ)
    isolated = [a.partition("=")[2].lower() for a in args if a.startswith("--enable-resource-isolation")]
    if any(value not in ("false", "0") for value in isolated):
        _exec(worker_file, args)  # Ray's cgroups hold the process it started: a fork would escape them
    conn = _connect(address(key(env))) or _await_job_server(env, args)
    if conn is None:
        _exec(worker_file, args)
    try:
        keep_r, keep_w = os.pipe()  # the child reads until this launcher is gone, then exits
        request = {
            "kind": "worker",
            "worker": worker_file,
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "ignored": [int(s) for s in INHERITED if signal.getsignal(s) == signal.SIG_IGN],
        }
        send(conn, request, [0, 1, 2, keep_r])
        os.close(keep_r)
        conn.settimeout(REPLY_TIMEOUT_S)
        reply, _ = receive(conn)
    except OSError:
        reply = None
    if not reply or "pid" not in reply:
        _exec(worker_file, args)  # refused: the server's log says why
    pid = reply["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # what the raylet sends this process is the worker's
        signal.signal(sig, lambda signum, _: _kill(pid, signum))
    conn.settimeout(None)
    try:
        done, _ = receive(conn)
    except OSError:
        done = None
    if done is None:  # the server is gone: wait for the worker itself
        _wait_pid(pid)
    os._exit(done.get("exit", 1) if done else 1)


def _connect(where: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(where)
        return conn
    except OSError:
        conn.close()
        return None


def _await_job_server(env: dict[str, str], args: list[str]) -> socket.socket | None:
    """A connection to this job's server once it is ready, or None after WAIT_S. It is asked of the node's base
    server, which this launcher starts where none lives; while either imports, the launcher waits."""
    job_key, base_key = key(env), key(env, job=False)
    deadline, asked, started = time.monotonic() + WAIT_S, -1.0, -1.0
    while True:
        conn, now = _connect(address(job_key)), time.monotonic()
        if conn is not None or now > deadline:
            return conn
        if not _lives(job_key) and now - asked > 1.0:  # not yet asked for, or its fork was lost
            base = _connect(address(base_key))
            if base is not None:
                try:
                    send(base, {"kind": "job", "env": env, "args": args})
                except OSError:
                    pass
                base.close()
                asked = now
            elif now - started > 1.0 and not _lives(base_key):  # a second to claim its name before another try
                start_base_server(env, args)
                started = now
        time.sleep(0.05)


def _lives(server_key: str) -> bool:
    """Whether a server of this key is importing or serving: it holds its claim (forkserver._claim) till it exits."""
    claim = address(server_key, "starting").replace("\0", "@", 1).encode()
    with open("/proc/net/unix", "rb") as table:
        return any(line.rstrip().endswith(claim) for line in table)


def start_base_server(env: dict[str, str], args: list[str], owner: int | None = None) -> None:
    """Start the node's base server in `env`, as a grandchild in a session of its own: Ray ends a worker's children
    with the worker (kill_child_processes_on_worker_exit), and the server outlives the worker whose launcher started
    it. It lives while `owner` does (default: the raylet, RAY_RAYLET_PID); the first of those that race claims it."""
    base_key = key(env, job=False)
    child = os.fork()
    if child:
        try:
            os.waitpid(child, 0)
        except ChildProcessError:  # reaped already: this process ignores SIGCHLD as the raylet does
            pass
        return
    try:
        os.setsid()
        if os.fork() == 0:
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                out = os.open(log_file(args, base_key), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            except OSError:
                out = os.open(os.devnull, os.O_WRONLY)
            for target, fd in ((0, null), (1, out), (2, out)):
                os.dup2(fd, target)
            server = [sys.executable, "-m", "raytrain.train.forkserver", base_key]
            os.execve(sys.executable, server, {**env, OWNER_ENV: str(owner or env.get("RAY_RAYLET_PID", 0))})
    finally:
        os._exit(0)


def _exec(worker_file: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, worker_file, *args])


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait_pid(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    select.select([fd], [], [])


if __name__ == "__main__":
    launch(sys.argv[1], sys.argv[2:])
