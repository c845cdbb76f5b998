"""Whole jobs under 2-D and 3-D meshes, through the launcher: a checkpoint written under one mesh
resumes under any other, and the export is the same model whatever mesh wrote it.

One job (full fine-tuning, 4 CPU workers, a checkpoint every 2 steps), two runs:
  A  sp=2 under HSDP: 2 nodes of 2 workers, each node one sequence-parallel pair, replicated
     across the nodes (FSDP2's mesh replicate 2 x shard 2, the shard dimension being the pair)
  C  A's run directory from its step-4 checkpoint, continued under tp=2 x dp=2
C's steps 5-8 against A's are the parity and the resume across meshes in one: a mesh whose
gradients were reduced wrongly, or a checkpoint resharded wrongly, parts from A at once. (A fourth
run, C's tp checkpoint continued flat, was cut for CI time: it is DCP's resharding again, in the
other direction; so was B, A with a rank killed at step 5 equal to A bit for bit: a restart of an
sp x HSDP group from its checkpoint is test_elastic.py's spot run, and a kill's resume is
test_fault_tolerance.py's.) The in-process parity of every mesh (SFT and DPO, packed and not) is
tests/test_mesh.py's.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_job, metric_history, without_checkpoint
from torch.distributed.checkpoint import FileSystemReader

from raytrain.driver import launcher
from raytrain.train.export import latest_checkpoint

pytestmark = pytest.mark.slow
STEPS, EVERY = 8, 2
REL_TOL = 1e-5  # another mesh reduces in another order: fp32 rounding, not bit equality
SP_HSDP = {"workers_per_node": 2, "hsdp": True, "sequence_parallel": 2}
TP = {"tensor_parallel": 2}
PROBE = torch.tensor([[5, 17, 42, 9, 33, 120, 7, 64, 1, 200, 88, 13]])


def job(assets, storage, name="meshes", **scaling):
    return make_job(
        assets,
        storage,
        name=name,
        training={"finetune": "full", "max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 1},
        scaling={"num_workers": 4, **scaling},
        failure={"max_failures": 1},
        checkpoint={"every_n_steps": EVERY, "keep_last": 4},
        optimizer={"lr": 3e-3, "schedule": "constant"},
    )


def chunks_of(step_dir: str, key: str = "model.model.layers.0.mlp.up_proj.weight") -> int:
    return len(FileSystemReader(step_dir).read_metadata().state_dict_metadata[key].chunks)


def logits_of(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(folder)).eval()(input_ids=PROBE).logits


def worst(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) / a[s] for s in steps)


def test_meshes_resume_each_others_checkpoints(ray_address, assets, tmp_path):
    a_spec = job(assets, tmp_path / "a", **SP_HSDP)
    a = metric_history(a_spec, launcher.run(a_spec).run_id)
    assert sorted(a) == list(range(1, STEPS + 1)) and a[STEPS] < a[1]  # it trained
    assert chunks_of(latest_checkpoint(a_spec.run_dir)) == 2  # one replica's 2 shards (the sp pair)
    a_logits = logits_of(f"{a_spec.run_dir}/final_model")

    with without_checkpoint(a_spec.run_dir, 8) as storage:  # A's run directory from step 4
        shutil.rmtree(f"{a_spec.run_dir}/step_00000006")
        c_spec = job(assets, storage, **TP)
        c = metric_history(c_spec, launcher.run(c_spec).run_id)
        assert chunks_of(latest_checkpoint(c_spec.run_dir)) == 4  # split by tp, then sharded over dp
        c_logits = logits_of(f"{c_spec.run_dir}/final_model")

    print(
        f"\n[meshes] max relative loss difference from A (sp=2, HSDP): C (tp=2 x dp=2, from A's step 4) "
        f"{worst(a, c, range(5, 9)):.1e}"
    )
    assert set(range(5, STEPS + 1)) <= set(c)  # it trained its steps
    assert worst(a, c, range(5, 9)) <= REL_TOL
    # The exports (written under sp x HSDP and tp x dp) are the same model within fp32 rounding.
    torch.testing.assert_close(c_logits, a_logits, rtol=1e-4, atol=1e-4)
