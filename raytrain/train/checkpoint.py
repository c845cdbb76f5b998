"""A worker group's checkpoints: every rank writes its shards into its own folder, signs them with
the others (rank 0 commits under the lease first), and Ray Train merges the folders and registers
the checkpoint only when every rank's part is uploaded; a restarted group restores the latest
registered one (`ray.train.get_checkpoint()`). The run directory's side of checkpoints (their
folders, the state file, which one is the latest) is rundir/checkpoints.py's."""

from __future__ import annotations

import tempfile

from raytrain.errors import JobError, TransientError
from raytrain.rundir import lease, signing, storage
from raytrain.rundir.checkpoints import TrainState, folder_name, record_latest


def save_and_report(strategy, state: TrainState, metrics: dict, wait: bool = True) -> str | None:
    """Collective: every rank saves its part and reports it; Ray commits the merged folder.

    wait=True blocks until the checkpoint is committed and returns its path. wait=False
    (`checkpoint.async_save`) returns once the state is staged in CPU memory: the strategy
    writes the files in the background and Ray's upload thread waits for them before it
    copies anything (so a crash mid-write uploads nothing: the previous checkpoint stays the
    latest; Ray registers it once every rank's part is there), and `confirm()` at the next
    save (which finds it long registered) hands its steps' metrics to MLflow. Signing commits the
    checkpoint under the run directory's lease first (`sign`): a fenced group's raises a JobError
    on every rank, and nothing of it is signed or registered.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    tmp = tempfile.mkdtemp(prefix="raytrain-ckpt-")  # Ray deletes it after the upload
    name = folder_name(state.step, strategy.plan.lease)
    if strategy.rank == 0:
        state.write(tmp)

    token = strategy.plan.lease  # the run directory's lease this group's driver holds ("" without a launcher)
    if wait:
        strategy.save(tmp)
        sign(tmp, strategy.spec.run_dir, name, token)
    else:
        files_complete = strategy.save_async(tmp)
        # Ray's upload thread signs (below) while the training thread runs its collectives: its
        # gather needs a group of its own. One upload thread per worker, in report order, so the
        # ranks' gathers pair up checkpoint by checkpoint.
        if strategy.upload_group is None:
            import torch.distributed as dist

            strategy.upload_group = dist.new_group(backend="gloo")
        group = strategy.upload_group
    common = dict(
        checkpoint=ray.train.Checkpoint.from_directory(tmp),
        checkpoint_dir_name=name,
        delete_local_checkpoint_after_upload=True,
    )
    if wait:
        ray.train.report(metrics, checkpoint_upload_mode=CheckpointUploadMode.SYNC, **common)
        return confirm(strategy)
    storage = ray.train.get_context().get_storage()

    signed = []

    def upload(checkpoint, dir_name: str):
        # Ray runs this again, on this rank alone, when S3 answers SlowDown or 503: the collective
        # signing must then not run a second time (its gather would pair with the next checkpoint's),
        # only the upload.
        if not signed:
            files_complete()
            sign(tmp, strategy.spec.run_dir, name, token, group)  # collective on every rank's upload thread
            signed.append(name)
        return storage.persist_current_checkpoint(checkpoint, dir_name)

    ray.train.report(metrics, checkpoint_upload_mode=CheckpointUploadMode.ASYNC, checkpoint_upload_fn=upload, **common)
    return None


def sign(directory: str, run_dir: str, name: str, token: str, group=None) -> None:
    """Collective, once every rank's files in its own `directory` are complete: rank 0 gathers
    their sha256s, commits the checkpoint under the run directory's lease (`token`, when a driver
    holds one: a conditional write that fails once another driver took the lease, lease.commit)
    and only then writes the checkpoint's one signed manifest into its own folder (signing.py), so
    each rank of a restore reads one manifest, not every rank's. Ray commits the checkpoint only
    once every rank's part is uploaded: a committed one always has its manifest, and a fenced
    group's has none (every rank raises the fence's JobError)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(signing.checkpoint_part(directory), parts, dst=0, group=group)
    said = [None]  # rank 0's verdict, for every rank to raise alike: None, or (final?, message)
    if parts is not None and token:
        try:
            lease.commit(run_dir, token, name)
        except JobError as exc:  # fenced: another driver continues the run
            said = [(True, exc.args[0] if exc.args else str(exc))]
        except Exception as exc:  # noqa: BLE001 - anything else must reach the other ranks too, not leave them waiting
            said = [(False, str(exc) if isinstance(exc, TransientError) else f"{type(exc).__name__}: {exc}")]
    if token:
        dist.broadcast_object_list(said, src=0, group=group)
    if said[0]:
        final, message = said[0]
        raise JobError(message) if final else TransientError(message)
    if parts is not None:
        signing.sign_checkpoint(directory, run_dir, name, parts)


def confirm(strategy) -> str | None:
    """Block until every reported checkpoint is registered by the controller (a worker that
    dies right after must find it on restart; its steps' metrics may now go to MLflow), then
    record the latest in the signed record. Returns its path on rank 0."""
    import ray.train
    from ray.train import CheckpointConsistencyMode

    committed = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    if strategy.rank != 0 or not committed:
        return None
    latest = committed[-1].checkpoint.path
    # Fenced too: a group whose checkpoint Ray registered only after another driver took the lease
    # (a late upload) must not move the signed record past the new holder's lineage.
    token = strategy.plan.lease
    if not token or lease.still_held(strategy.spec.run_dir, token):
        record_latest(strategy.spec.run_dir, latest.rstrip("/").rsplit("/", 1)[-1])
    return latest


def restore(strategy) -> TrainState | None:
    """Load the latest committed checkpoint into the strategy; None on a fresh start. Each rank
    reads only its files, straight from the run directory (local or remote), each verified
    before it is read (signing.SignedCheckpoint)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    name = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
    with signing.SignedCheckpoint(storage.join(strategy.spec.run_dir, name), strategy.spec.run_dir, name) as signed:
        strategy.load(signed)
        state = TrainState.read(signed, with_metrics=strategy.rank == 0)
        if strategy.rank == 0:
            print(
                f"[raytrain] restored step {state.step} from {signed.uri}: rank 0 read "
                f"{signed.bytes_read / 2**20:,.1f} "
                f"MiB of its files",
                flush=True,
            )
        return state
