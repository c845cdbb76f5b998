"""The spine, end to end on a real local Ray cluster with 2 gloo workers: the quickstart
path (LoRA + FSDP2); checkpoints, export, MLflow, a tampered checkpoint refused at restore.
(Full fine-tuning on the user formats, chat among them, is test_store.py's blend; each strategy's
full export, test_strategies.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Planted, file_hashes, make_job, metric_history, warm_forkserver

from raytrain.driver import launcher
from raytrain.train.export import export_checkpoint, latest_checkpoint

pytestmark = pytest.mark.slow
PROBE = torch.tensor([[5, 17, 42, 9, 33, 120, 7, 64, 1, 200, 88, 13]])


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def test_lora_fsdp2_trains_checkpoints_exports_and_tracks(ray_address, assets, tmp_path):
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain.tracking.mlflow_run import tracking_uri

    spec = make_job(assets, tmp_path / "runs", training={"max_steps": 20}, optimizer={"lr": 1e-2})
    warm_forkserver(spec)  # the node's fork server is up (a job's first workers start as Ray starts them)
    result = launcher.run(spec)

    # Loss falls on learnable data, and MLflow has every step of it in one finished run.
    losses = metric_history(spec, result.run_id)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 0.3, losses
    run = MlflowClient(tracking_uri(spec)).get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.strategy"] == "fsdp2" and run.data.params["training.lora.rank"] == "4"
    # The export is pointed to, not uploaded a second time (tracking.log_model is off by default).
    assert run.data.tags["raytrain.final_model"] == spec.run_dir + "/final_model"
    assert not MlflowClient(tracking_uri(spec)).list_artifacts(result.run_id)
    # Where a worker's host memory went, phase by phase (the busiest rank's): loading the model takes
    # some, and the peak never falls.
    memory = {
        p: metric_history(spec, result.run_id, f"startup/host_peak_mb/{p}")[1]
        for p in ("workers", "loaded", "model", "restored", "data", "step_1", "steps")
    }
    assert 0 < memory["workers"] < memory["model"] and list(memory.values()) == sorted(memory.values()), memory
    # CPU workers run mimalloc (allocator.py): their own mappings say so, not just the variable asked for.
    # Forked from the node's warm server (train/forkserver.py), they keep the allocator of their launchers.
    assert run.data.tags["raytrain.host_allocator"] == "mimalloc"
    assert run.data.tags["raytrain.worker_start"] == "forked"
    # What ran the step: on CPU workers sdpa with masks (torch's varlen kernel is a GPU's), blocks not
    # compiled (training.compile auto is a GPU's), and LoRA's frozen output layer whole on each worker:
    # split by rows over the two it would cost this tiny model more than it saves (plan.splits_vocabulary).
    # sdpa as `model.attn_implementation: auto` chose it from the class's flags, named with why.
    assert (
        run.data.tags["raytrain.kernels"] == "attention sdpa (auto: LlamaForCausalLM supports sdpa), loss "
        "cross-entropy, blocks eager"
    )
    # What trains, per group, as peft built it (model/targets.py's audit)
    trains = run.data.tags["raytrain.adapters"]
    assert trains.startswith("attention LoRA k_proj r=4, o_proj r=4, q_proj r=4, v_proj r=4"), trains

    # Sharded checkpoints from both ranks; keep_last prunes older ones.
    run_dir = Path(spec.run_dir)
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00000015", "step_00000020"]
    last = Path(latest_checkpoint(spec.run_dir))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.json"} <= {p.name for p in last.iterdir()}

    # The export loads with plain transformers + peft, and equals the checkpoint loaded back.
    base = AutoModelForCausalLM.from_pretrained(spec.model.path)
    exported = PeftModel.from_pretrained(base, str(run_dir / "final_model")).eval()
    export_checkpoint(spec.run_dir, str(tmp_path / "from_ckpt"))
    from_ckpt = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(spec.model.path), str(tmp_path / "from_ckpt")
    ).eval()
    torch.testing.assert_close(logits_of(exported), logits_of(from_ckpt), rtol=0, atol=1e-6)
    # Training moved the adapter away from its (zero-effect) init...
    assert not torch.allclose(logits_of(exported), logits_of(AutoModelForCausalLM.from_pretrained(spec.model.path)))
    # ...and names the exact base it needs: the sha256 of each of its weight files.
    import json

    assert json.loads((run_dir / "final_model" / "raytrain.json").read_text())["base_files"] == file_hashes(
        Path(spec.model.path)
    )

    # A forged pickle put in its last checkpoint (the file torch.load would read first) and the job
    # continued: its restore refuses it by name, in one message, before anything is unpickled. Once,
    # here at the job's level; zero3's files go through the same verifying fetch (signing.SignedCheckpoint),
    # and test_strategies.py's export refuses every tampering there for fsdp2's and zero3's layouts.
    import pickle

    from raytrain.errors import JobError

    side_effect = tmp_path / "pwned"
    (last / ".metadata").write_bytes(pickle.dumps(Planted(side_effect)))
    with pytest.raises(JobError, match=r"\.metadata was changed after it was written.*Nothing in it was loaded"):
        launcher.run(make_job(assets, tmp_path / "runs", training={"max_steps": 21}, optimizer={"lr": 1e-2}))
    assert not side_effect.exists()


def test_quickstart_runs_from_any_folder_and_its_driver_never_maps_torch(ray_address, tmp_path):
    # It used to look for jobs/quickstart.yaml in the working directory. Its driver (this process's
    # child) runs with no libtorch mapped the whole time: torch is only in the workers.
    import os
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain", "quickstart", "--set", "training.max_steps=4"]
        + ["--set", "checkpoint.export_final=false"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_ADDRESS": ray_address},
    )
    looks, torch_mapped = 0, []
    while proc.poll() is None:
        try:
            maps = open(f"/proc/{proc.pid}/maps").read()
        except OSError:  # it just ended
            break
        looks += 1
        torch_mapped += [line.split()[-1] for line in maps.splitlines() if "libtorch" in line][:1]
        time.sleep(0.2)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert looks > 20 and not torch_mapped, (looks, torch_mapped)
    assert latest_checkpoint(str(tmp_path / "runs" / "quickstart")).endswith("step_00000004")
    lines = out.splitlines()
    assert "eval_loss" in lines[-1]  # the quickstart shows its held-out loss
    steps = [line for line in lines if line.startswith("[raytrain] step ")]  # rank 0's, as the driver's own
    assert len(steps) == 4 and not [line for line in lines if "RayTrainWorker pid=" in line], lines


def test_a_new_mlflow_store_is_a_copy_of_a_migrated_template_and_an_existing_store_is_kept(
    assets, tmp_path, monkeypatch
):
    # A new sqlite store skips MLflow's schema migrations by starting as a copy of an empty one;
    # the copy must be at the schema MLflow itself makes, and a store that exists is never replaced.
    import sqlite3

    from mlflow.tracking import MlflowClient

    from raytrain.tracking import mlflow_run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = make_job(assets, tmp_path / "a", name="first")
    run_id = mlflow_run.start_run(first)  # makes the template, then this store from it
    [template] = (tmp_path / "cache" / "raytrain").glob("mlflow-*.db")
    MlflowClient(f"sqlite:///{tmp_path / 'own.db'}").search_experiments()  # a store MLflow migrates itself

    def query(db, sql):
        with sqlite3.connect(db) as conn:
            return conn.execute(sql).fetchall()

    copy = tmp_path / "a" / "mlflow.db"
    assert query(copy, "SELECT version_num FROM alembic_version") == query(
        tmp_path / "own.db", "SELECT version_num FROM alembic_version"
    )
    assert query(copy, "SELECT artifact_location FROM experiments WHERE experiment_id = 0") == [
        (f"{tmp_path / 'a'}/mlartifacts/0",)
    ]
    made = template.stat().st_mtime_ns
    second = make_job(assets, tmp_path / "b", name="second")
    assert mlflow_run.start_run(second) != run_id and template.stat().st_mtime_ns == made  # made once
    assert mlflow_run.start_run(first) == run_id  # the unfinished run continues: its store was kept
    # A cache that cannot be written (here a file where the folder should be) costs the migrations, not the job.
    monkeypatch.setenv("XDG_CACHE_HOME", str(template))
    third = make_job(assets, tmp_path / "c", name="third")
    assert mlflow_run.start_run(third) and query(
        tmp_path / "c" / "mlflow.db", "SELECT version_num FROM alembic_version"
    )
