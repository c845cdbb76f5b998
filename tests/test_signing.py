"""The signing key's life outside Kubernetes: generated once beside the local cluster, private
to its user, and forwarded only to nodes that would sign with another key."""

from __future__ import annotations

import stat
from pathlib import Path

from raytrain.rundir import signing
from raytrain.train import entry


def test_the_key_is_generated_once_private_and_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    assert signing.key_id() is None
    signing.ensure_key()
    key_file = Path(tmp_path, ".raytrain", "checkpoint.key")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    first = signing.key_id()
    signing.ensure_key()  # a second driver on the same machine keeps it: its checkpoints still verify
    assert signing.key_id() == first and len(key_file.read_text()) == 64
    document = signing.sign_document({"a": 1})
    monkeypatch.setenv(signing.KEY_ENV, "the cluster's secret")
    assert signing.key_id() != first
    try:
        signing.verify_document(document, "doc")
        raise AssertionError("a document signed with another key verified")
    except signing.JobError as exc:
        assert "doc: its signature is wrong" in str(exc)
    # A node with the same key has it (nothing forwarded); a node with another key lacks it.
    assert entry._present([signing.KEY_ENV], signing.key_id()) == [signing.KEY_ENV]
    assert entry._present([signing.KEY_ENV], first) == []


def test_a_rank_fetches_only_its_files_from_s3_each_verified_before_it_is_read(tmp_path, s3_server, monkeypatch):
    """Restore's reader (signing.SignedCheckpoint) on a real S3 API: a rank's files come straight
    from the bucket, nothing else is read, and a changed file is refused only where it is fetched,
    before any of it reaches the local folder."""
    import os

    import pytest

    from raytrain.rundir import storage

    env, client = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(signing.KEY_ENV, "the cluster's secret")
    client.create_bucket(Bucket="ckpt")
    files = {0: {".metadata": 1000, "__0_0.distcp": 3 << 20, "train_state.json": 200}, 1: {"__1_0.distcp": 3 << 20}}
    merged = tmp_path / "step_00000004"
    parts = [tmp_path / f"rank{rank}" for rank in files]
    for part, names in zip(parts, files.values()):  # each rank writes its own folder; Ray merges them
        part.mkdir()
        for name, size in names.items():
            (part / name).write_bytes(os.urandom(size))
    signing.sign_checkpoint(str(parts[0]), "run", merged.name, [signing.checkpoint_part(str(p)) for p in parts])
    for part in parts:
        storage.upload_dir(str(part), "s3://ckpt/run/step_00000004")
    uri = "s3://ckpt/run/step_00000004"
    with signing.SignedCheckpoint(uri, "run", merged.name) as checkpoint:
        assert checkpoint.names == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"]
        folder = checkpoint.fetch(".metadata", "__1_0.distcp")
        assert checkpoint.bytes_read == 1000 + (3 << 20)  # rank 1's shard and the metadata: not rank 0's shard
        assert (
            Path(folder, "__1_0.distcp").read_bytes()
            == client.get_object(Bucket="ckpt", Key="run/step_00000004/__1_0.distcp")["Body"].read()
        )
    assert not Path(folder).exists()  # the local copies go with the restore

    changed = bytearray(client.get_object(Bucket="ckpt", Key="run/step_00000004/__0_0.distcp")["Body"].read())
    changed[12345] ^= 1
    client.put_object(Bucket="ckpt", Key="run/step_00000004/__0_0.distcp", Body=bytes(changed))
    with signing.SignedCheckpoint(uri, "run", merged.name) as checkpoint:
        folder = checkpoint.fetch("__1_0.distcp")  # another rank's file changed: this rank's still loads
        with pytest.raises(signing.JobError, match=r"__0_0\.distcp was changed after it was written"):
            checkpoint.fetch("__0_0.distcp")
        assert sorted(p.name for p in Path(folder).iterdir()) == ["__1_0.distcp"]  # nothing of it kept


def test_a_snapshot_rolled_back_behind_the_signed_record_is_refused_and_a_deleted_checkpoint_is_not(tmp_path):
    """Which checkpoint a restart restores is Ray Train's run snapshot, a file anyone who can write
    the storage can edit; raytrain's signed record of the newest registered checkpoint catches an
    edit that names an older one, while a checkpoint deleted by hand (as a refusal advises) is
    simply gone. The record names its run directory: one copied from another run is refused."""
    import json
    import threading

    import pytest

    from raytrain.errors import JobError
    from raytrain.rundir.checkpoints import LATEST_FILE, RAY_SNAPSHOT, latest_checkpoint, record_latest

    run_dir = tmp_path / "runs" / "job"
    for step in (2, 4):
        (run_dir / f"step_{step:08d}").mkdir(parents=True)

    def snapshot(name: str) -> None:  # the part of Ray 2.60's snapshot that names the latest
        (run_dir / RAY_SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": name}}))

    snapshot("step_00000004")
    record_latest(str(run_dir), "step_00000004")
    assert latest_checkpoint(str(run_dir)) == f"{run_dir}/step_00000004"
    snapshot("step_00000002")  # rolled back by an edit
    with pytest.raises(JobError, match="names step_00000002 as the latest, but step_00000004 was registered after it"):
        latest_checkpoint(str(run_dir))
    (run_dir / "step_00000004").rmdir()  # deleted on purpose: the one before is the latest
    assert latest_checkpoint(str(run_dir)) == f"{run_dir}/step_00000002"
    other = tmp_path / "runs" / "other"
    other.mkdir()
    (other / LATEST_FILE).write_text((run_dir / LATEST_FILE).read_text())  # validly signed, for another run
    (other / RAY_SNAPSHOT).write_text((run_dir / RAY_SNAPSHOT).read_text())
    with pytest.raises(JobError, match=f"it is signed for run_dir '{run_dir}', not '{other}'"):
        latest_checkpoint(str(other))
    # Ray Train rewrites its snapshot in place: a reader beside the running job (chaos.py's, an export)
    # met it empty on CI. It reads again until the rewrite ends, and a snapshot that stays broken is refused.
    (run_dir / RAY_SNAPSHOT).write_text("")
    threading.Timer(0.5, snapshot, ("step_00000002",)).start()
    assert latest_checkpoint(str(run_dir)) == f"{run_dir}/step_00000002"
    (run_dir / RAY_SNAPSHOT).write_text('{"latest_checkpoint_result": {"checkpoint_dir_na')
    with pytest.raises(JobError, match="is not valid JSON .* after 10 reads: Ray Train's run snapshot is corrupt"):
        latest_checkpoint(str(run_dir))


def test_a_restore_reads_one_manifest_whatever_the_world_size_and_refuses_one_it_cannot_trust(tmp_path, monkeypatch):
    """Each rank of a restore read and checked every rank's manifest: N reads on each of N ranks
    (262,144 at 512). Rank 0 now signs one manifest of every rank's files (gathered at the save),
    and a rank's verification is one listing and one read at any world size."""
    import json
    import os
    import re
    import shutil

    import pytest

    from raytrain.rundir import storage

    monkeypatch.setenv(signing.KEY_ENV, "the cluster's secret")
    run_dir = str(tmp_path / "run")

    def checkpoint(ranks: int) -> Path:  # as a save of `ranks` workers leaves it, merged
        step = tmp_path / f"world{ranks}" / "step_00000004"
        parts = [tmp_path / f"world{ranks}-rank{rank}" for rank in range(ranks)]
        for rank, part in enumerate(parts):
            part.mkdir()
            (part / f"__{rank}_0.distcp").write_bytes(os.urandom(64))
        signing.sign_checkpoint(str(parts[0]), run_dir, step.name, [signing.checkpoint_part(str(p)) for p in parts])
        for part in parts:
            shutil.copytree(part, step, dirs_exist_ok=True)
        return step

    for ranks in (4, 16):
        step = checkpoint(ranks)
        storage.REQUESTS.clear()
        with signing.SignedCheckpoint(str(step), run_dir, step.name) as verified:
            assert len(verified.names) == ranks
        assert storage.REQUESTS == {"list": 1, "read": 1}, (ranks, storage.REQUESTS)

    def refused(step: Path, message: str, run: str = run_dir) -> None:
        with pytest.raises(signing.JobError, match=message):
            signing.SignedCheckpoint(str(step), run, step.name)

    manifest = step / signing.MANIFEST
    signed = manifest.read_text()
    other = str(tmp_path / "other")  # the same checkpoint put in another run: refused, naming both
    refused(
        step,
        re.escape(
            f"{step}: MANIFEST.json signs checkpoint step_00000004 of run directory "
            f"{signing.place(run_dir)}, not step_00000004 of {signing.place(other)}"
        ),
        run=other,
    )
    changed = json.loads(signed)
    changed["ranks"][3]["__3_0.distcp"] = "0" * 64  # a forged hash, without the key
    manifest.write_text(json.dumps(changed))
    refused(step, r"MANIFEST.json has a wrong signature .*Nothing in it was loaded")
    manifest.write_text(signed)
    (step / "MANIFEST.rank-00000.json").write_text("{}")  # a planted file, manifest-like or not
    refused(step, r"MANIFEST.rank-00000.json is in no manifest")
    manifest.unlink()
    refused(
        step,
        r"it was written before raytrain signed one manifest per checkpoint \(it has MANIFEST.rank-\*.json, "
        r"one per rank, and no MANIFEST.json\)\. Nothing in it was loaded\. Start a new run",
    )
    (step / "MANIFEST.rank-00000.json").unlink()
    refused(step, r"it has no signed manifest \(MANIFEST.json\)")
