"""A node's fork servers, which train/worker_launch.py asks for workers.

Two levels, because `import ray` builds Ray's C++ config from the environment once, the job id among it:
- the *base* server, one a node and an environment, imports what needs no Ray (`BASE_IMPORTS`: torch,
  transformers' modelling, peft, raytrain's worker, numpy, pandas, pyarrow) and forks a job server for each job
  whose launcher asks (`python -m raytrain.train.forkserver KEY`). The first launcher of a node that finds none
  starts it, and it lives while that raylet does; a driver that starts its own local cluster starts it before Ray
  (driver/worker_env.start_fork_server), and it lives while that driver does;
- a *job* server takes the job's environment, imports Ray's worker and Ray Train's actors (`JOB_IMPORTS`, about
  2 s where the base's imports are 8), and forks that job's workers; it exits with its raylet, or once no worker
  of it is alive and none was asked for in IDLE_EXIT_S.

What makes a fork safe, each checked before it is made, else the launcher execs Ray's worker as Ray would:
- no Python thread runs in a server but its main one, and no torch op ran (OpenMP's pool starts at first use);
  native pools (OpenBLAS's, jemalloc's background thread) stop and restart around a fork by their own atfork
  handlers, as torch's fork-started DataLoader workers rely on;
- Ray's C++ id generator is first seeded in each worker, not in the job server
  (private_apis.actor_class_ids_from_urandom);
- no file a server imported changed since (an upgrade, an edit): it exits, and the next launcher starts anew;
- the environment its imports read (worker_launch.key) is the request's: other values get another server;
- only Ray's own default_worker.py is run, for a peer of the same user (SO_PEERCRED)."""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from raytrain.train import worker_launch as wl

BASE_IMPORTS = ("numpy", "pandas", "pyarrow", "pyarrow.fs", "pyarrow.parquet", *wl.STEP_IMPORTS)
IDLE_EXIT_S = 60.0


def serve_base(base_key: str) -> None:
    """The node's base server (worker_launch.start_base_server execs it, in a launcher's environment or in the
    one a driver gives it): once its imports are done it forks a server for each job whose launcher asks."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # inherited ignored from the raylet: a server reaps its children
    lock = _claim(base_key)
    if lock is None:
        return
    _import(BASE_IMPORTS)
    _serve(base_key, lock, "job", _spawn_job_server, idle_exit_s=None)


def _serve_job(job_key: str, message: dict) -> None:
    """In a child of the base server: become the job's server. Never returns."""
    try:
        os.setsid()
        _take_over(message, cwd="/")
        out = os.open(wl.log_file(message["args"], job_key), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(out, 2)
        lock = _claim(job_key)
        if lock is not None:
            from raytrain import private_apis

            private_apis.actor_class_ids_from_urandom()  # else every worker makes its siblings' "random" ids
            _import((*private_apis.ray_worker_modules(), "raytrain.train.entry"))
            _serve(job_key, lock, "worker", _fork_worker, idle_exit_s=IDLE_EXIT_S)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(0)


def _claim(server_key: str) -> socket.socket | None:
    """One server a key: of the launchers that race, the first to bind its name starts it."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(wl.address(server_key, "starting"))
    except OSError:
        lock.close()
        return None
    return lock


# What the imports set in os.environ (torch's TORCHINDUCTOR_CACHE_DIR, Ray's RAY_CLIENT_MODE): a fresh worker's
# own imports would have set them, so a forked one gets them where its launcher's environment has none.
_SET_BY_IMPORTS: dict[str, str] = {}


def _import(names: tuple[str, ...]) -> None:
    before = dict(os.environ)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker's own import says what is wrong
            print(f"[raytrain] fork server: {name} did not import ({type(exc).__name__}: {exc})", flush=True)
    _SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if before.get(k) != v})


def _serve(server_key: str, lock: socket.socket, kind: str, handle, idle_exit_s: float | None) -> None:
    files = _loaded_files()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(wl.address(server_key))  # launchers connect once the imports are done
    listener.listen(128)
    owner = int(os.environ.get(wl.OWNER_ENV) or os.environ.get("RAY_RAYLET_PID") or 0)  # a job's: its raylet
    children: dict[int, socket.socket | None] = {}
    gc.collect()
    gc.freeze()  # what the server made stays out of the children's collections: fewer pages copied
    active = time.monotonic()
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        if _reap(children) or (children and idle_exit_s):
            active = time.monotonic()
        if (owner and not _alive(owner)) or (idle_exit_s and time.monotonic() - active > idle_exit_s):
            return
        if not readable:
            continue
        active = time.monotonic()
        conn, _ = listener.accept()
        try:
            message, fds = wl.receive(conn)
        except (OSError, ValueError):  # a peer gone, or not a launcher
            message, fds = None, []
        refusal = None if message is None else _refusal(conn, message, kind, server_key, files)
        if message is None or refusal:  # a probe that only connected (is the server up?), or refused
            for fd in fds:
                os.close(fd)
            if refusal:
                print(f"[raytrain] fork server: {refusal}; the worker starts as Ray starts it", flush=True)
                _reply(conn, {"refused": refusal})
            conn.close()
            if refusal and refusal.startswith("changed"):  # the next launcher starts one on what is installed now
                return
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            lock.close()
            for other in children.values():
                if other is not None:
                    other.close()
            handle(conn, message, fds)  # never returns
        for fd in fds:
            os.close(fd)
        children[pid] = conn if kind == "worker" else None
        print(f"[raytrain] fork server: forked {kind} {pid}", flush=True)
        _reply(conn, {"pid": pid})
        if kind != "worker":
            conn.close()


def _reply(conn: socket.socket, message: dict) -> None:
    try:
        wl.send(conn, message)
    except OSError:  # its launcher is gone
        pass


def _spawn_job_server(conn: socket.socket, message: dict, fds: list[int]) -> None:
    conn.close()
    _serve_job(wl.key(message["env"]), message)


def _fork_worker(conn: socket.socket, message: dict, fds: list[int]) -> None:
    """In the forked child: become the process Ray would have started, then run Ray's worker. Never returns."""
    code = 1
    try:
        conn.close()
        os.setsid()
        for sig in wl.INHERITED:
            signal.signal(sig, signal.SIG_IGN if int(sig) in message["ignored"] else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        _exit_with(fds[3])
        server = os.getppid()
        _take_over(message, cwd=message["cwd"])
        os.environ[wl.FORKED_ENV] = str(server)
        if os.getpriority(os.PRIO_PROCESS, 0) != message["nice"]:
            os.setpriority(os.PRIO_PROCESS, 0, message["nice"])
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


def _take_over(message: dict, cwd: str) -> None:
    """The requesting launcher's environment (and what the server's imports set that it lacks) and working
    directory, and a sequence of its own for `random`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(message["env"])
    for name, value in _SET_BY_IMPORTS.items():
        os.environ.setdefault(name, value)
    import random

    random.seed()


def _exit_with(fd: int) -> None:
    """The child ends when its launcher does (killed before the worker registered, say)."""

    def watch():
        while os.read(fd, 1):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="raytrain-launcher-watch", daemon=True).start()


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


def _refusal(
    conn: socket.socket, message: dict, kind: str, server_key: str, files: dict, threads: int | None = None
) -> str | None:
    """Why this request may not be forked here, or None (threads: the server's Python threads, counted here)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return f"a request from user {uid} (pid {pid})"
    if message.get("kind") != kind:
        return f"a {message.get('kind')!r} request at a server of {kind}s"
    if kind == "worker":
        from raytrain import private_apis

        if os.path.realpath(message.get("worker", "")) != private_apis.ray_worker_file():
            return "not Ray's default_worker.py"
    if wl.key(message.get("env", {}), job=kind == "worker") != server_key:
        return "another environment"
    if (threading.active_count() if threads is None else threads) != 1:
        return "a Python thread besides the main one in the server"
    for path, seen in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return f"changed since it was imported: {path}"
        if (st.st_mtime_ns, st.st_size) != seen:
            return f"changed since it was imported: {path}"
    return None


def _reap(children: dict) -> int:
    """Report the workers that exited to their launchers; how many children did."""
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
            _reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
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
    serve_base(sys.argv[1])
