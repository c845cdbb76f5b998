"""The run directory's lease as a lock, at the level where it lives (raytrain/rundir/lease.py on
raytrain/rundir/versioned.py), on both kinds of storage it runs on: a local file system and S3 (moto's
server on loopback, with its real conditional writes). Two drivers are two threads or two
records here; the same lease between two Ray clusters, with a hung first driver fenced out, is
test_operations.py's.

Each finding of the review it answers: a torn or unreadable record is never "no holder"; every
write is a compare-and-swap, so of two writers from one version exactly one wins and a renewal
that lost the race never writes the old holder back; a commit after a takeover is refused by the
write itself; expiry is judged by the reader's own clock, whatever the holder's wall clock says;
identity is the host, its boot and the pid namespace, not the host name alone."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from raytrain.errors import JobError
from raytrain.rundir import lease, versioned

ME = {"host": "elsewhere", "pid": 1, "job_id": "01000000", "submission_id": None, "since": time.time()}


@pytest.fixture(params=["local", "s3"])
def run_dir(request, tmp_path, monkeypatch):
    if request.param == "local":
        return str(tmp_path / "run")
    env, client = request.getfixturevalue("s3_server")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = f"lease-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/job"


@pytest.fixture
def quick(monkeypatch):
    """A lease whose durations are short enough for a test: TTL 1.5 s, renewals every 0.2 s."""
    monkeypatch.setattr(lease, "TTL_S", 1.5)
    monkeypatch.setattr(lease, "RENEW_S", 0.2)
    monkeypatch.setattr(lease, "CHECK_S", 0.1)
    monkeypatch.setattr(lease, "RETRY_S", 1.0)


def test_of_writers_from_one_version_exactly_one_wins(run_dir):
    uri = lease.uri(run_dir)
    assert versioned.load(uri) == (None, None)
    first = versioned.write(uri, {"n": 0}, None)
    with pytest.raises(versioned.Conflict):
        versioned.write(uri, {"n": -1}, None)  # create-only: it exists
    won, lost = [], []

    def writer(i):
        try:
            won.append((i, versioned.write(uri, {"n": i}, first)))
        except versioned.Conflict:
            lost.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 7)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(won) == 1 and len(lost) == 5, (won, lost)
    doc, version = versioned.load(uri)
    assert doc["n"] == won[0][0] and version == won[0][1]
    with pytest.raises(versioned.Conflict):  # the version read before the winner's write is stale now
        versioned.write(uri, {"n": 99}, first)


def test_a_torn_or_unreadable_record_is_never_taken_for_no_holder(run_dir, quick):
    lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    holder, version = versioned.load(lease.uri(run_dir))
    torn = json.dumps(holder)[:25]  # what a truncating writer, or a read cut short, leaves
    if run_dir.startswith("s3://"):
        import boto3

        bucket, _, key = lease.uri(run_dir).removeprefix("s3://").partition("/")
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=torn.encode())
    else:
        open(lease.uri(run_dir), "w").write(torn)
    with pytest.raises(versioned.Unreadable):
        versioned.load(lease.uri(run_dir))
    with pytest.raises(JobError, match="cannot be read .*nothing was started"):
        lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=False)
    fence = lease.Fence(run_dir, holder["token"], every_s=3600)
    fence._check()
    assert not fence.stale  # unknown is not taken over: the commit's conditional write decides
    with pytest.raises(JobError, match="cannot be read"):  # and that write cannot go through a torn record
        lease.commit(run_dir, holder["token"], "step_00000003")


def test_a_renewal_that_lost_the_race_never_writes_the_old_holder_back(run_dir, quick):
    first = lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    renewal = lease.Renewal(run_dir, first)
    time.sleep(0.5)
    assert lease.read(run_dir)["renewals"] >= 1
    second = lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=True)
    time.sleep(0.6)  # several of the first's renewals come due
    assert not renewal._thread.is_alive()  # it saw the takeover and stopped
    record = lease.read(run_dir)
    assert record["token"] == second and record["generation"] == 2 and record["renewals"] == 0
    renewal.release()  # no longer its lease: nothing written
    assert lease.read(run_dir) == record


def test_a_commit_after_a_takeover_is_refused_by_the_write_itself(run_dir, quick):
    first = lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    lease.commit(run_dir, first, "step_00000003")
    assert lease.read(run_dir)["committed"] == "step_00000003"
    fence = lease.Fence(run_dir, first, every_s=3600)  # the fenced group's rank 0 never got to read it
    second = lease.acquire(run_dir, {**ME, "pid": 2, "submission_id": "raysubmit_2"}, "cluster-b", takeover=True)
    with pytest.raises(JobError, match="taken over by submission raysubmit_2 .*committed nothing after it"):
        lease.commit(run_dir, first, "step_00000006")
    assert lease.read(run_dir)["committed"] == "step_00000003"  # what the new driver resumes from
    lease.commit(run_dir, second, "step_00000006")
    assert lease.read(run_dir)["committed"] == "step_00000006"
    with pytest.raises(JobError, match="taken over by submission raysubmit_2"):
        fence.require()


def test_expiry_is_the_readers_own_observation_not_the_holders_wall_clock(run_dir, quick):
    # The holder's host runs 30 minutes ahead, or behind: its wall-clock fields say nothing to the reader.
    for skew in (+1800, -1800):
        token = lease.acquire(run_dir, {**ME, "since": time.time() + skew}, f"cluster-{skew}", takeover=True)
        renewal = lease.Renewal(run_dir, token)
        began = time.monotonic()
        with pytest.raises(JobError, match="in use by another driver.*saw it renew its lease"):
            lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=False)
        assert time.monotonic() - began < lease.TTL_S  # refused at the first renewal it saw
        renewal.stop()  # the holder dies without releasing (kill -9, a lost node)
        began = time.monotonic()
        taken = lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=False)
        assert time.monotonic() - began >= lease.TTL_S  # only after watching it stay silent for the TTL
        assert lease.read(run_dir)["token"] == taken


def test_a_holder_is_this_processes_neighbour_only_in_the_same_boot_and_pid_namespace(tmp_path):
    me = lease.process_identity()
    dead = {"host": me["host"], "pid": 2**22 + 7, "boot": me["boot"], "pidns": me["pidns"]}  # no such process
    assert "is dead" in lease.gone(dead, "cluster-b")
    # A container with the same host name and its own pid namespace: its pid says nothing here.
    assert lease.gone({**dead, "pidns": "pid:[1]"}, "cluster-b") is None
    assert lease.gone({**dead, "boot": "another-boot"}, "cluster-b") is None
    assert lease.gone({**dead, "cluster": "cluster-b"}, "cluster-b") is not None  # its actor was on this cluster
    assert lease.gone({"released": True}, "cluster-b") is not None


def test_a_run_directory_without_conditional_writes_is_refused_at_validate():
    from raytrain.job.sections import CheckpointSpec

    for uri in ("gs://bucket/runs", "hdfs://namenode/runs", "abfs://container/runs"):
        with pytest.raises(
            ValueError, match=f"storage_path='{uri}'.*conditional writes.*use an s3:// bucket.*shared file system"
        ):
            CheckpointSpec(storage_path=uri)
    assert CheckpointSpec(storage_path="s3://bucket/runs") and CheckpointSpec(storage_path="/mnt/shared/runs")
