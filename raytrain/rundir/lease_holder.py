"""Who holds a run directory's lease (lease.py), as a second driver judges it, and the fence a worker
group's rank 0 keeps on it.

A holder is told apart from another process of the same name and pid by its boot and pid namespace
(containers on one host share a host name, not a pid namespace); it is provably gone only when it
released the lease, when it was on this driver's own Ray cluster instance, or when it was in this
very process namespace of this boot and its process is dead. The fence reads the lease every
`CHECK_S` in a thread; a stale token becomes a stop flag on the next step's all-reduce.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from raytrain.errors import JobError
from raytrain.rundir import storage, versioned

FILE = "driver.json"
CHECK_S = 5.0  # how often rank 0 reads the lease while training


def uri(run_dir: str) -> str:
    return storage.join(run_dir, FILE)


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    job = f"submission {holder['submission_id']}" if holder.get("submission_id") else f"Ray job {holder.get('job_id')}"
    return f"{job} (pid {holder.get('pid')} on {holder.get('host')}, since {since})"


def how_to_stop(holder: dict) -> str:
    if holder.get("submission_id"):
        return f"`ray job stop {holder['submission_id']}`"
    return f"Ctrl-C in its shell, or `kill -TERM {holder.get('pid')}` on {holder.get('host')}"


def process_identity() -> dict:
    """What tells this process apart from one with the same host name and pid: the boot and the
    pid namespace (containers on one host share a host name, not a pid namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot": boot, "pidns": pidns}


def gone(holder: dict, cluster: str) -> str | None:
    """Why `holder` provably no longer holds the lease, or None if it may still be running."""
    if holder.get("released"):
        return "it ended and released the run directory"
    if holder.get("cluster") == cluster:  # its control actor was on this cluster instance; this driver now has it
        return "it is gone without closing the run (killed, or its node lost)"
    me = process_identity()
    if all(holder.get(k) == me[k] for k in ("host", "boot", "pidns")) and me["boot"] and me["pidns"]:
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return f"its process {holder['pid']} on this host is dead"
        except (PermissionError, KeyError, ValueError, TypeError):
            pass
    return None


def fenced_message(run_dir: str, holder: dict) -> str:
    who = describe(holder) if holder else "another driver (its lease record is gone)"
    return (
        f"stopped: the run directory {run_dir} was taken over by {who}; this worker group committed "
        "nothing after it, and that driver continues the run"
    )


class Fence:
    """Rank 0 of a worker group: is the lease still the one this group's driver took? (An early
    stop; the commit itself is checked by `commit`.)"""

    def __init__(self, run_dir: str, token: str, every_s: float = CHECK_S):
        self.run_dir, self.token, self.taken_by = run_dir, token, None
        # A daemon thread for the worker process's life: it ends once it has seen a takeover.
        threading.Thread(target=self._run, args=(every_s,), name="raytrain-fence", daemon=True).start()

    def _run(self, every_s: float) -> None:
        while self.taken_by is None:
            time.sleep(every_s)
            try:
                self._check()
            except Exception:  # noqa: BLE001 - unknown is not taken: the next read, or the commit, decides
                pass

    def _check(self) -> None:
        try:
            holder, _ = versioned.load(uri(self.run_dir))
        except versioned.Unreadable:
            return  # unknown is not taken: the commit's conditional write decides
        if holder is None or holder.get("token") != self.token:
            self.taken_by = holder or {}

    @property
    def stale(self) -> bool:
        return self.taken_by is not None

    def require(self) -> None:
        """Read the lease now; a JobError if another driver holds it."""
        self._check()
        if self.taken_by is not None:
            raise JobError(self.message())

    def message(self) -> str:
        return fenced_message(self.run_dir, self.taken_by)
