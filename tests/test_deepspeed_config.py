"""The DeepSpeed config a zero3 job generates, field by field, for a realistic GPU job
(Qwen2.5 7B full fine-tune on 8 GPUs, optimizer offloaded) and for the CPU test job; and the
rules for expert overrides in `training.deepspeed`. Pure: no process group, no Ray."""

from __future__ import annotations

import copy

import pytest
from conftest import REPO, make_job
from pydantic import ValidationError

from raytrain import cli
from raytrain.job import deepspeed_config as dsc
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec, load_yaml
from raytrain.validate import preflight

GPU_JOB = REPO / "jobs" / "qwen-7b-full-zero3.yaml"
QWEN_7B_HIDDEN = 3584  # Qwen/Qwen2.5-7B config.json hidden_size


def gpu_spec(**training) -> JobSpec:
    raw = load_yaml(GPU_JOB)
    raw["training"].update(training)
    return JobSpec.model_validate(raw)


@pytest.mark.parametrize("world", [8, 6, 5], ids=["8-gpus", "6-after-a-loss", "5-uneven"])
def test_deepspeed_reads_the_gpu_job_as_written_at_any_world_size(world):
    """What the user relies on, read back through DeepSpeed's own parser (unknown keys are errors
    there): each rank runs the micro-batches raytrain's loop feeds it, together they cover the
    global batch, and the job's optimizer, clipping, precision, offload and expert overrides are
    what DeepSpeed will use. No process group: DeepSpeed assumes one rank, so it gets the per-rank
    batch and the world size is checked on the arithmetic."""
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = gpu_spec()
    t, o = spec.training, spec.optimizer
    config = dsc.build(spec, world_size=world, hidden_size=QWEN_7B_HIDDEN)
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    assert micro == t.micro_batch_size and accumulation == RunPlan.of(spec).accumulation_steps(world)
    assert config["train_batch_size"] == micro * accumulation * world >= t.global_batch_size
    parsed = DeepSpeedConfig(dict(config, train_batch_size=micro * accumulation))
    assert parsed.gradient_accumulation_steps == accumulation and parsed.gradient_clipping == t.grad_clip
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params == {
        "lr": o.lr,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
    }
    assert parsed.scheduler_name is None  # raytrain sets the LR of every step itself
    assert parsed.bfloat16_config.enabled == (t.precision == "bf16") and parsed.grad_accum_dtype == "fp32"
    assert parsed.zero_optimization_stage == 3
    assert (parsed.zero_config.offload_optimizer is not None) == t.offload.optimizer
    assert (parsed.zero_config.offload_param is not None) == t.offload.params
    for key, value in t.deepspeed["zero_optimization"].items():  # the job's expert overrides won
        assert parsed.zero_config.model_dump(by_alias=True)[key] == value, key


def test_cpu_test_job_config(tmp_path):
    """The parity job: fp32 on CPU, torch AdamW passed in (no optimizer block), no overlap stream."""
    spec = make_job(REPO, tmp_path, training={"strategy": "zero3", "finetune": "full", "grad_clip": None})
    config = dsc.build(spec, world_size=2, hidden_size=64)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (8, 2, 2)
    assert config["gradient_clipping"] == 0.0  # grad_clip: null disables clipping
    assert (
        config["bf16"] == {"enabled": False} and "data_types" not in config and "communication_data_type" not in config
    )
    assert dsc.uses_client_optimizer(config)
    assert config["zero_optimization"]["overlap_comm"] is False
    # hidden 64: the hidden^2 rule would give 4096-element buckets; the 4M floor applies.
    assert config["zero_optimization"]["reduce_bucket_size"] == 4_194_304
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 3_774_873
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    # Elastic: accumulation follows the world size, the global batch does not.
    assert dsc.build(spec, world_size=1, hidden_size=64)["gradient_accumulation_steps"] == 4
    # 3 workers: slices of 3, 3 and 2 rows, 2 micro-batches each; DeepSpeed's own arithmetic must still hold.
    uneven = dsc.build(spec, world_size=3, hidden_size=64)
    assert (uneven["train_batch_size"], uneven["gradient_accumulation_steps"]) == (12, 2)


def test_offload_on_cpu_keeps_torch_adamw(tmp_path):
    spec = make_job(REPO, tmp_path, training={"strategy": "zero3", "offload": {"optimizer": True, "params": True}})
    config = dsc.build(spec, world_size=2, hidden_size=64)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert "optimizer" not in config and config["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize(
    "override, fragment",
    [
        ({"train_batch_size": 256}, "train_batch_size: set by raytrain from training.global_batch_size"),
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps: set by raytrain"),
        ({"optimizer": {"type": "Adam"}}, "optimizer: set by raytrain from the optimizer section"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler: set by raytrain from optimizer.schedule"),
        ({"bf16": {"enabled": False}}, "bf16: set by raytrain from training.precision"),
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage: set by raytrain from training.strategy"),
        (
            {"zero_optimization": {"reduce_bucket_size": "auto"}},
            'zero_optimization.reduce_bucket_size: "auto" is a Hugging Face',
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "cpu"}}},
            "offload is off; set training.offload.params: true",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "none"}}},
            "use cpu or nvme; to turn offload off set training.offload.optimizer: false",
        ),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "device nvme needs nvme_path"),
    ],
)
def test_bad_overrides_are_rejected_naming_the_fix(override, fragment):
    # The job spec refuses it (so `raytrain validate` does, before anything starts)...
    with pytest.raises(ValidationError) as info:
        gpu_spec(deepspeed=override)
    assert fragment in str(info.value)
    # ...and build() refuses it too, for a spec that skipped validation.
    valid = gpu_spec()
    unchecked = valid.model_copy(update={"training": valid.training.model_copy(update={"deepspeed": override})})
    assert any(fragment in p for p in dsc.override_problems(unchecked))
    with pytest.raises(ValueError, match="training.deepspeed"):
        dsc.build(unchecked, world_size=8, hidden_size=QWEN_7B_HIDDEN)


def test_good_overrides_merge_deeply():
    spec = gpu_spec(
        deepspeed={
            "zero_optimization": {
                "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                "reduce_bucket_size": 50_000_000,
            },
            "communication_data_type": "bf16",
        }
    )
    assert dsc.override_problems(spec) == []
    config = dsc.build(spec, world_size=8, hidden_size=QWEN_7B_HIDDEN)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    assert zero["reduce_bucket_size"] == 50_000_000 and zero["stage"] == 3 and zero["overlap_comm"] is True
    assert config["communication_data_type"] == "bf16"


def test_merge_does_not_mutate_inputs():
    base, over = {"a": {"b": 1, "c": [1]}}, {"a": {"b": 2}}
    before = copy.deepcopy(base)
    assert dsc.merge(base, over) == {"a": {"b": 2, "c": [1]}} and base == before


def test_gpu_job_validates_and_a_bad_override_fails_validate(tmp_path, capsys):
    assert cli.main(["validate", str(GPU_JOB), "--skip-probes"]) == cli.EXIT_OK
    assert (
        cli.main(["validate", str(GPU_JOB), "--skip-probes", "--set", "training.deepspeed.gradient_clipping=0.5"])
        == cli.EXIT_INVALID
    )
    assert "set by raytrain from training.grad_clip" in capsys.readouterr().err
    # The block is zero3's only: under fsdp2 it is an error too.
    _, problems = preflight.check_job(str(GPU_JOB), ["training.strategy=fsdp2"], probes=False)
    assert any("only used by strategy zero3" in p.message for p in problems)


def test_toolchain_check_names_what_to_install():
    from raytrain.strategies.zero3 import toolchain_problems

    assert toolchain_problems({"PATH": "/nonexistent", "CXX": "c++"})[0].startswith(
        "a C++ compiler (`c++` not found): apt-get install g++"
    )


def test_a_failed_op_build_is_a_job_error_naming_the_compiler(tmp_path):
    """A real JIT build of deepspeed_shm_comm with no usable compiler (CXX points nowhere, empty
    extension cache), in a 1-process gloo group: the worker's error says what to install."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, torch.distributed as dist\n"
        "from raytrain.errors import JobError\n"
        "from raytrain.strategies.zero3 import init_deepspeed_comm\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/pg', rank=0, world_size=1)\n"
        "try:\n    init_deepspeed_comm()\n"
        "except JobError as exc:\n    print('JOBERROR', exc)\n"
    )
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-c++"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO),
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300).stdout
    [line] = [ln for ln in out.splitlines() if ln.startswith("JOBERROR")]
    assert "deepspeed_shm_comm" in line and "the build failed; missing: a C++ compiler" in line
    assert "apt-get install g++" in line and str(tmp_path / "ext") in line
