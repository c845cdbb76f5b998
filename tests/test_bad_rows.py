"""Bad rows during a real run on 2 Ray workers, under both policies of `data.bad_rows`:
`skip` counts exactly the bad rows the prepare step left out of the token store (MLflow's
`bad_rows` metric and the final summary line); `fail` stops the job with one line naming
the file and the row, and no traceback from inside a Ray task or worker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import metric_history

from raytrain.job.spec import JobSpec

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
GOOD = [
    {"text": f"the {c} fox jumps over the {p}."}
    for c in ("red", "green", "blue", "black")
    for p in ("fence", "river", "hill", "road", "wall", "field", "gate", "wood", "barn", "pond")
]  # 40 rows
BAD = {  # row number (1-based, as the run numbers them) -> the raw line
    3: "",  # empty line
    9: json.dumps({"text": 5}),  # wrong type
    14: json.dumps({"text": "   "}),  # empty text
    20: "{not json",
    27: json.dumps(["a", "list"]),  # not an object
    33: json.dumps({"text": " ".join(["fox"] * 400)}),  # over-long: more tokens than data.seq_len (pack: false)
}


def dataset(tmp_path: Path, bad: dict[int, str]) -> Path:
    good = iter(GOOD)
    rows = [bad[n] if n in bad else json.dumps(next(good)) for n in range(1, len(GOOD) + len(bad) + 1)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def job_file(assets: Path, tmp_path: Path, policy: str, bad: dict[int, str]) -> Path:
    job = {
        "name": f"bad-rows-{policy}",
        "model": {"path": str(assets / "model")},
        # pack: false and no shuffle: one good row is one training row, so 5 steps of 8 are exactly one epoch.
        "data": {
            "path": str(dataset(tmp_path, bad)),
            "seq_len": 48,
            "pack": False,
            "shuffle": False,
            "bad_rows": policy,
        },
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 5, "lora": {"rank": 4, "alpha": 8}},
        "optimizer": {"lr": 1e-3},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs"), "every_n_steps": 5, "export_final": False},
        "tracking": {"experiment": "bad-rows"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cli(job: Path, ray_address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytrain", "run", str(job)],
        cwd=job.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_ADDRESS": ray_address},
    )


def test_skip_counts_every_bad_row_in_mlflow_and_the_summary(ray_address, assets, tmp_path):
    job = job_file(assets, tmp_path, "skip", BAD)
    proc = run_cli(job, ray_address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "step 5 " in summary and f"bad rows skipped {len(BAD)};" in summary, summary
    run_id = re.search(r"mlflow run (\w+)", summary).group(1)
    spec = JobSpec.model_validate(yaml.safe_load(job.read_text()))
    counts = metric_history(spec, run_id, "bad_rows")
    assert sorted(counts) == [1, 2, 3, 4, 5] and counts[5] == len(BAD), counts


def test_fail_stops_with_file_and_row_and_no_traceback(ray_address, assets, tmp_path):
    # Beyond the first rows that pre-flight reads (it would refuse the job with exit 2): the run meets it.
    job = job_file(assets, tmp_path, "fail", {30: json.dumps({"text": 5})})
    proc = run_cli(job, ray_address)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failures = [ln for ln in proc.stderr.splitlines() if ln.startswith("raytrain: job bad-rows-fail failed:")]
    assert len(failures) == 1, proc.stderr[-3000:]
    assert f"{tmp_path / 'rows.jsonl'} row 30: column 'text' must be a string, got int" in failures[0]
    assert "Traceback" not in proc.stdout + proc.stderr
