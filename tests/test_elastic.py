"""Elasticity and chaos, through the chaos script kept in the repo (each mode needs a Ray
cluster of its own shape, so it runs in a subprocess): every sample trained on exactly
once, a constant global batch, and the losses of an uninterrupted run. Random kills
(`chaos.py kill`, `soak`) are for soak runs by hand: a killed worker's resume is
tests/test_fault_tolerance.py's, at fixed kill points, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from chaos import compare, final_lineage

pytestmark = pytest.mark.slow
CHAOS = Path(__file__).with_name("chaos.py")


def run_chaos(tmp_path, *args) -> dict:
    proc = subprocess.run(
        [sys.executable, str(CHAOS), *args, "--out", str(tmp_path)], capture_output=True, text=True, timeout=1500
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHAOS-SUMMARY ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(lines[-1].removeprefix("CHAOS-SUMMARY "))
    assert proc.returncode == 0 and summary["problems"] == [], summary
    return summary


def test_a_spot_node_noticed_reclaimed_and_replaced(tmp_path):
    # 4 ranks on 2 nodes of 2, each node one sequence-parallel pair (sp=2), HSDP across the nodes
    # (replicate 2 x shard 2, the shard dimension being the pair). Ray's drain notice (KubeRay's
    # preStop runs `ray drain-node --reason PREEMPTION`) on the second node: a checkpoint within a
    # few steps, although none is due; the node is then reclaimed (the job resumes from that
    # checkpoint on one node: sp=2 x dp=1) and replaced (it grows back to dp=2): only the
    # data-parallel dimension resizes. Every sample once, a constant global batch and the
    # uninterrupted 4-rank run's losses. The 16-rank rehearsal is --nodes 4 --per-node 4 (--sp 1).
    summary = run_chaos(tmp_path, "spot", "--steps", "30", "--nodes", "2", "--per-node", "2", "--sp", "2")
    worlds = summary["worlds_per_step"]
    assert worlds[0] == 4 and 2 in worlds and worlds[-1] == 4
    [preemption, *others] = summary["failures"]
    assert summary["noticed_after_step"] < summary["checkpoint_step"] == preemption["resumed_from"]
    assert preemption["kind"] == "preemption" and any(f["kind"] == "resize" for f in others)


def test_lineage_accounting_catches_duplicates_and_gaps(tmp_path):
    # The checker itself must be able to fail: a rolled-back step replaced by its re-run is
    # fine, a sample trained twice or a step with a short batch is not.
    def write(rank, attempt, step, samples, world=1):
        with open(tmp_path / f"rank{rank}.jsonl", "a") as f:
            f.write(
                json.dumps({"attempt": attempt, "world": world, "rank": rank, "step": step, "samples": samples}) + "\n"
            )

    write(0, "1.0-1", 1, [[0, 0], [0, 1]])
    write(0, "1.0-1", 2, [[0, 2], [0, 3]])
    write(0, "2.0-1", 2, [[0, 2], [0, 3]])  # step 2 re-run after a restart: the later attempt counts
    reference = {1: {"samples": [(0, 0), (0, 1)]}, 2: {"samples": [(0, 3), (0, 2)]}}
    assert compare(reference, final_lineage(tmp_path), global_batch=2) == []
    write(0, "3.0-1", 2, [[0, 1], [0, 3]])  # a later re-run that repeats sample (0, 1)
    problems = compare(reference, final_lineage(tmp_path), global_batch=2)
    assert any("twice" in p for p in problems) and any("different samples" in p for p in problems)


def test_an_elastic_restart_waits_briefly_for_the_old_size_and_the_submitters_setting_wins(
    assets, tmp_path, monkeypatch
):
    # The policy behind chaos.py spot's reclaim: Ray counts a draining node's resources as ready,
    # so an elastic restart must not wait Ray's full 60 s for a group of the old size.
    from conftest import make_job

    from raytrain.driver import worker_env

    elastic = make_job(assets, tmp_path, scaling={"num_workers": None, "min_workers": 1, "max_workers": 2})
    fixed = make_job(assets, tmp_path)
    assert worker_env.controller_env(elastic)[worker_env.START_TIMEOUT_ENV] == "15"
    assert worker_env.controller_env(fixed) == {worker_env.HEALTH_CHECK_ENV: "0.5", worker_env.START_TIMEOUT_ENV: "60"}
    monkeypatch.setitem(worker_env._SUBMITTERS, worker_env.START_TIMEOUT_ENV, "120")
    assert worker_env.controller_env(elastic)[worker_env.START_TIMEOUT_ENV] == "120"
