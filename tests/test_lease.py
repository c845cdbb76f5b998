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

import contextlib
import datetime
import fcntl
import http.client
import http.server
import json
import os
import subprocess
import threading
import time
import uuid

import pytest

from raytrain.errors import JobError, TransientError, transient, user_message
from raytrain.rundir import checkpoints, lease, metrics_backlog, storage, versioned

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
    # ...and that write cannot go through a torn record. Mid-run that is a storage outage, which a
    # restart may outlast (transient, not final), and nothing in it says "nothing was started".
    with pytest.raises(TransientError, match="step_00000003 was not committed.*could not be read or written") as got:
        lease.commit(run_dir, holder["token"], "step_00000003")
    assert transient(got.value) and user_message(got.value) is None and "nothing was started" not in str(got.value)


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
        # Refused at the first renewal it saw: `_watch` returns on a changed version, and only then does
        # the refusal say so (a wall-clock bound here failed CI under load: an S3 round trip took 1.6 s).
        with pytest.raises(JobError, match="in use by another driver.*saw it renew its lease"):
            lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=False)
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


@contextlib.contextmanager
def unwritable(folder: str):
    """Every write into `folder` fails (reads still work), as a storage outage on writes: immutable
    for root (chattr +i), read-only for anyone else."""
    root = os.geteuid() == 0
    if root:
        subprocess.run(["chattr", "+i", folder], check=True)
    else:
        os.chmod(folder, 0o555)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", folder], check=True) if root else os.chmod(folder, 0o755)


def test_a_failed_renewal_write_is_retried_and_the_live_job_keeps_its_lease(tmp_path, quick):
    """One failed write (here every write for a while) used to end renewal for good: TTL_S later
    any other driver took the live job over without --takeover."""
    run_dir = str(tmp_path / "run")
    token = lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    renewal = lease.Renewal(run_dir, token)
    with unwritable(run_dir):
        time.sleep(4 * lease.RENEW_S)  # several renewals fail
    assert renewal._thread.is_alive()
    after_outage = lease.read(run_dir)["renewals"]
    time.sleep(1.5 * lease.TTL_S)  # at the real TTL, 90 s
    with pytest.raises(JobError, match="in use by another driver.*saw it renew its lease"):
        lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=False)
    record = lease.read(run_dir)
    assert record["token"] == token and record["generation"] == 1 and record["renewals"] > after_outage
    renewal.stop()


def _sign_on_two_ranks(rank: int, port: int, run_dir: str, token: str, out: str) -> None:
    """One rank of a 2-rank gloo group signing a checkpoint (train/checkpoint.sign), for each case
    the test sets up between them; writes what each call raised."""
    import torch.distributed as dist

    from raytrain.train.checkpoint import sign

    lease.RETRY_S = 1.0
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    seen = []
    for case in ("unwritable", "fenced"):
        dist.barrier()  # the test's setup of this case is done (rank 0 waits for its file)
        if rank == 0:
            while not os.path.exists(f"{out}/{case}.ready"):
                time.sleep(0.1)
        dist.barrier()
        folder = f"{out}/rank{rank}-{case}"
        os.makedirs(folder)
        open(f"{folder}/part.bin", "wb").write(b"x" * 10)
        try:
            sign(folder, run_dir, "step_00000003", token)
            seen.append([case, None, None])
        except Exception as exc:  # what each rank raised
            seen.append([case, type(exc).__name__, str(exc)])
        if rank == 0:
            open(f"{out}/{case}.done", "w").write("")
    open(f"{out}/rank{rank}.json", "w").write(json.dumps(seen))
    dist.destroy_process_group()


def test_a_commit_that_fails_on_rank_0_raises_the_same_error_on_every_rank(tmp_path):
    """The commit (lease.commit, rank 0 only) used to leave rank 0 on a write error before the
    broadcast: the other ranks waited in it up to the gloo timeout (30 min on the async path)."""
    import torch.multiprocessing as mp
    from conftest import free_port

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    token = lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_sign_on_two_ranks, args=(r, port, run_dir, token, out)) for r in range(2)]
    [p.start() for p in procs]
    with unwritable(run_dir):  # the commit's write fails: a storage outage longer than RETRY_S
        open(f"{out}/unwritable.ready", "w").write("")
        while not os.path.exists(f"{out}/unwritable.done"):
            assert all(p.is_alive() or p.exitcode == 0 for p in procs)
            time.sleep(0.1)
    lease.acquire(run_dir, {**ME, "pid": 2, "submission_id": "raysubmit_2"}, "cluster-b", takeover=True)
    open(f"{out}/fenced.ready", "w").write("")
    for p in procs:
        p.join(timeout=90)  # not the gloo timeout: every rank is told at once
        assert p.exitcode == 0, p.exitcode
    ranks = [json.loads(open(f"{out}/rank{r}.json").read()) for r in range(2)]
    assert ranks[0] == ranks[1], ranks  # the same error, word for word, on every rank
    (_, unwritable_type, unwritable_text), (_, fenced_type, fenced_text) = ranks[0]
    assert unwritable_type == "TransientError" and "step_00000003 was not committed" in unwritable_text
    assert fenced_type == "JobError" and "taken over by submission raysubmit_2" in fenced_text
    assert lease.read(run_dir)["committed"] is None  # neither commit went through


def test_a_deleted_record_does_not_reset_the_generation(run_dir, quick):
    """A new driver's generation is above every one the run directory's checkpoint folders name:
    generation 1 again would write into generation 1's folders."""
    for name in ("step_00000004", "step_00000008-g3", "step_00000006-g10"):
        storage.write_text(storage.join(run_dir, name, "train_state.json"), "{}") if run_dir.startswith(
            "s3://"
        ) else os.makedirs(os.path.join(run_dir, name))
    token = lease.acquire(run_dir, ME, "cluster-a", takeover=False)  # no driver.json: deleted by hand
    assert lease.generation_of(token) == 11
    assert checkpoints.folder_name(9, token) == "step_00000009-g11"


def test_checkpoints_are_ordered_by_step_then_generation_as_numbers(tmp_path):
    assert checkpoints.order_key("step_00000010-g10") > checkpoints.order_key("step_00000010-g9")
    assert checkpoints.order_key("step_00000010") < checkpoints.order_key("step_00000010-g2")
    assert checkpoints.order_key("step_00000011") > checkpoints.order_key("step_00000010-g12")
    # The rollback check compares the signed record with Ray's snapshot so: generation 10's
    # checkpoint registered after generation 9's at the same step is no rollback.
    run_dir = str(tmp_path / "run")
    for name in ("step_00000010-g9", "step_00000010-g10"):
        os.makedirs(os.path.join(run_dir, name))
    checkpoints.record_latest(run_dir, "step_00000010-g9")
    results = [{"checkpoint_dir_name": n} for n in ("step_00000010-g9", "step_00000010-g10")]
    snapshot = {"latest_checkpoint_result": results[1], "checkpoint_results": results}
    open(os.path.join(run_dir, checkpoints.RAY_SNAPSHOT), "w").write(json.dumps(snapshot))
    assert checkpoints.latest_checkpoint(run_dir).endswith("/step_00000010-g10")
    # ...and a snapshot that does name an older one than the record is still refused
    checkpoints.record_latest(run_dir, "step_00000010-g10")
    snapshot["latest_checkpoint_result"] = results[0]
    open(os.path.join(run_dir, checkpoints.RAY_SNAPSHOT), "w").write(json.dumps(snapshot))
    with pytest.raises(JobError, match="rolled back"):
        checkpoints.latest_checkpoint(run_dir)
    # Of the registered folders still there, the newest by (step, generation)
    registered = [{"checkpoint_dir_name": n} for n in ("step_00000010-g9", "step_00000010-g10", "step_00000012")]
    os.rmdir(os.path.join(run_dir, "step_00000010-g10"))
    assert checkpoints._newest_present(registered, {"step_00000010-g9", "step_00000008-g30"}) == registered[0]


def test_the_takeovers_wait_lasts_while_the_committed_checkpoint_uploads(tmp_path, capsys):
    """A checkpoint committed just before a takeover may upload for longer than the TTL: the new
    driver waits while its folder grows, so it resumes from it rather than beside a late lineage."""
    run_dir, name = str(tmp_path / "run"), "step_00000005"
    os.makedirs(os.path.join(run_dir, name))

    def upload():  # one file every 0.3 s for 2 s (an idle limit of 1 s would have given up), then registered
        for i in range(7):
            open(os.path.join(run_dir, name, f"part-{i}"), "w").write("x")
            time.sleep(0.3)
        snapshot = {"checkpoint_results": [{"checkpoint_dir_name": name}]}
        open(os.path.join(run_dir, checkpoints.RAY_SNAPSHOT), "w").write(json.dumps(snapshot))

    uploader = threading.Thread(target=upload)
    uploader.start()
    checkpoints.await_committed(run_dir, name, idle_s=1.0)
    uploader.join()
    assert "did not finish uploading" not in capsys.readouterr().out
    checkpoints.await_committed(run_dir, "step_00000006", idle_s=1.0)  # nothing of it uploaded: no wait


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    from conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Unsent:
    """Rank 0's StepLogger as the backlog sees it: the committed steps MLflow has not taken."""

    def __init__(self, steps):
        self.steps, self.written_through = steps, 0

    def unwritten(self):
        return self.steps


def test_a_fenced_group_writes_and_deletes_no_backlog_file(tmp_path, world_of_one):
    from raytrain.train.after_step import Lease, before_checkpoint

    run_dir = str(tmp_path / "run")
    first = lease.acquire(run_dir, ME, "cluster-a", takeover=False)
    metrics_backlog.Journal(run_dir).keep([(1, {"loss": 1.0})])  # an earlier checkpoint's, MLflow down
    journal = metrics_backlog.Journal(run_dir, resumed=1)
    fence = lease.Fence(run_dir, first, every_s=3600)
    lease.acquire(run_dir, {**ME, "pid": 2}, "cluster-b", takeover=True)
    backlog = os.path.join(run_dir, metrics_backlog.FOLDER)
    before = sorted(os.listdir(backlog))
    unsent = Unsent([(2, {"loss": 0.5})])
    unsent.written_through = 1  # MLflow has step 1 now: a forget would delete its file
    with pytest.raises(JobError, match="taken over"):
        before_checkpoint(Lease(first, fence), journal, unsent)
    assert sorted(os.listdir(backlog)) == before == ["steps_00000001-00000001.json"]


def test_the_backlogs_watermark_follows_a_rollback(tmp_path):
    """Resumed at step 6 after steps up to 8 were kept: steps 7 and 8 are trained again, and their
    new values are what a later restore owes MLflow, not the rolled-back lineage's."""
    from raytrain.rundir.checkpoints import TrainState

    run_dir = str(tmp_path / "run")
    old = metrics_backlog.Journal(run_dir)
    old.keep([(s, {"loss": 1.0, "lineage": 0}) for s in range(1, 5)])
    old.keep([(s, {"loss": 1.0, "lineage": 0}) for s in range(5, 9)])
    journal = metrics_backlog.Journal(run_dir, resumed=6)
    journal.keep([(s, {"loss": 0.5, "lineage": 1}) for s in (7, 8)])
    owed = metrics_backlog.unwritten(run_dir, TrainState(step=8))
    assert [step for step, _ in owed] == list(range(1, 9))
    assert [m["lineage"] for step, m in owed if step > 6] == [1, 1]


def test_a_record_read_locks_the_record_itself(tmp_path):
    """So the NFS client revalidates what it reads (a lock taken flushes its cached pages)."""
    uri = str(tmp_path / "run" / "driver.json")
    versioned.write(uri, {"n": 1}, None)
    got = []
    with open(uri) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        reader = threading.Thread(target=lambda: got.append(versioned.load(uri)))
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and not got  # it waits for the lock on the record
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    reader.join(timeout=10)
    assert got[0][0]["n"] == 1


def test_nfs_whose_locks_stay_on_one_node_is_refused():
    mounts = (
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "srv:/export /mnt/shared nfs rw,vers=3,nolock,proto=tcp 0 0\n"
        "srv:/other /mnt/other nfs4 rw,vers=4.1,local_lock=none 0 0\n"
        "srv:/flock /mnt/flock nfs rw,vers=3,local_lock=flock 0 0\n"
    )
    assert versioned.node_local_locks("/mnt/shared/runs/job", mounts) == "/mnt/shared (nfs, nolock)"
    assert versioned.node_local_locks("/mnt/flock/runs", mounts) == "/mnt/flock (nfs, local_lock=flock)"
    assert versioned.node_local_locks("/mnt/other/runs", mounts) is None  # locks go to the server
    assert versioned.node_local_locks("/mnt/sharedness/runs", mounts) is None  # another mount: /
    assert versioned.problems("/tmp/runs/job") is None  # this machine's local disk


class ConditionsDropped(http.server.BaseHTTPRequestHandler):
    """An S3-compatible store that accepts If-Match / If-None-Match and ignores them: moto behind a
    proxy that drops those two headers from each request."""

    protocol_version = "HTTP/1.1"
    upstream = ""

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-match", "if-none-match", "host")}
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        conn.request(self.command, self.path, body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args):
        pass


def test_a_store_that_ignores_conditional_writes_is_refused_at_validate(s3_server, monkeypatch):
    env, client = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = f"swap-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    assert versioned.problems(f"s3://{bucket}/runs/job") is None  # moto keeps S3's conditions
    ConditionsDropped.upstream = env["AWS_ENDPOINT_URL"].removeprefix("http://")
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ConditionsDropped)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
    try:
        why = versioned.problems(f"s3://{bucket}/runs/job")
    finally:
        proxy.shutdown()
    assert why and "ignores If-None-Match" in why and "two drivers" in why, why
    assert not [o for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]  # the probe cleaned up
