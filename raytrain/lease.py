"""The run directory's lease in storage, and the fence that stops a driver's workers once another
driver holds it. One job, one writer, whatever Ray cluster each driver runs on.

Within one Ray cluster, the job's named control actor is the lock (control.py): a second driver
is refused at once. Drivers on different clusters sharing the storage (two `raytrain run` on one
machine each start a local Ray instance; two Kubernetes clusters on one bucket) cannot see each
other's actors, so the lease is also a file, `<run_dir>/driver.json`: the holder, a generation
that every new holder increments with a random token, and the time the holder last renewed it.

A holder is gone (its lease may be taken without --takeover) when it released the lease, when it
was on this driver's own Ray cluster (whose actor this driver now holds, so it is dead), when it
was on this host and its process is dead, or when it has not renewed the lease for `TTL_S`. A
live holder is refused, naming it, unless --takeover: then the generation moves on and the fence
stops it. Never because this driver's cluster cannot see it.

The fence: the generation the driver took rides in the signed run plan to every worker. Rank 0
reads the lease every `CHECK_S` in a thread (`Fence`); a stale generation becomes a stop flag on
the next step's all-reduce, and every rank stops before its next step with nothing committed.
Before a checkpoint is reported, rank 0 reads the lease once more (`Fence.require`), so a
checkpoint never commits after a takeover, however the timing falls.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

from . import storage
from .errors import JobError

FILE = "driver.json"
TTL_S = 60.0  # a holder on another host that has not renewed for this long is gone
RENEW_S = 15.0
CHECK_S = 5.0  # how often rank 0 reads the lease while training


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    job = f"submission {holder['submission_id']}" if holder.get("submission_id") else f"Ray job {holder.get('job_id')}"
    return f"{job} (pid {holder.get('pid')} on {holder.get('host')}, since {since})"


def how_to_stop(holder: dict) -> str:
    if holder.get("submission_id"):
        return f"`ray job stop {holder['submission_id']}`"
    return f"Ctrl-C in its shell, or `kill -TERM {holder.get('pid')}` on {holder.get('host')}"


def read(run_dir: str) -> dict | None:
    uri = storage.join(run_dir, FILE)
    try:
        return json.loads(storage.read_text(uri)) if storage.exists(uri) else None
    except (ValueError, OSError):  # a torn or unreadable file: nobody to fence
        return None


def gone(holder: dict, cluster: str) -> str | None:
    """Why `holder` no longer holds the lease, or None if it may still be running."""
    if holder.get("released"):
        return "it ended and released the run directory"
    if holder.get("cluster") == cluster:  # its control actor was on this cluster; this driver now has it
        return "it is gone without closing the run (killed, or its node lost)"
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return f"its process {holder['pid']} on this host is dead"
        except (PermissionError, KeyError, ValueError, TypeError):
            pass
        return None
    quiet = quiet_s(holder)
    return f"it has not renewed its lease for {quiet:.0f} s" if quiet > TTL_S else None


def quiet_s(holder: dict) -> float:
    """Seconds since `holder` last renewed its lease."""
    return time.time() - float(holder.get("renewed_at", 0))  # host: a JSON number


def acquire(run_dir: str, me: dict, cluster: str, takeover: bool) -> str:
    """Take the lease (after this cluster's control actor was created); returns its token. A live
    holder on another cluster is refused, or fenced with `takeover`."""
    holder, why = read(run_dir), None
    if holder and not holder.get("released"):
        why = gone(holder, cluster)
        if why is None and not takeover:
            raise JobError(f"run directory {run_dir} is in use by another driver of this job: {describe(holder)}, "
                           f"on another Ray cluster (it renewed its lease {quiet_s(holder):.0f} s ago). Wait for it, "
                           "stop it with "
                           f"{how_to_stop(holder)}, or run with --takeover: its workers stop before their next step "
                           "and commit nothing more, and this driver continues from its last checkpoint")
        print(f"[raytrain] taking over the run directory from {describe(holder)}: "
              f"{why or 'fencing it (--takeover): its workers stop before their next step and commit nothing more'}",
              flush=True)
    generation = int((holder or {}).get("generation", 0)) + 1
    token = f"{generation}:{secrets.token_hex(6)}"
    fs, path = storage.filesystem(run_dir)
    fs.create_dir(path, recursive=True)
    now = time.time()
    storage.write_text(storage.join(run_dir, FILE), json.dumps({**me, "cluster": cluster, "token": token,
                                                                "generation": generation, "renewed_at": now}))
    if holder and not holder.get("released") and why is None:  # fenced a live holder: let its rank 0 see it
        print(f"[raytrain] waiting {2 * CHECK_S:.0f} s for its workers to read the lease and stop", flush=True)
        time.sleep(2 * CHECK_S)
    return token


class Renewal:
    """Driver: renews the lease every `RENEW_S` until `stop()`, and stops renewing once another
    driver took it (its workers are fenced and end the job with the new holder's name)."""

    def __init__(self, run_dir: str, token: str):
        self.run_dir, self.token = run_dir, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RENEW_S):
            holder = read(self.run_dir)
            if holder is not None and holder.get("token") != self.token:
                return
            if holder is not None:
                try:
                    storage.write_text(storage.join(self.run_dir, FILE), json.dumps({**holder, "renewed_at": time.time()}))
                except OSError:  # storage unreachable for a moment: the next renewal tries again
                    pass

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        """At the end: the lease is marked released, if it is still this driver's."""
        self.stop()
        holder = read(self.run_dir)
        if holder is not None and holder.get("token") == self.token:
            storage.write_text(storage.join(self.run_dir, FILE), json.dumps({**holder, "released": True}))


class Fence:
    """Rank 0 of a worker group: is the lease still the one this group's driver took?"""

    def __init__(self, run_dir: str, token: str, every_s: float = CHECK_S):
        self.run_dir, self.token, self.taken_by = run_dir, token, None
        # A daemon thread for the worker process's life: it ends once it has seen a takeover.
        threading.Thread(target=self._run, args=(every_s,), name="raytrain-fence", daemon=True).start()

    def _run(self, every_s: float) -> None:
        while self.taken_by is None:
            time.sleep(every_s)
            self._check()

    def _check(self) -> None:
        holder = read(self.run_dir)
        if holder is not None and holder.get("token") != self.token:
            self.taken_by = holder

    @property
    def stale(self) -> bool:
        return self.taken_by is not None

    def require(self) -> None:
        """Read the lease now; a JobError if another driver holds it (before a checkpoint commits)."""
        self._check()
        if self.taken_by is not None:
            raise JobError(self.message())

    def message(self) -> str:
        return (f"stopped: the run directory {self.run_dir} was taken over by {describe(self.taken_by)}; this "
                "worker group committed nothing after it, and that driver continues the run")
