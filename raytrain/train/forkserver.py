"""Train workers forked from a warm process: a worker starts with torch, transformers, peft, Ray Train's
worker and raytrain's worker already imported, where Ray would start a fresh interpreter that imports them
(about 8 CPU-seconds a worker on this project's CPU machine, at every start and restart).

Ray runs a worker as `<py_executable> default_worker.py ARGS`; the workers' runtime_env names this file as
that executable (driver/worker_env.py). Run so (`python -I -S forkserver.py default_worker.py ARGS`, the
standard library only), it is the *launcher*: it asks the node's *fork server* for a worker and stands in
for it until it exits. The fork server is one process a job, a node and an environment: the launcher that finds
none starts it (it imports what a worker needs once, then binds its socket), and it lives while its job runs on
its raylet.
For each request it forks a child that takes the launcher's environment, working directory, standard
streams and niceness, and runs Ray's default_worker.py as Ray would have. The child reports its own pid
when it registers, and the raylet tracks, signals and kills that pid (Ray does the same for workers in
containers), so nothing of Ray's bookkeeping changes.

What makes a fork safe here, each checked before it is made, else the launcher execs Ray's worker as Ray
would (a slower start, never a failed one):
- the server runs no Python thread but its main one, and no torch op (OpenMP's pool starts at first use);
- Ray's C++ id generator is first seeded in each child, not in the server (private_apis.actor_class_ids_from_urandom);
- no file it imported changed since (an upgrade, an edit): then it exits, and the next launcher starts a new one;
- the environment that imports read (`_key`) is the server's own: other values get another server;
- only Ray's own default_worker.py is run, for a peer of the same user (SO_PEERCRED).
"""

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
import threading
import time

# What every train worker imports before its first step, slowest last (measured on a CPU worker: torch 1.7 s,
# raytrain's worker 0.5 s, transformers' modelling 3.9 s, peft 0.5 s): the server imports them once a node, and a
# worker that starts without it imports them in a thread while Ray Train sets the group up (train/entry.py).
STEP_IMPORTS = ("torch", "raytrain.train.worker", "transformers.modeling_utils", "peft")
# Variables that imports read once, as they load (a library's constants, the allocator, the paths): a
# server serves only launchers that agree with it on each. Per-job and per-worker values (the job id, the
# workers' settings, secrets) are read by the code that runs after the fork, from the launcher's environment.
_KEY_PREFIXES = (
    "PYTHON", "LD_", "MIMALLOC_", "MALLOC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH",
    "PYTORCH_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "RAY_", "DS_", "PATH", "VIRTUAL_ENV",
)  # fmt: skip
# Read when called, never as a module loads: what Ray Train copies from the driver into its workers
# (private_apis.ray_train_propagated_env; tests/test_forkserver.py holds the two equal). Every other RAY_ variable is
# the server's own: `import ray` builds Ray's C++ config from the environment, the job id (RAY_JOB_ID) among it, so a
# server serves one job of one raylet.
_NOT_KEYED = ("RAY_TRAIN_", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "TORCHFT_LIGHTHOUSE")
IDLE_EXIT_S = 60.0  # a server with no worker alive and no request for this long exits: its job is over
FORKED_ENV = "RAYTRAIN_FORKED_FROM"  # in a forked worker: the server's pid (the start-up line says how workers began)
REPLY_TIMEOUT_S = 60.0  # a fork, on a loaded node
_HEADER = struct.Struct("!I")
# Dispositions a process inherits from its parent (the raylet ignores SIGCHLD, for one): the child takes its launcher's.
_INHERITED = (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forked() -> bool:
    """Whether this process was forked by a server (driver/worker_env.warm_nodes's task: a node's server is
    started by the first launcher that finds none, and ready once a task runs forked)."""
    return FORKED_ENV in os.environ


def keyed(name: str) -> bool:
    return name.startswith(_KEY_PREFIXES) and not name.startswith(_NOT_KEYED)


def _key(env: dict[str, str]) -> str:
    """The server for this interpreter, this raylet and the environment its imports read."""
    read = sorted((k, v) for k, v in env.items() if keyed(k))
    return hashlib.sha256(json.dumps([sys.executable, read]).encode()).hexdigest()[:20]


def _address(key: str, role: str = "ready") -> str:
    return f"\0raytrain-forkserver-{key}-{role}"  # Linux's abstract namespace: no file to clean up


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    conn.sendmsg([_HEADER.pack(len(data)), data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, fds) at the end of the stream."""
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 8)
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


# ---- the launcher: Ray's py_executable, in its worker's place -------------------------------------------


def launch(worker_file: str, args: list[str]) -> None:
    """Run Ray's worker forked from the node's server, or exec it as Ray would where that cannot be."""
    env = dict(os.environ)
    isolated = [a.partition("=")[2].lower() for a in args if a.startswith("--enable-resource-isolation")]
    if any(value not in ("false", "0") for value in isolated):
        _exec(worker_file, args)  # Ray's cgroups hold the process it started: a fork would escape them
    try:
        conn = _connect(_key(env), env, args)
        keep_r, keep_w = os.pipe()  # the child reads until this launcher is gone, then exits
        _send(
            conn,
            {
                "worker": worker_file,
                "args": args,
                "env": env,
                "cwd": os.getcwd(),
                "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "ignored": [int(s) for s in _INHERITED if signal.getsignal(s) == signal.SIG_IGN],
            },
            [0, 1, 2, keep_r],
        )
        os.close(keep_r)
        conn.settimeout(REPLY_TIMEOUT_S)
        reply, _ = _receive(conn)
    except OSError:
        reply = None
    if not reply or "pid" not in reply:
        _exec(worker_file, args)
    pid = reply["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # what the raylet sends this process is the worker's
        signal.signal(sig, lambda signum, _: _kill(pid, signum))
    conn.settimeout(None)
    try:
        done, _ = _receive(conn)
    except OSError:
        done = None
    if done is None:  # the server is gone: wait for the worker itself
        _wait_pid(pid)
    os._exit(done.get("exit", 1) if done else 1)


def _connect(key: str, env: dict[str, str], args: list[str]) -> socket.socket:
    """A connection to the node's server, ready to fork. Where there is none yet, this launcher starts one (in
    the background: this worker starts as Ray starts it, and later ones fork)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_address(key))
        return conn
    except OSError:
        conn.close()
    _start_server(key, env, args)
    raise ConnectionRefusedError(_address(key))


def _start_server(key: str, env: dict[str, str], args: list[str]) -> None:
    """Start the server as a grandchild in a session of its own: Ray ends a worker's children with the worker
    (kill_child_processes_on_worker_exit), and the server outlives the worker whose launcher started it."""
    opts = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)
    logs = os.path.join(opts.get("temp-dir", "/tmp/ray"), opts.get("session-name", "session_latest"), "logs")
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
                log = os.path.join(logs, f"raytrain-forkserver-{key}.log")
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            except OSError:
                out = os.open(os.devnull, os.O_WRONLY)
            for target, fd in ((0, null), (1, out), (2, out)):
                os.dup2(fd, target)
            os.execve(sys.executable, [sys.executable, __file__, "--serve", key], env)
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


# ---- the server ------------------------------------------------------------------------------------------


def serve(key: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # inherited ignored from the raylet: the server reaps its children
    starting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        starting.bind(_address(key, "starting"))  # one server an environment: the launchers that race start one
    except OSError:
        return
    _preload()
    files = _loaded_files()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_address(key))  # launchers connect once the imports are done
    listener.listen(128)
    raylet = int(os.environ.get("RAY_RAYLET_PID", "0"))
    children: dict[int, socket.socket] = {}
    import gc

    gc.collect()
    gc.freeze()  # what the server made stays out of the children's collections: fewer pages copied
    active = time.monotonic()
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        if _reap(children) or children:
            active = time.monotonic()
        if (raylet and not _alive(raylet)) or time.monotonic() - active > IDLE_EXIT_S:
            return
        if not readable:
            continue
        active = time.monotonic()
        conn, _ = listener.accept()
        try:
            message, fds = _receive(conn)
        except (OSError, ValueError):  # a peer gone, or not a launcher
            message, fds = None, []
        if message is None:  # a probe that only connected (is the server up?), or a launcher killed meanwhile
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        refusal = _refusal(conn, message, files)
        if threading.active_count() != 1:
            # Python threads only: the native pools that imports start (OpenBLAS's, jemalloc's background
            # thread) stop and restart around a fork by their own atfork handlers, as torch's fork-started
            # DataLoader workers rely on.
            refusal = refusal or "a Python thread besides the main one in the server"
        if refusal:
            print(f"[raytrain] fork server: {refusal}; the worker starts as Ray starts it", flush=True)
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"refused": refusal})
            except OSError:
                pass
            conn.close()
            if refusal.startswith("changed"):  # the next launcher starts a server on what is installed now
                return
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            starting.close()
            for other in children.values():
                other.close()
            _run_child(conn, message, fds)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        print(f"[raytrain] fork server: forked worker {pid}", flush=True)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass


def _preload() -> None:
    import importlib

    from raytrain import private_apis

    private_apis.actor_class_ids_from_urandom()  # else every child makes its siblings' "random" ids
    for name in (*private_apis.ray_worker_modules(), "raytrain.train.entry", *STEP_IMPORTS):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker's own import says what is wrong
            print(f"[raytrain] fork server: {name} did not import ({type(exc).__name__}: {exc})", flush=True)


def _loaded_files() -> dict[str, tuple[int, int]]:
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_mtime_ns, st.st_size)
    return out


def _refusal(conn: socket.socket, message: dict | None, files: dict[str, tuple[int, int]]) -> str | None:
    """Why this request may not be forked, or None."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return f"a request from user {uid} (pid {pid})"
    from raytrain import private_apis

    if os.path.realpath(message.get("worker", "")) != private_apis.ray_worker_file():
        return "not Ray's default_worker.py"
    if _key(message["env"]) != sys.argv[-1]:
        return "another environment"
    for path, seen in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return f"changed since it was imported: {path}"
        if (st.st_mtime_ns, st.st_size) != seen:
            return f"changed since it was imported: {path}"
    return None


def _run_child(conn: socket.socket, message: dict, fds: list[int]) -> None:
    """In the forked child: become the process Ray would have started, then run Ray's worker. Never returns."""
    code = 1
    try:
        conn.close()
        os.setsid()
        for sig in _INHERITED:
            signal.signal(sig, signal.SIG_IGN if int(sig) in message["ignored"] else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        _exit_with(fds[3])
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"], **{FORKED_ENV: str(os.getppid())})
        if os.getpriority(os.PRIO_PROCESS, 0) != message["nice"]:
            os.setpriority(os.PRIO_PROCESS, 0, message["nice"])
        import random

        random.seed()  # not the server's sequence in every worker
        sys.argv = [message["worker"], *message["args"]]
        import runpy

        runpy.run_path(message["worker"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _exit_with(fd: int) -> None:
    """The child ends when its launcher does (killed before the worker registered, say)."""

    def watch():
        while os.read(fd, 1):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="raytrain-launcher-watch", daemon=True).start()


def _reap(children: dict[int, socket.socket]) -> int:
    """Report the children that exited to their launchers; how many did."""
    reaped = 0
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped += 1
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            conn.close()
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        launch(sys.argv[1], sys.argv[2:])
