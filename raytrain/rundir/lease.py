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
(Who holds it and the fence: lease_holder.py.)

Storage fails now and then (an S3 5xx, a local write error): a renewal that could not write is
tried again at the next one, and the renewal thread outlives any error, since a lapsed lease hands
the live job to the next driver. A commit that cannot reach the lease for RETRY_S is a storage
outage (errors.TransientError: a restart may outlast it), not a takeover (a final JobError).
"""

from __future__ import annotations

import re
import secrets
import threading
import time

from raytrain.errors import JobError, TransientError
from raytrain.rundir import storage, versioned
from raytrain.rundir.lease_holder import (  # noqa: F401 - the lease's names, used as lease.X
    CHECK_S,
    FILE,
    Fence,
    describe,
    fenced_message,
    gone,
    how_to_stop,
    process_identity,
    uri,
)

TTL_S = 60.0  # unrenewed this long, as this driver watched: gone
RENEW_S = TTL_S / 4
RETRY_S = 30.0  # how long an unreadable record is retried before the caller gives up


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
    return max((order_key(name)[1] for name in storage.subfolders(run_dir) if name.startswith("step_")), default=0)


def order_key(name: str) -> tuple[int, int]:
    """(step, generation) of a checkpoint folder's name, the order checkpoints are compared in:
    numeric, so `step_N-g10` comes after `step_N-g9` (as strings it sorts before). (-1, 0) for a
    name of no checkpoint."""
    match = re.fullmatch(r"step_(\d+)(?:-g(\d+))?", name or "")
    if not match:
        return (-1, 0)
    return int(match.group(1)), int(match.group(2) or 1)


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
