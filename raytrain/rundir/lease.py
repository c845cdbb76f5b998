"""The run directory's lease in storage, and the fence that stops a driver's workers once another
driver holds it. One job, one writer, whatever Ray cluster each driver runs on.

Within one Ray cluster, the job's named control actor is the lock (control.py): a second driver
is refused at once. Drivers on different clusters sharing the storage (two `raytrain run` on one
machine each start a local Ray instance; two Kubernetes clusters on one bucket) cannot see each
other's actors, so the lease is also a record, `<run_dir>/driver.json`, that changes only by
compare-and-swap (versioned.py: S3's conditional writes, or flock and rename on a file system).
It holds the holder, a generation that every new holder increments (two drivers can never both
write generation g+1 from g: it is a fencing counter), the holder's renewal count, and the newest
checkpoint committed under it.

A holder is gone (its lease may be taken without --takeover) when it released the lease, when it
was on this driver's own Ray cluster instance (whose control actor this driver now holds, so it
is dead), when it was in this very process namespace of this boot of this host and its process is
dead, or when this driver watched its record for `TTL_S` of its own monotonic clock and saw no
renewal: durations this driver measured, never another host's wall clock. A live holder is
refused, naming it, unless --takeover: then the generation moves on and the fence stops it. An
unreadable record is retried, never taken for "no holder".

The fence is the commit. Rank 0 commits each checkpoint (`commit`) by a write conditioned on the
record's version while the record still names its driver's token, before the checkpoint's signed
manifest exists; a checkpoint without a manifest is never restored (signing.py). So after a
takeover, however the timing falls, the fenced group commits nothing: its files may land, in
folders named by its generation (checkpoint.folder_name) that no other driver writes, but never
become a checkpoint. Rank 0 also reads the lease every `CHECK_S` in a thread (`Fence`); a
stale token becomes a stop flag on the next step's all-reduce, so the fenced group stops early.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

from raytrain.errors import JobError, TransientError
from raytrain.rundir import storage, versioned

FILE = "driver.json"
TTL_S = 60.0  # unrenewed this long, as this driver watched: gone
RENEW_S = TTL_S / 4
CHECK_S = 5.0  # how often rank 0 reads the lease while training
RETRY_S = 30.0  # how long an unreadable record is retried before the caller gives up


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


def _load(run_dir: str, patient: bool = True) -> tuple[dict | None, str | None]:
    """The record and its version; an unreadable record is retried for RETRY_S (patient), then
    `versioned.Unreadable` for the caller to word: before a start it ends the attempt, at a commit
    mid-run it is a storage outage a restart may outlast (`commit`)."""
    deadline = time.monotonic() + (RETRY_S if patient else 0)
    while True:
        try:
            return versioned.load(uri(run_dir))
        except versioned.Unreadable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def _load_to_start(run_dir: str) -> tuple[dict | None, str | None]:
    """`_load` before anything of the run started: an unreadable record ends it with the fix."""
    try:
        return _load(run_dir)
    except versioned.Unreadable as exc:
        raise JobError(
            f"the run directory's lease {uri(run_dir)} cannot be read ({exc}); nothing was "
            "started. Check the storage, then run again"
        ) from exc


def read(run_dir: str) -> dict | None:
    return _load_to_start(run_dir)[0]


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


def _watch(run_dir: str, version: str, ttl_s: float) -> tuple[dict | None, str | None]:
    """Watch the record for `ttl_s` (this process's monotonic clock): (None, None) if it did not
    change (its holder is gone), else the changed record and its version."""
    deadline = time.monotonic() + ttl_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        try:
            doc, now = versioned.load(uri(run_dir))
        except versioned.Unreadable:
            continue  # a hiccup is no renewal, and no proof of absence either: keep watching
        if now != version:
            return doc, now
    return None, None


def acquire(run_dir: str, me: dict, cluster: str, takeover: bool) -> str:
    """Take the lease (after this cluster's control actor was created); returns its token. A live
    holder on another cluster is refused, or fenced with `takeover`."""
    fs, path = storage.filesystem(run_dir)
    fs.create_dir(path, recursive=True)
    floor = checkpoints_generation(run_dir)
    for _ in range(10):  # each round: read, decide, one conditional write (a racing writer: read again)
        holder, version = _load_to_start(run_dir)
        why, live = None, False
        if holder and not holder.get("released"):
            why = gone(holder, cluster)
            if why is None and not takeover:
                print(
                    f"[raytrain] the run directory is held by {describe(holder)}: watching its lease for up to "
                    f"{TTL_S:.0f} s",
                    flush=True,
                )
                changed, now = _watch(run_dir, version, TTL_S)
                if changed is not None and not changed.get("released"):
                    raise JobError(
                        f"run directory {run_dir} is in use by another driver of this job: "
                        f"{describe(changed)}, on another Ray cluster (this driver saw it renew its lease). "
                        f"Wait for it, stop it with {how_to_stop(changed)}, or run with --takeover: its "
                        "workers stop before their next step and commit nothing more, and this driver "
                        "continues from its last checkpoint"
                    )
                if changed is not None:  # released while watched: read it again
                    continue
                why = f"it has not renewed its lease for {TTL_S:.0f} s (watched by this driver)"
            live = why is None
            print(
                f"[raytrain] taking over the run directory from {describe(holder)}: "
                f"{why or 'fencing it (--takeover): its workers stop before their next step and commit nothing more'}",
                flush=True,
            )
        # Above every generation the run directory's folders name too: a record deleted by hand (or
        # by a lifecycle rule) must not hand out generation 1 again, whose folders are still there.
        generation = max(int((holder or {}).get("generation", 0)), floor) + 1
        token = f"{generation}:{secrets.token_hex(6)}"
        doc = {
            **me,
            **process_identity(),
            "cluster": cluster,
            "token": token,
            "generation": generation,
            "renewals": 0,
            "committed": (holder or {}).get("committed"),
        }
        try:
            versioned.write(uri(run_dir), doc, version)
        except versioned.Conflict:
            continue  # another driver wrote first: decide again on what it wrote
        except versioned.Unreadable as exc:
            raise JobError(
                f"the run directory's lease {uri(run_dir)} cannot be written ({exc}); nothing was "
                "started. Check the storage and its credentials, then run again"
            ) from exc
        if live:  # fenced a live holder: let its rank 0 see it before its next step
            print(f"[raytrain] waiting {2 * CHECK_S:.0f} s for its workers to read the lease and stop", flush=True)
            time.sleep(2 * CHECK_S)
        return token
    raise JobError(f"could not take the run directory's lease {uri(run_dir)}: other drivers keep writing it")


def _update(run_dir: str, token: str, change: dict, patient: bool) -> dict | None:
    """Write `change` into the record while it names `token` (conditional on the version read);
    returns the holder that took it over instead, or None once written. A storage that fails a read
    or a write (`versioned.Unreadable`, any OSError) is retried for RETRY_S when `patient`, then
    raised as `versioned.Unreadable`: the caller decides whether that ends anything."""
    deadline = time.monotonic() + (RETRY_S if patient else 0)
    conflicts = 0
    while True:
        try:
            holder, version = _load(run_dir, patient=False)
            if holder is None or holder.get("token") != token:
                return holder or {}
            versioned.write(uri(run_dir), {**holder, **change}, version)
            return None
        except versioned.Conflict:  # a renewal or a commit of this same holder came first: again on the new version
            conflicts += 1
            if conflicts >= 20:
                raise JobError(
                    f"could not update the run directory's lease {uri(run_dir)}: it keeps changing under this driver"
                ) from None
        except OSError as exc:  # versioned.Unreadable is one; so is a local write's own error
            if time.monotonic() >= deadline:
                raise exc if isinstance(exc, versioned.Unreadable) else versioned.Unreadable(str(exc)) from exc
            time.sleep(1.0)


def checkpoints_generation(run_dir: str) -> int:
    """The highest generation the run directory's checkpoint folders name (`step_N` is 1,
    `step_N-gG` is G; rundir/checkpoints.folder_name), 0 for none."""
    from raytrain.rundir.checkpoints import order_key  # checkpoints imports this module

    return max((order_key(name)[1] for name in storage.subfolders(run_dir) if name.startswith("step_")), default=0)


def generation_of(token: str) -> int:
    """The generation a token was issued at (`acquire` writes "<generation>:<random>"); 0 for none."""
    return int(token.split(":", 1)[0]) if token else 0


def commit(run_dir: str, token: str, name: str) -> None:
    """Rank 0, before a checkpoint's manifest is written: the checkpoint `name` is committed under
    this lease; a JobError if another driver holds it (final: nothing of this checkpoint is then
    signed, and the new holder continues), an `errors.TransientError` if the storage stayed
    unreachable through RETRY_S (a restart from the last committed checkpoint may outlast it)."""
    try:
        taken_by = _update(run_dir, token, {"committed": name}, patient=True)
    except versioned.Unreadable as exc:
        raise TransientError(
            f"checkpoint {name} was not committed: the run directory's lease {uri(run_dir)} could not be read or "
            f"written for {RETRY_S:.0f} s ({exc}); the worker group restarts from the last committed checkpoint "
            "(within failure.max_failures) once the storage answers"
        ) from exc
    if taken_by is not None:
        raise JobError(fenced_message(run_dir, taken_by))


def still_held(run_dir: str, token: str) -> bool:
    """Whether the record still names `token` (False when another driver holds it; True when it
    cannot be read: unknown is not taken, and the commit's conditional write decided already)."""
    try:
        holder, _ = versioned.load(uri(run_dir))
    except versioned.Unreadable:
        return True
    return holder is not None and holder.get("token") == token


def fenced_message(run_dir: str, holder: dict) -> str:
    who = describe(holder) if holder else "another driver (its lease record is gone)"
    return (
        f"stopped: the run directory {run_dir} was taken over by {who}; this worker group committed "
        "nothing after it, and that driver continues the run"
    )


class Renewal:
    """Driver: renews the lease every `RENEW_S` until `stop()`, and stops renewing once another
    driver took it (its workers are fenced and end the job with the new holder's name)."""

    def __init__(self, run_dir: str, token: str):
        self.run_dir, self.token, self.renewals = run_dir, token, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Nothing but a takeover ends renewing: a storage that fails a write now (an S3 5xx, a local
        # write error, a torn read) is tried again at the next renewal, and any other error is said
        # and outlived. A renewal thread that dies leaves the live job's lease to lapse: TTL_S later
        # another driver takes it without --takeover and fences this one.
        failing = None
        while not self._stop.wait(RENEW_S):
            self.renewals += 1
            try:
                if _update(self.run_dir, self.token, {"renewals": self.renewals}, patient=False) is not None:
                    return  # taken over: stop renewing
            except Exception as exc:  # noqa: BLE001 - see above
                if failing is None:
                    print(f"[raytrain] could not renew the run directory's lease ({exc}); retrying", flush=True)
                failing = exc
                continue
            if failing is not None:
                print("[raytrain] the run directory's lease is renewed again", flush=True)
                failing = None

    def stop(self) -> None:
        """No renewal after this returns (one in flight is waited for)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=RETRY_S)

    def release(self) -> None:
        """At the end: the lease is marked released, if it is still this driver's."""
        self.stop()
        try:
            _update(self.run_dir, self.token, {"released": True}, patient=True)
        except (JobError, OSError) as exc:  # the run is over either way: a later driver waits out the TTL instead
            print(f"[raytrain] could not release the run directory's lease: {exc}", flush=True)


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
