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
    proc = subprocess.run([sys.executable, str(CHAOS), *args, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=1500)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHAOS-SUMMARY ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(lines[-1].removeprefix("CHAOS-SUMMARY "))
    assert proc.returncode == 0 and summary["problems"] == [], summary
    return summary


def test_shrink_to_one_worker_and_grow_back(tmp_path):
    summary = run_chaos(tmp_path, "resize", "--steps", "48")
    worlds = summary["worlds_per_step"]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2
    assert len(summary["failures"]) >= 2  # the node loss and the grow-back restart


def test_preemption_notice_commits_a_checkpoint_that_the_restart_uses(tmp_path):
    # Ray's drain notice (KubeRay's preStop runs `ray drain-node --reason PREEMPTION`) on the
    # node of rank 1: a checkpoint within a few steps, although none is due; the node is then
    # reclaimed, and the job resumes from that checkpoint with the uninterrupted run's losses.
    summary = run_chaos(tmp_path, "drain", "--steps", "20")
    [failure, *_] = summary["failures"]
    assert summary["noticed_after_step"] < summary["checkpoint_step"] == failure["resumed_from"]


def test_lineage_accounting_catches_duplicates_and_gaps(tmp_path):
    # The checker itself must be able to fail: a rolled-back step replaced by its re-run is
    # fine, a sample trained twice or a step with a short batch is not.
    def write(rank, attempt, step, samples, world=1):
        with open(tmp_path / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "world": world, "rank": rank, "step": step, "samples": samples}) + "\n")

    write(0, "1.0-1", 1, [[0, 0], [0, 1]])
    write(0, "1.0-1", 2, [[0, 2], [0, 3]])
    write(0, "2.0-1", 2, [[0, 2], [0, 3]])  # step 2 re-run after a restart: the later attempt counts
    reference = {1: {"samples": [(0, 0), (0, 1)]}, 2: {"samples": [(0, 3), (0, 2)]}}
    assert compare(reference, final_lineage(tmp_path), global_batch=2) == []
    write(0, "3.0-1", 2, [[0, 1], [0, 3]])  # a later re-run that repeats sample (0, 1)
    problems = compare(reference, final_lineage(tmp_path), global_batch=2)
    assert any("twice" in p for p in problems) and any("different samples" in p for p in problems)
