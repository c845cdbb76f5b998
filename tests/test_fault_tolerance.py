"""Exact resume (FSDP2 here; ZeRO-3 and DDP in test_strategies.py): real worker processes die
(os._exit, SIGTERM) at known steps on a real
Ray cluster; the resumed run's per-step losses must equal the uninterrupted run's bit for
bit, MLflow must hold each step once, and the goodput record must tell what was lost."""

from __future__ import annotations

import pytest
from conftest import make_job, metric_history

from raytrain.driver import launcher
from raytrain.errors import JobError
from raytrain.train.export import export_checkpoint, latest_checkpoint

pytestmark = pytest.mark.slow
STEPS, EVERY = 12, 4


def job(assets, storage, name, **over):
    over.setdefault("failure", {"max_failures": 2})
    checkpoint = {"every_n_steps": EVERY, "keep_last": 3, **over.pop("checkpoint", {})}
    return make_job(
        assets, storage, name=name, training={"max_steps": STEPS, "finetune": "full"}, checkpoint=checkpoint, **over
    )


@pytest.fixture(scope="module")
def reference(ray_address, assets, tmp_path_factory):
    spec = job(assets, tmp_path_factory.mktemp("ref"), "ref")
    result = launcher.run(spec)
    return metric_history(spec, result.run_id)


def run_with_faults(inject_faults, tmp_path, assets, name, faults, **over):
    inject_faults(faults)
    spec = job(assets, tmp_path / "runs", name, **over)
    return spec, launcher.run(spec)


# Three kills of rank 1 and one SIGTERM in one job (each fires once), in this order: a kill just
# after a checkpoint (step 5); SIGTERM after step 6, which lands during step 7: every rank finishes
# step 7, commits it and leaves, a preemption that is no failure (the job has a budget of exactly
# its three kills); a kill during a checkpoint's write (rank 1 dies after writing its shards of
# step 8 but before the checkpoint is reported: it must stay invisible, so the restart takes 7);
# and a kill mid-interval (step 10). Rank 1: rank 0 reports each step to the driver without
# waiting, so a rank 0 killed right after a step may take that report with it (its death is tested
# in test_too_many_failures...). Each restart resumes bit-identically and is counted on its own.
def test_worker_killed_three_times_and_preempted_once_resumes_bit_identical_each_time(
    reference, inject_faults, tmp_path, assets
):
    spec, result = run_with_faults(
        inject_faults,
        tmp_path,
        assets,
        "kills",
        [
            {"at": "step", "step": 5, "rank": 1, "action": "exit"},
            {"at": "step", "step": 6, "rank": 1, "action": "sigterm"},
            {"at": "save", "step": 8, "rank": 1, "action": "exit"},
            {"at": "step", "step": 10, "rank": 1, "action": "exit"},
        ],
        failure={"max_failures": 3},
    )
    assert metric_history(spec, result.run_id) == reference  # every step once, bit-identical
    # (kind, resumed from, steps redone): after step 5 -> 4 (1 lost); the SIGTERM -> 7 (none lost);
    # the torn step 8 -> 7 (its checkpoint never counted); after step 10 -> 8 (step 8's second save)
    assert [(f["kind"], f["resumed_from"], f["steps_lost"]) for f in result.goodput["failures"]] == [
        ("failure", 4, 1),
        ("preemption", 7, 0),
        ("failure", 7, 1),
        ("failure", 8, 2),
    ]


def test_async_checkpoints_torn_by_a_kill_stay_invisible_and_committed_ones_are_used(
    reference, inject_faults, tmp_path, assets
):
    # checkpoint.async_save, two kills of rank 1 in one job. First while a background thread is
    # still writing step 8's shards: that checkpoint stays invisible, the restart resumes from 4.
    # Then, in the restarted attempt, at step 10: step 8's checkpoint was uploaded in the background
    # and committed by Ray while training went on, but the loop never confirmed it (that happens at
    # the next save). The restart resumes from 8, and MLflow still gets steps 5-8 (from the checkpoint).
    # And step 4's upload is answered SlowDown once on rank 1 (S3 over its request rate): Ray uploads
    # that part again, on rank 1 alone, and its signing, a collective, is not run twice (its gather
    # would have paired with step 8's): step 4 commits and verifies, so do the checkpoints after it.
    spec = job(assets, tmp_path / "runs", "async", checkpoint={"async_save": True})
    inject_faults(
        [
            {"at": "upload", "step": 4, "rank": 1, "action": "slow_down"},
            {"at": "save", "step": 8, "rank": 1, "action": "exit"},
            {
                "at": "step",
                "step": 10,
                "rank": 1,
                "action": "exit",
                "after_commit": {"run_dir": spec.run_dir, "step": 8},
            },
        ]
    )
    result = launcher.run(spec)
    assert [(f["resumed_from"], f["steps_lost"]) for f in result.goodput["failures"]] == [(4, 4), (8, 2)]
    assert (tmp_path / "fault-markers" / "fault-0").exists()  # the SlowDown was answered
    assert metric_history(spec, result.run_id) == reference
    assert latest_checkpoint(spec.run_dir).endswith(f"step_{STEPS:08d}")


def test_too_many_failures_fail_cleanly_with_checkpoints_intact(ray_address, inject_faults, tmp_path, assets):
    from mlflow.tracking import MlflowClient

    from raytrain.tracking.mlflow_run import tracking_uri

    spec = job(assets, tmp_path / "runs", "exhausted", failure={"max_failures": 0})
    # The kill waits until step 5's live loss reached MLflow (it is written in the background, best
    # effort: a loaded lane once killed rank 0 before it did). What is checked is that a value
    # MLflow shows live is never taken for a committed one, and that the commit stops at step 4.
    live5 = {"tracking_uri": tracking_uri(spec), "run_dir": spec.run_dir, "step": 5}
    inject_faults([{"at": "step", "step": 6, "rank": 0, "action": "exit", "after_live": live5}])
    with pytest.raises(
        JobError,
        match=r"1 worker failures \(preemptions and resizes not counted\) exceed "
        r"failure.max_failures=0",
    ):
        launcher.run(spec)
    runs = MlflowClient(tracking_uri(spec)).search_runs(
        [MlflowClient(tracking_uri(spec)).get_experiment_by_name("tests").experiment_id],
        f"tags.`raytrain.run_dir` = '{spec.run_dir}'",
    )
    assert [r.info.status for r in runs] == ["FAILED"]
    # Live values arrive as the steps finish, before any checkpoint commits them: step 5 never
    # committed (the job died at step 6, after the step-4 checkpoint), yet the user saw its loss.
    committed, live = metric_history(spec, runs[0].info.run_id), metric_history(spec, runs[0].info.run_id, "live/loss")
    assert sorted(committed) == [1, 2, 3, 4] and {1, 2, 3, 4, 5} <= set(live)
    assert all(live[s] == committed[s] for s in committed)
    assert latest_checkpoint(spec.run_dir).endswith("step_00000004")
    export_checkpoint(spec.run_dir, str(tmp_path / "out"))  # the last committed checkpoint still loads
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_failure_before_training_leaves_no_run_open_and_the_run_directory_free(ray_address, assets, tmp_path):
    # The run directory cannot be created (a file is in the way): the job fails with one line
    # naming it, no MLflow run is left RUNNING forever, and its lease is given back.
    from mlflow.tracking import MlflowClient

    from raytrain.driver import control
    from raytrain.tracking.mlflow_run import tracking_uri

    spec = job(assets, tmp_path / "runs", "blocked")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "blocked").write_text("not a folder")
    with pytest.raises(JobError, match="blocked"):
        launcher.run(spec)
    client = MlflowClient(tracking_uri(spec))
    experiment = client.get_experiment_by_name("tests")
    runs = (
        client.search_runs([experiment.experiment_id], f"tags.`raytrain.run_dir` = '{spec.run_dir}'")
        if experiment
        else []
    )
    assert [r.info.status for r in runs if r.info.status != "FAILED"] == []
    assert control.find_actor(spec.run_dir) is None  # a resubmit is not refused


def test_ctrl_c_on_the_driver_checkpoints_and_ends_the_run_killed(ray_address, assets, tmp_path):
    # Ray Train's own SIGINT handler used to replace raytrain's: Ctrl-C aborted with no checkpoint
    # and the run ended FAILED with no loss logged.
    import os
    import signal
    import subprocess
    import sys

    import yaml
    from mlflow.tracking import MlflowClient

    from raytrain.tracking.mlflow_run import tracking_uri

    spec = make_job(
        assets,
        tmp_path / "runs",
        name="ctrl-c",
        training={"max_steps": 400},
        checkpoint={"every_n_steps": 1000, "export_final": False},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain", "run", str(job_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_ADDRESS": ray_address},
    )
    output = []
    for line in proc.stdout:
        output.append(line)
        if "[raytrain] step 3/400" in line:
            proc.send_signal(signal.SIGINT)
            break
    output += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(output[-40:])
    stopped_at = int(latest_checkpoint(spec.run_dir).rsplit("_", 1)[1])
    assert 3 <= stopped_at < 400
    client = MlflowClient(tracking_uri(spec))
    [run] = client.search_runs(
        [client.get_experiment_by_name("tests").experiment_id], f"tags.`raytrain.run_dir` = '{spec.run_dir}'"
    )
    assert run.info.status == "KILLED"
    assert sorted(metric_history(spec, run.info.run_id)) == list(range(1, stopped_at + 1))
