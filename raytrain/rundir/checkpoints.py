"""Checkpoints: every rank writes its shards into its own folder, Ray Train merges the
folders and commits the checkpoint only when every rank's part is uploaded; a restarted
worker group gets the latest committed one from `ray.train.get_checkpoint()`.

The latest checkpoint has one definition, used by a restarted worker group, the driver and
`raytrain export` alike: the one Ray Train registered last (its run snapshot names it; Ray
registers a checkpoint only once every rank's part is uploaded, whether saved synchronously
or asynchronously, and prunes an older one only after a newer one is registered). A folder
Ray never registered (a crash during the write) is never loaded. Ray's snapshot is not
signed, so rank 0 also keeps a signed record of the newest checkpoint it saw registered
(LATEST_FILE): a snapshot that names an older one while the recorded one is still there was
rolled back, and is refused.

Besides the strategy's model/optimizer shards, rank 0 writes `train_state.json`: the step
(which fixes the LR, since the schedule is a function of the step), the data position,
the MLflow run id and the world size it was written with. Randomness needs no saved
state: every step reseeds from (seed, step, rank), see `loop.seed_step`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raytrain.errors import JobError
from raytrain.rundir import lease, signing, storage
from raytrain.rundir.lease import order_key

STATE_FILE = "train_state.json"
METRICS_FILE = (
    "step_metrics.json"  # rank 0's steps MLflow did not have yet at this checkpoint: rank 0 and the driver read it
)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the checkpoints it registered
LATEST_FILE = "latest_checkpoint.json"  # raytrain's signed record of the newest registered one


@dataclass
class DataPosition:
    """Where the run stands: rows of the stream consumed (over all epochs and sources), and
    the stores they come from (a resume against other stores is refused). One counter."""

    consumed: int = 0
    store: str = ""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    data: DataPosition = field(default_factory=DataPosition)
    tokens_seen: int = 0
    bad_rows: int = 0
    world_size: int = 0
    run_id: str | None = None
    model_commit: str | None = None  # the hub commit of model.path it was trained on (None: a local folder)
    # Step metrics of the steps this checkpoint completes: MLflow gets them after the commit,
    # and a restart re-sends any that a worker killed right after the commit never sent. Kept in
    # their own file (METRICS_FILE), which only rank 0 and the driver read: up to 100k steps while
    # MLflow is down, that every rank of a restore need not read.
    metrics: list = field(default_factory=list)
    stopped: bool = False  # a stop was requested on the driver; not part of the saved state

    def to_json(self) -> str:
        raw = asdict(self)
        raw.pop("stopped")
        raw.pop("metrics")
        return json.dumps(raw, indent=2)

    def write(self, folder: str) -> None:
        """Rank 0: this state and its unwritten step metrics into a checkpoint folder."""
        Path(folder, STATE_FILE).write_text(self.to_json())
        Path(folder, METRICS_FILE).write_text(json.dumps(self.metrics))

    @classmethod
    def read(cls, checkpoint: signing.SignedCheckpoint, with_metrics: bool) -> "TrainState":
        """The state of a signed checkpoint, and its unwritten step metrics if asked (rank 0, the driver)."""
        state = cls.from_json(checkpoint.read_bytes(STATE_FILE).decode())
        if with_metrics and METRICS_FILE in checkpoint.names:  # a checkpoint from before had them in STATE_FILE
            state.metrics = json.loads(checkpoint.read_bytes(METRICS_FILE))
        return state

    def require_same_data(self, store_key: str, where: str) -> None:
        """A resume reads on from its position in the store it was trained on: if the data
        (or anything that changes its tokens) changed under the job, those positions mean
        other rows, so the run stops and says so."""
        if self.data.store and self.data.store != store_key:
            raise JobError(
                f"the data changed under a running job: {where} was trained on data {self.data.store} "
                f"(token stores, weights, held-out rows), but the job's data and tokenizer now give {store_key}. "
                "Restore the data as it was, or start a new run (a new name or checkpoint.storage_path)"
            )

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        raw = json.loads(text)
        raw.pop("lease", None)  # checkpoints before the generation named their folder kept the token here
        raw["data"] = DataPosition(**raw["data"])
        return cls(**raw)


def folder_name(step: int, token: str) -> str:
    """A checkpoint's folder: `step_N` for the run directory's first driver, `step_N-gG` for its
    G-th (a re-run or a takeover: lease.generation_of). So a fenced group frozen mid-upload of a
    checkpoint it committed before the takeover, and woken after the new driver wrote the same
    step, lands its files in a folder of its own, never over the new driver's."""
    generation = lease.generation_of(token)
    return f"step_{step:08d}" if generation <= 1 else f"step_{step:08d}-g{generation}"


def record_latest(run_dir: str, name: str) -> None:
    """Rank 0: `name` is registered (signed, bound to the run directory)."""
    doc = signing.sign_document({"run_dir": signing.place(run_dir), "latest": name})
    storage.write_text(storage.join(run_dir, LATEST_FILE), json.dumps(doc))


def _read_snapshot(uri: str, tries: int = 10) -> dict:
    """Ray Train's snapshot. Ray Train rewrites it in place as each checkpoint registers, so a reader
    beside a running job (an export, a status) can meet it half written: read again shortly."""
    for attempt in range(tries):
        text = storage.read_text(uri)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if attempt + 1 < tries:
                time.sleep(0.3)
    raise JobError(
        f"{uri} is not valid JSON ({len(text)} characters) after {tries} reads: Ray Train's run snapshot "
        f"is corrupt: restore it from a backup (the step_* folders beside it are untouched)"
    )


def latest_checkpoint(run_dir: str) -> str:
    """The run directory's latest checkpoint folder (local or a URI): the one Ray Train registered
    last. Refuses a snapshot rolled back behind raytrain's signed record."""
    uri = storage.join(run_dir, RAY_SNAPSHOT)
    snapshot = _read_snapshot(uri) if storage.exists(uri) else {}
    latest = snapshot.get("latest_checkpoint_result") or {}
    name = latest.get("checkpoint_dir_name")
    if name and not storage.exists(storage.join(run_dir, name)):  # deleted by hand: the newest one still there
        newest = _newest_present(snapshot.get("checkpoint_results", []), set(storage.subfolders(run_dir)))
        name = newest["checkpoint_dir_name"] if newest else None
    record_uri = storage.join(run_dir, LATEST_FILE)
    if storage.exists(record_uri):
        record = signing.verify_document(json.loads(storage.read_text(record_uri)), record_uri)
        signing.require_place(record, "run_dir", signing.place(run_dir), record_uri)
        if order_key(record["latest"]) > order_key(name) and storage.exists(storage.join(run_dir, record["latest"])):
            raise JobError(
                f"refusing {uri}: Ray Train's run snapshot names {name or 'no checkpoint'} as the latest, but "
                f"{record['latest']} was registered after it and is still there (its signed record, "
                f"{LATEST_FILE}): the snapshot was rolled back or edited, and resuming from it would silently "
                f"drop steps. To go back on purpose, delete {record['latest']} and any newer step_* folder"
            )
    if name is None:
        raise FileNotFoundError(f"no registered checkpoint under {run_dir} (Ray Train's {RAY_SNAPSHOT} names none)")
    return storage.join(run_dir, name)


def await_committed(run_dir: str, name: str | None, idle_s: float, most_s: float = 3600.0) -> None:
    """Driver, before it resumes: the checkpoint the lease's record names as the last committed
    (lease.commit) is registered, or we wait for its upload to finish. A driver that took the lease
    from a live holder mid-upload then resumes from that checkpoint, not the one before, so no step
    of the run is trained twice or written into one folder by both groups. The wait is sized to the
    checkpoint: it lasts while the upload makes progress (the folder's files grow), up to `most_s`,
    and gives up after `idle_s` without progress (the previous holder's upload died)."""
    folder = storage.join(run_dir, name) if name else None
    if not folder or not storage.exists(folder):  # nothing of it was uploaded: nothing to wait for
        return
    uri, said = storage.join(run_dir, RAY_SNAPSHOT), False
    started = last_change = time.monotonic()
    seen = None
    while True:
        snapshot = json.loads(storage.read_text(uri)) if storage.exists(uri) else {}
        if name in {r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results", [])}:
            return
        files = len(storage.tree(folder))
        now = time.monotonic()
        if files != seen:  # progress: the upload goes on
            seen, last_change = files, now
        if now - last_change >= idle_s or now - started >= most_s:
            break
        if not said:
            print(
                f"[raytrain] waiting for {name}, committed under the previous lease, to finish uploading (while it "
                f"makes progress; {idle_s:.0f} s without)",
                flush=True,
            )
            said = True
        time.sleep(min(1.0, idle_s / 4))
    print(f"[raytrain] {name} did not finish uploading: resuming from the checkpoint before it", flush=True)


def _newest_present(results: list[dict], present: set[str]) -> dict | None:
    """Of Ray's registered checkpoint results, the newest whose folder is still there."""
    return max(
        (r for r in results if r["checkpoint_dir_name"] in present),
        default=None,
        key=lambda r: order_key(r["checkpoint_dir_name"]),
    )


def forget_deleted(run_dir: str) -> list[str]:
    """Drop from Ray Train's run snapshot the checkpoints whose folder is gone, and return their
    names. A restart resumes from the newest registered checkpoint (`ray.train.get_checkpoint`);
    one deleted by hand (as a refused, tampered checkpoint's message advises) or by a storage
    lifecycle rule would otherwise make Ray refuse the whole run directory. Registered folders
    that still exist are kept. The snapshot's layout is Ray 2.60's (k8s/constraints.txt pins it)."""
    uri = storage.join(run_dir, RAY_SNAPSHOT)
    if not storage.exists(uri):
        return []
    snapshot = json.loads(storage.read_text(uri))
    results, indices = snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"]
    present = set(storage.subfolders(run_dir))  # one listing, not a request per checkpoint (S3)
    gone = {r["checkpoint_dir_name"] for r in results} - present
    if not gone:
        return []
    kept = [(r, i) for r, i in zip(results, indices) if r["checkpoint_dir_name"] not in gone]
    snapshot["checkpoint_results"] = [r for r, _ in kept]
    snapshot["checkpoint_report_indices"] = [i for _, i in kept]
    latest = snapshot.get("latest_checkpoint_result")
    if latest and latest["checkpoint_dir_name"] in gone:
        snapshot["latest_checkpoint_result"] = _newest_present(snapshot["checkpoint_results"], present)
    pending = [
        (r, v)
        for r, v in zip(snapshot["pending_training_results"], snapshot["pending_validation_specs"])
        if r["checkpoint_dir_name"] not in gone
    ]
    snapshot["pending_training_results"] = [r for r, _ in pending]
    snapshot["pending_validation_specs"] = [v for _, v in pending]
    storage.write_text(uri, json.dumps(snapshot))
    return sorted(gone)
