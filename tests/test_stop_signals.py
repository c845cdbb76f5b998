"""The stop and restart policies on their own: a driver stop is seen however slowly the control
actor (a real Ray actor) answers, every new Ray preemption notice gets its own checkpoint (a
repeat of the same notice does not), and every failed group counts against the budget."""

from __future__ import annotations

import time

from raytrain.train.preemption import DRIVER_STOP, RAY_NOTICE, StopSignals


def test_a_driver_stop_lands_although_the_actor_answers_slower_than_a_step(ray_address):
    import ray

    # Defined here so Ray pickles the class by value: the cluster's workers do not have
    # tests/ on their import path.
    class SlowControl:
        """The control actor's interface, answering each progress report after a delay."""

        def __init__(self, delay_s: float):
            self.delay_s, self.stop = delay_s, None

        def step_done(self, step: int, step_time: float):
            time.sleep(self.delay_s)
            return self.stop

        def request_stop(self, reason: str) -> None:
            self.stop = reason

    control = ray.remote(num_cpus=0)(SlowControl).options(max_concurrency=1).remote(0.2)
    stops = StopSignals(control, check_ray_notice=False)
    ray.get(control.request_stop.remote("SIGTERM"))
    seen_at = None
    for step in range(1, 60):  # 10 ms steps, answers every 200 ms: a stop must still be seen
        flags = stops.agree(stops.local())
        if flags & DRIVER_STOP:
            seen_at = step
            break
        stops.step_done(step, 0.01, rank=0)
        time.sleep(0.01)
    assert seen_at is not None


def test_each_new_preemption_notice_is_acted_on_once():
    notices = iter([None, "node-a", "node-a", "node-a", None, "node-b", "node-b"])
    stops = StopSignals(None, notices=lambda: next(notices))
    acted = [bool(stops.agree(stops.local()) & RAY_NOTICE) for _ in range(7)]
    assert acted == [False, True, False, False, False, True, False]


def test_a_group_that_dies_while_loading_counts_against_the_failure_budget():
    # A group that failed before its first step (model load, OOM while sharding) was never on
    # record: the budget never ran out and Ray restarted it forever (seen: 96 restarts).
    from raytrain.driver.control import JobControl

    control = JobControl(max_failures=2)
    for error in ("OutOfMemoryError: CUDA out of memory", "DistBackendError: NCCL timeout", "OutOfMemoryError: host"):
        assert control.may_start(2) is None
        control.failed(error, retry=True)
    verdict = control.may_start(2)
    assert verdict and verdict.startswith(
        "3 worker failures (preemptions and resizes not counted) exceed "
        "failure.max_failures=2; the last: OutOfMemoryError: host"
    )


def test_the_failure_policy_decides_from_the_attempts_alone():
    # The decision as a value, from a list of attempts: preemptions and a resize are not failures,
    # a job error stops at once, a transient error repeated is retried within the budget.
    from raytrain.driver.failures import GO_ON, Attempt, FailurePolicy

    policy = FailurePolicy(max_failures=1)
    preempted = Attempt(4, 0, 0.0, last_step=8, preempted_at=8)
    shrunk = Attempt(2, 8, 1.0, last_step=10, error="node lost")
    assert policy.may_start([preempted], 4) == GO_ON  # a preemption's checkpoint committed
    assert policy.may_start([preempted, shrunk], 4) == GO_ON  # followed by a larger group: a resize
    assert policy.may_start([preempted, shrunk], 2) == GO_ON  # one failure: within max_failures=1
    twice = policy.may_start([preempted, shrunk, Attempt(2, 8, 2.0, error="node lost")], 2)
    assert twice.stop and twice.reason.startswith("2 worker failures") and "the last: node lost" in twice.reason
    assert policy.after_error([shrunk], "bad row", retry=False) == FailurePolicy(5).after_error([], "bad row", False)
    assert policy.after_error([shrunk], "bad row", retry=False).reason == "bad row"
    again = [Attempt(2, 8, 1.0, last_step=10, error="E"), Attempt(2, 8, 2.0, last_step=10, error="E")]
    assert policy.after_error(again, "E", retry=True).stop
    assert policy.after_error(again, "E", retry=True, transient=True) == GO_ON
    assert FailurePolicy(-1).may_start([shrunk] * 50, 2) == GO_ON  # no limit


def test_the_same_error_twice_at_the_same_step_ends_the_job_before_its_budget():
    # The shipped long-context job (sp + activation checkpointing) raised the same RuntimeError at
    # step 1 four times, spending failure.max_failures on an error no restart could mend.
    from raytrain.driver.control import JobControl

    control = JobControl(max_failures=10)
    error = "RuntimeError: sequence-parallel attention called outside SequenceSplit.attending"
    assert control.may_start(4) is None
    control.attempt_started(4, 50)
    control.step_done(51, 1.0)
    control.failed(error, retry=True)  # in step 52, from step 50
    assert control.may_start(4) is None  # once may be a fluke: restart
    control.attempt_started(4, 50)
    control.step_done(51, 1.0)
    control.failed(error, retry=True)
    verdict = control.may_start(4)
    assert verdict == (
        f"the same error twice in step 52, each time from step 50: {error}. A restart repeats it: fix "
        "its cause, then run the job again (it resumes from the latest committed checkpoint, which is kept)"
    )

    # Storage, the network or a collective failing twice at one step is no bug of the job: restarts
    # go on within the budget (an S3 outage, a peer's node lost twice).
    from raytrain.errors import transient

    for exc in (
        OSError("AWS Error SERVICE_UNAVAILABLE during GetObject operation"),
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:52001"),
    ):
        assert transient(exc)
        control = JobControl(max_failures=10)
        for _ in range(3):
            assert control.may_start(4) is None
            control.attempt_started(4, 50)
            control.step_done(51, 1.0)
            control.failed(f"{type(exc).__name__}: {exc}", retry=True, transient=transient(exc))
        assert control.may_start(4) is None
    assert not transient(RuntimeError("sequence-parallel attention called outside SequenceSplit.attending"))

    # The same error after progress (a newer checkpoint, or a later step) is another failure: restart.
    control = JobControl(max_failures=10)
    for resumed, last in ((50, 51), (100, 101), (100, 120)):
        assert control.may_start(4) is None
        control.attempt_started(4, resumed)
        control.step_done(last, 1.0)
        control.failed(error, retry=True)
    assert control.may_start(4) is None


def test_goodput_counts_the_kept_steps_in_bounded_memory():
    # The control actor kept every step's time for the whole run (a dict of 100k entries on a long
    # job); now only the steps a restart can still roll back, the rest summed.
    from raytrain.driver.control import JobControl

    control = JobControl(window=30)  # every_n_steps 10, keep_last 2
    control.may_start(2)
    control.attempt_started(2, 0)
    for step in range(1, 100_001):
        control.step_done(step, 0.5)
    assert len(control.step_times) <= 30
    control.may_start(2)
    control.attempt_started(2, 99_990)  # a restart from the step-99990 checkpoint: 10 steps rolled back
    for step in range(99_991, 100_006):
        control.step_done(step, 0.25)
    assert control.goodput()["productive_s"] == 99_990 * 0.5 + 15 * 0.25


def test_a_recovery_interrupted_by_another_failure_ends_where_the_next_begins():
    # Seen in a soak: a node lost while the group was still loading after an earlier loss gave
    # the earlier failure a 614 s recovery (counted to the end of the job) in a 644 s run.
    from raytrain.driver.control import Attempt, JobControl

    control = JobControl()
    control.started = 0.0
    control.attempts = [
        Attempt(2, 0, started_at=0.0, first_step_at=5.0, last_step=10, last_step_at=30.0),
        Attempt(2, 10, started_at=40.0),  # lost again before its first step
        Attempt(2, 10, started_at=70.0, first_step_at=80.0, last_step=20, last_step_at=100.0),
    ]
    failures = control.goodput()["failures"]
    assert [f["recovery_s"] for f in failures] == [10.0, 40.0]  # 30 -> 40, then 40 -> 80: 50 s in all, once
    assert [f["steps_lost"] for f in failures] == [0, 0]


def test_ranks_waiting_for_the_data_are_woken_by_the_drivers_word_and_never_hold_up_its_calls(ray_address, tmp_path):
    # Before, every rank polled the token stores and the control actor 4 times a second while the
    # driver prepared the data (about 4,000 actor calls a second at 512 ranks). Now each rank's one
    # call waits on the real control actor, an asyncio actor: the pending waits leave its other
    # methods free, and the driver's word (prepared, a failed prepare, a stop) ends them all.
    import ray

    from raytrain.driver import control

    for ending in ("prepared", "failed", "stopped"):
        run_dir = str(tmp_path / ending)
        held = control.start_actor(run_dir)
        actor = held.actor
        try:
            waits = [actor.data_ready.remote(60) for _ in range(64)]  # a group of 64 ranks
            assert ray.get(actor.data_ready.remote(0.05), timeout=30) is None  # nothing said yet: ask again
            assert ray.get(actor.may_start.remote(64), timeout=5) is None  # the waits hold nothing up
            if ending == "prepared":
                ray.get(actor.data_prepared.remote(), timeout=5)
            elif ending == "failed":  # as the driver says a failed prepare
                ray.get(
                    actor.failed.remote("rows.jsonl row 30: column 'text' must be a string", retry=False), timeout=5
                )
            else:
                ray.get(actor.request_stop.remote("SIGTERM"), timeout=5)
            assert ray.get(waits, timeout=10) == [ending == "prepared"] * 64, ending
            # A group Ray starts later (after a failure) has its answer at once.
            assert ray.get(actor.data_ready.remote(60), timeout=5) is (ending == "prepared")
        finally:
            control.release(run_dir, held)


def test_only_what_a_restart_can_mend_counts_as_transient():
    """errors.transient: storage, the network, a lost peer. A missing file, a refused permission, a
    collective's invalid argument or an OOM that names NCCL or gloo repeat on a restart: counted
    transient, they used up failure.max_failures instead of ending the job at the second time."""
    import errno

    from raytrain.errors import JobError, TransientError, transient
    from raytrain.rundir.versioned import Unreadable

    mended = (
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        TimeoutError("read timed out"),
        OSError(errno.ETIMEDOUT, "Connection timed out"),
        OSError(errno.ESTALE, "Stale file handle"),  # an NFS server restarted
        OSError("When reading key 'step': AWS Error SLOW_DOWN during GetObject (HTTP 503)"),
        OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7"),
        Unreadable("s3://b/run/driver.json could not be read: 500 InternalError"),
        TransientError("checkpoint step_00000003 was not committed: the lease could not be read or written"),
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:52001"),
        RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO)"),
    )
    repeated = (
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/train.jsonl"),
        PermissionError(errno.EACCES, "Permission denied", "/mnt/runs/job"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError("When reading key 'x': AWS Error ACCESS_DENIED during GetObject operation"),
        RuntimeError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)"),
        RuntimeError("[gloo] mismatched tensor sizes in allreduce: 4 vs 8"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (NCCL buffers)"),
        ValueError("the reward function timed out on row 3"),  # the job's own code saying so
        JobError("data.path: no such file"),
    )
    assert [transient(e) for e in mended] == [True] * len(mended)
    assert [transient(e) for e in repeated] == [False] * len(repeated)
    try:  # a cause counts through the chain, as Ray nests a worker's error
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except OSError as inner:
            raise RuntimeError("the upload failed") from inner
    except RuntimeError as outer:
        assert transient(outer)
