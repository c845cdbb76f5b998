"""What a job's `training.deepspeed` block may say: the fields raytrain owns (an override of one is
refused naming the YAML field that sets it), "auto" placeholders, and the offload blocks that only
tune what `training.offload` turns on. Pure: spec.py validates a job with it, and the DeepSpeed
config builder (deepspeed_config.py) merges only a block that passed it.
"""

from __future__ import annotations

OFFLOAD = {"offload_optimizer": "training.offload.optimizer", "offload_param": "training.offload.params"}

# Override path -> the job field that owns it. An override of these is an error naming the field,
# because a second source of truth for, e.g., the batch size would silently break resume and parity.
OWNED = {
    "train_batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size (accumulation = global / (micro x workers))",
    "gradient_clipping": "training.grad_clip",
    "optimizer": "the optimizer section (lr, betas, eps, weight_decay)",
    "scheduler": "optimizer.schedule / optimizer.warmup_steps (raytrain sets the LR every step)",
    "bf16": "training.precision",
    "fp16": "training.precision (fp16 is not offered: bf16 or fp32)",
    "amp": "training.precision",
    "data_types": "training.precision (gradients accumulate in fp32)",
    "zero_optimization.stage": "training.strategy (zero3 is stage 3; use fsdp2/ddp for other layouts)",
    "checkpoint": "nothing: raytrain chooses how checkpoints are loaded",
    "managed_gradient_accumulation": "nothing: the training loop owns accumulation",
}


def override_problems(spec) -> list[str]:
    """What is wrong with `training.deepspeed`, as messages naming the path and the fix."""
    block = spec.training.deepspeed
    if block is None:
        return []
    problems = [
        f'training.deepspeed.{path}: "auto" is a Hugging Face Trainer placeholder; give a value '
        f"(raytrain computes every field it owns)"
        for path in auto_paths(block)
    ]
    flat = dict(leaves(block))
    for owned, field in OWNED.items():
        if any(p == owned or p.startswith(owned + ".") for p in flat):
            problems.append(f"training.deepspeed.{owned}: set by raytrain from {field}; change that instead")
    zero = block.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return problems + ["training.deepspeed.zero_optimization: must be a mapping of ZeRO settings"]
    for key, field in OFFLOAD.items():
        if key not in zero:
            continue
        section = zero[key]
        enabled = getattr(spec.training.offload, field.rsplit(".", 1)[1])
        if not isinstance(section, dict):
            problems.append(f"training.deepspeed.zero_optimization.{key}: must be a mapping (device, pin_memory, ...)")
        elif not enabled:
            problems.append(
                f"training.deepspeed.zero_optimization.{key}: offload is off; set {field}: true "
                f"(this block only tunes it)"
            )
        elif section.get("device", "cpu") not in ("cpu", "nvme"):
            problems.append(
                f"training.deepspeed.zero_optimization.{key}.device = {section['device']!r}: use cpu or "
                f"nvme; to turn offload off set {field}: false"
            )
        elif section.get("device") == "nvme" and not section.get("nvme_path"):
            problems.append(
                f"training.deepspeed.zero_optimization.{key}: device nvme needs nvme_path (a local NVMe folder)"
            )
    return problems


def leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from leaves(value, path + ".")


def auto_paths(tree: dict) -> list[str]:
    return [p for p, v in leaves(tree) if isinstance(v, str) and v.strip().lower() == "auto"]
