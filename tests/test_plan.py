"""The run plan: the driver's decisions, one rule each, signed for its run directory."""

from __future__ import annotations

import pytest

from conftest import make_job
from raytrain.errors import JobError
from raytrain.plan import RunPlan


def test_the_plan_resolves_each_rule_once(assets, tmp_path):
    gpu = make_job(assets, tmp_path, scaling={"num_workers": 16, "use_gpu": True, "workers_per_node": 8},
                   training={"finetune": "full", "global_batch_size": 36, "micro_batch_size": 2})
    plan = RunPlan.of(gpu)
    assert plan.bf16 and plan.hsdp and plan.sync_every_micro_batch  # auto: bf16 and HSDP on GPU; full FSDP2 syncs
    assert plan.mesh_shape(16) == (2, 8) and plan.mesh_shape(8) == (8,)  # one node: a flat mesh
    assert plan.shard_degree(16) == 8 and plan.accumulation_steps(16) == 2 and plan.accumulation_steps(5) == 4
    cpu = RunPlan.of(make_job(assets, tmp_path, scaling={"num_workers": 4, "workers_per_node": 2}))
    assert not cpu.bf16 and not cpu.hsdp and cpu.mesh_shape(4) == (4,) and not cpu.sync_every_micro_batch  # LoRA
    zero3 = RunPlan.of(make_job(assets, tmp_path, training={"strategy": "zero3"},
                                scaling={"num_workers": 4, "workers_per_node": 2, "use_gpu": True}))
    assert not zero3.hsdp and zero3.shard_degree(4) == 4  # auto HSDP is FSDP2's


def test_workers_refuse_a_plan_changed_or_made_for_another_run(assets, tmp_path):
    spec = make_job(assets, tmp_path)
    stores = {"train": ["/data/a"], "weights": [1.0], "eval": None, "key": "k"}
    doc = RunPlan.of(spec, stores).signed(spec.run_dir)
    assert RunPlan.verified(doc, spec.run_dir) == RunPlan.of(spec, stores)
    with pytest.raises(JobError, match="refusing the run plan .*: its signature is wrong"):
        RunPlan.verified({**doc, "bf16": True}, spec.run_dir)
    other = make_job(assets, tmp_path, name="other")
    with pytest.raises(JobError, match="refusing the run plan .*: it is signed for run_dir"):
        RunPlan.verified(doc, other.run_dir)
