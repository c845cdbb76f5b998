"""The DeepSpeed config of a `zero3` job: generated from the job spec, with the job's optional
`training.deepspeed` block merged over it and checked.

Every value is concrete: no `"auto"` (that is a Hugging Face Trainer convention, resolved by
the Trainer, not by DeepSpeed), so the config a worker hands to `deepspeed.initialize` is the
config a test can read field by field. The fields that mean something the job already says
(batch sizes, accumulation, clipping, precision, optimizer, schedule, offload on/off) are
owned by the job spec: an override may not contradict them, it must change the YAML field.

Pure Python, no torch or deepspeed import: `raytrain validate` checks an override on the
driver in milliseconds, before any cluster exists.
"""

from __future__ import annotations

import copy
from typing import Any

from raytrain.job.deepspeed_overrides import auto_paths, override_problems
from raytrain.job.plan import RunPlan

MIN_BUCKET = 1 << 22  # elements; see generate()


def generate(spec, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The config raytrain derives from the job, before expert overrides.

    Bucket sizes follow the Hugging Face integration's rule for its "auto" values
    (hidden^2 for reduce, 0.9 hidden^2 for prefetch, 10 hidden for parameters kept whole),
    computed here so the config is explicit, with a floor of 4M elements: below hidden 2048
    the rule makes buckets so small that per-collective latency dominates (hidden 64 on
    gloo: 0.56 s a step against 0.12 s with the floor, same losses).
    """
    t, o, gpu, plan = spec.training, spec.optimizer, spec.scaling.use_gpu, RunPlan.of(spec)
    bf16 = plan.bf16
    bucket = max(hidden_size * hidden_size, MIN_BUCKET)
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": gpu,  # a side stream for comms exists on GPU only
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "sub_group_size": 1_000_000_000,
        # Exports gather parameters themselves (GatheredParameters), not at every checkpoint.
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if t.offload.optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": gpu}
    if t.offload.params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": gpu}
    config: dict[str, Any] = {
        # DeepSpeed's own bookkeeping wants micro x accumulation x world; raytrain feeds ceil(G/N)
        # rows a rank at most (padding rows where a slice is short) and scales the loss itself.
        "train_batch_size": t.micro_batch_size * plan.accumulation_steps(world_size) * world_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps(world_size),
        "gradient_clipping": float(t.grad_clip) if t.grad_clip else 0.0,  # host: a config value; 0 disables clipping
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # raytrain logs steps; DeepSpeed's own progress lines are noise
        "wall_clock_breakdown": False,
    }
    if bf16:
        # bf16 compute, fp32 master weights (DeepSpeed's bf16 mode), and gradients reduced and
        # accumulated in fp32: what FSDP2's MixedPrecisionPolicy(reduce_dtype=float32) does.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    if t.offload.optimizer and gpu:
        # Offloaded optimizer steps run on the CPU: DeepSpeedCPUAdam (AdamW mode), not torch AdamW.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        }
    elif t.offload.optimizer:
        # On a CPU-only machine "offload to CPU" moves nothing; keep torch AdamW (the same math as
        # FSDP2/DDP, and no cpu_adam build) and tell DeepSpeed that is deliberate.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def uses_client_optimizer(config: dict) -> bool:
    """True when the strategy passes torch AdamW (no `optimizer` block in the config)."""
    return "optimizer" not in config


def build(spec, world_size: int, hidden_size: int) -> dict[str, Any]:
    """The final config: generated, overrides merged, validated. Raises ValueError on a bad override."""
    problems = override_problems(spec)
    if problems:
        raise ValueError("; ".join(problems))
    config = merge(generate(spec, world_size, hidden_size), spec.training.deepspeed or {})
    left = auto_paths(config)
    if left:  # cannot happen from generate(); a guard so "no auto" is a property, not a hope
        raise ValueError(f'DeepSpeed config still has "auto" at {left}')
    return config


def merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else in `over` replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
