"""Which attention and which expert kernels a job's model runs: pure functions of what the model's class
declares, the workers' device type and the compute dtype, so `validate` (from the class's source,
torch-free) and each worker (from the class itself) decide alike, before anything starts.

Attention. raytrain runs three implementations through its own packed-row boundaries (masks.py,
model/attention.py): eager, sdpa and flash_attention_2. A class says which it runs in flags transformers
keeps on it (`_supports_sdpa`, `_supports_flash_attn`, and `_compatible_flash_implementations` where only
some flash kernels take its attention, as gpt-oss's sinks take only hub kernels). `auto` is the fastest
the class runs on the workers: sdpa where the class supports it (on CUDA in 16 bits raytrain runs sdpa
on torch's varlen flash kernel, model/kernels.py: flash's speed with no extra package); else
flash_attention_2 on CUDA in 16 bits where the class takes that kernel; else eager, which every class
runs (gpt-oss's sinks on CPU: eager, with raytrain's masks). transformers given none falls back to eager
silently; here the choice is named (the start-up line, the `raytrain.kernels` tag). An explicit choice
the class cannot run is refused by validate, naming the class and what it supports.

Experts. transformers 5 computes a mixture-of-experts layer by `experts_implementation`: `eager` (a
Python loop over the experts a batch hits, a matmul each: E small kernels a projection a layer),
`batched_mm` (each routed token's expert weights gathered: a copy of an expert's weights per token, so
k x tokens x hidden x inter bytes a projection) or `grouped_mm` (tokens sorted by expert, one grouped
GEMM a projection). raytrain passes grouped_mm on purpose rather than take transformers' default: torch
2.13 has the kernel on CUDA (sm80+) and on CPU, transformers falls back to its own loop where it cannot
run (a compiled fp32 block). All three give the same losses to fp32's rounding, with LoRA's
parametrization of the experts too (tests/test_moe.py). Not timed against eager on CPU here.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
RAYTRAIN_RUNS = ("eager", "sdpa", "flash_attention_2")  # through raytrain's boundaries (masks.IMPLEMENTATIONS)
EXPERTS = "grouped_mm"


@dataclass(frozen=True)
class AttentionFlags:
    """What a model class declares of its attention (private_apis.attention_flags)."""

    architecture: str
    sdpa: bool
    flash: bool
    compatible_flash: tuple[str, ...] | None  # None: any flash kernel transformers has

    @classmethod
    def of(cls, architecture: str, flags: dict) -> "AttentionFlags":
        compatible = flags.get("_compatible_flash_implementations")
        return cls(
            architecture,
            bool(flags.get("_supports_sdpa")),
            bool(flags.get("_supports_flash_attn")),
            None if compatible is None else tuple(compatible),
        )

    @property
    def flash_attention_2(self) -> bool:
        """The class runs flash-attn's kernel (not only hub kernels of its own, as gpt-oss's sinks need)."""
        return self.flash and (self.compatible_flash is None or "flash_attention_2" in self.compatible_flash)

    def supported(self) -> list[str]:
        """What of raytrain's implementations the class runs."""
        return ["eager"] + ["sdpa"] * self.sdpa + ["flash_attention_2"] * self.flash_attention_2


def choose_attention(flags: AttentionFlags, device_type: str, bf16: bool) -> tuple[str, str]:
    """(implementation, why) of `auto` for a class on `device_type` workers computing in bf16 or not."""
    if flags.sdpa:
        return "sdpa", f"auto: {flags.architecture} supports sdpa"
    if flags.flash_attention_2 and device_type == "cuda" and bf16:
        return "flash_attention_2", f"auto: {flags.architecture} has no sdpa; flash_attention_2 on GPUs in bf16"
    return "eager", f"auto: {flags.architecture} supports {', '.join(flags.supported())} here, not sdpa"


def attention_problem(flags: AttentionFlags, requested: str) -> str | None:
    """Why `model.attn_implementation: requested` cannot run on this class (None: it can)."""
    if requested == AUTO or requested in flags.supported():
        return None
    why = (
        f"{flags.architecture} runs only its own flash kernels ({', '.join(flags.compatible_flash)})"
        if requested == "flash_attention_2" and flags.flash
        else f"{flags.architecture} does not support {requested}"
    )
    return (
        f"{why}; of raytrain's implementations it supports {', '.join(flags.supported())}: use "
        f"model.attn_implementation: auto (it chooses among them) or {flags.supported()[-1]}"
    )


def choose_experts(device_type: str) -> str:
    """transformers' `experts_implementation` for a mixture-of-experts model on `device_type` workers."""
    return EXPERTS


def source_flags(config: dict) -> AttentionFlags | None:
    """The attention flags of the class a config.json names, from the installed transformers' source
    (private_apis.attention_flags_from_source: no torch); None where it is not found (remote code)."""
    from raytrain import private_apis

    archs = config.get("architectures") or []
    flags = private_apis.attention_flags_from_source(config.get("model_type", ""), archs[0]) if archs else None
    return None if flags is None else AttentionFlags.of(archs[0], flags)


def effective_attention(spec, config: dict) -> str:
    """The implementation a job's workers run for a model of this config.json (`auto` resolved as the
    workers resolve it; sdpa where the class's flags cannot be read here, transformers' own default)."""
    from raytrain.job.plan import RunPlan

    requested, flags = spec.model.attn_implementation, source_flags(config)
    if requested != AUTO:
        return requested
    if flags is None:
        return "sdpa"
    return choose_attention(flags, "cuda" if spec.scaling.use_gpu else "cpu", RunPlan.of(spec).bf16)[0]
