"""`training`: how the job trains (strategy, fine-tuning, objective, batch, precision, kernels) and its
LoRA, offload and preference settings. Pure pydantic, torch-free; JobSpec holds it (spec.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from raytrain.job import objectives, strategies
from raytrain.job.grpo import GRPOSpec
from raytrain.job.section import Section


class LoraSpec(Section):
    rank: int = Field(16, gt=0)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling alpha (the update is scaled by alpha / rank)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] | None = None
    """Module names to adapt; default: the attention and MLP projections of the architecture."""
    target_parameters: list[str] | None = None
    """Parameters to adapt by name (peft's `target_parameters`: a 3-D expert weight gets rank-r factors per expert),
    e.g. [experts.gate_up_proj, experts.down_proj]; default: a mixture of experts' fused expert weights (see
    `experts`), none for a dense model; [] adapts none. The router only when named (e.g. mlp.gate.weight)."""
    experts: bool = True
    """Adapt a mixture-of-experts model's experts by default, as well as its target_modules; false leaves them frozen.
    With experts adapted, peft takes no dropout and no DoRA, and QLoRA is refused."""
    use_dora: bool = False
    """DoRA (peft's weight-decomposed LoRA): each adapted weight's per-row magnitude is trained beside the low-rank
    update of its direction. fsdp2, zero3 and ddp; not with tensor parallelism."""


class OffloadSpec(Section):
    optimizer: bool = False
    """Keep the optimizer state (with the fp32 master weights) in CPU memory and step it there. fsdp2 can only offload
    parameters, gradients and optimizer state together: set both."""
    params: bool = False
    """Keep the sharded parameters in CPU memory between uses."""


class PreferenceSpec(Section):
    beta: float = Field(0.1, gt=0)
    """DPO: strength of the pull toward the reference (the rewards are beta x log-ratio). SimPO: the reward scale."""
    loss: Literal["sigmoid", "ipo", "hinge", "apo_zero_unpaired"] = "sigmoid"
    """DPO's loss, as TRL names them: `sigmoid` (the DPO paper), `ipo` (length-normalized squared), `hinge` (SLiC).
    KTO's: `sigmoid` (KTO's own, TRL's `kto`) or `apo_zero_unpaired` (TRL's unpaired APO-zero: no KL estimate, no KL
    sequences run; for completions better than the model's own)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """The share of pairs assumed mislabelled (conservative DPO / SimPO); `sigmoid` only."""
    gamma: float = Field(0.5, ge=0.0)
    """SimPO: the target reward margin (TRL's `simpo_gamma`)."""
    desirable_weight: float = Field(1.0, gt=0)
    """KTO: the weight of a desirable row's loss (TRL's; raise it when desirable rows are the fewer)."""
    undesirable_weight: float = Field(1.0, gt=0)
    """KTO: the weight of an undesirable row's loss."""
    center_rewards_coefficient: float | None = Field(None, gt=0)
    """Reward models: TRL's `center_rewards_coefficient`, the weight of mean((r_chosen + r_rejected)^2) added to the
    loss, which keeps the scores centred on 0 (Eisenstein et al.); null: none."""


class TrainingSpec(Section):
    strategy: Literal[tuple(strategies.STRATEGIES)] = "fsdp2"  # job/strategies.py: fsdp2, zero3, ddp
    """Parallelism: `fsdp2` (torch fully_shard), `zero3` (DeepSpeed ZeRO-3), `ddp` (replicated, small models)."""
    finetune: Literal["lora", "qlora", "full"] = "lora"
    """`lora` trains adapters only (base weights frozen); `qlora` the same over a base stored in NF4 (4-bit NormalFloat,
    as QLoRA; about a quarter of bf16's bytes; fsdp2 only); `full` trains every weight."""
    objective: Literal[tuple(objectives.OBJECTIVES)] = "sft"  # job/objectives.py: sft, dpo, simpo, reward, kto, grpo
    """`sft`: next-token loss on the labelled tokens. `dpo`: preference pairs (prompt, chosen, rejected) against a
    frozen reference (under LoRA the base with the adapter off; under full fine-tuning a frozen copy sharded like the
    model). `simpo`: length-normalized preference loss, no reference. `reward`: a reward model on the same pairs: the
    causal LM with a one-score head (`AutoModelForSequenceClassification`, num_labels 1, TRL's RewardTrainer's model)
    trained so chosen outscores rejected; under LoRA the head is trained whole. `kto`: unpaired rows, each a prompt,
    a completion and a true/false label (TRL's KTOTrainer), against a reference as DPO's. `grpo`: online RL on prompt
    rows (TRL's GRPOTrainer): the workers sample `grpo.num_generations` completions of each prompt, the rewards score
    them, and the loss follows the group-normalized advantages."""
    grpo: GRPOSpec | None = None
    """GRPO's settings (`objective: grpo`), TRL's names; `rewards` is required."""
    preference: PreferenceSpec = PreferenceSpec()
    """DPO / SimPO / KTO / reward model settings."""
    lora: LoraSpec = LoraSpec()
    """LoRA settings, used when `finetune: lora` or `qlora`."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """A mixture of experts' load-balancing loss weight (TRL's name and meaning): null takes the model config's
    `router_aux_loss_coef` (0.001 for Qwen3-MoE, Mixtral), 0 turns it off; set on a dense model it is an error. Added
    to the policy's loss as transformers' `load_balancing_loss_func`, per sequence over its real tokens, weighted
    by them over the global batch; logged as `aux_loss`."""
    global_batch_size: int = Field(32, gt=0)
    """Sequences (GRPO: prompts, each with its num_generations completions) per optimizer step over all workers; fixed
    for the whole job, whatever the worker count (each of N workers gets ceil or floor of global/N, so any N up to it
    works)."""
    micro_batch_size: int = Field(4, gt=0)
    """Sequences (GRPO: prompts, with their completions) per forward pass on one worker; gradient accumulation fills the
    rest of the global batch."""
    max_steps: int = Field(100, gt=0)
    """Optimizer steps to run (epochs repeat the dataset as needed)."""
    seed: int = 0
    """Seed of model init (LoRA), data order and dropout."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Max global gradient norm; null disables clipping."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: `auto` is bf16 on GPU and fp32 on CPU."""
    offload: OffloadSpec = OffloadSpec()
    """CPU offload, meaning the same under `fsdp2` and `zero3`."""
    gradient_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"
    """When gradients are reduced while accumulating (fsdp2, ddp; zero3 always reduce-scatters each micro-batch).
    `every_micro_batch` keeps only this rank's shard of the gradients (fsdp2), at one reduce-scatter per micro-batch;
    `last_micro_batch` communicates once per step but keeps every parameter's whole fp32 gradient until then. `auto`:
    every micro-batch for full fine-tuning (those gradients are the model's size), the last for LoRA (adapters are
    small). The loss and steps are the same either way."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward to save memory."""
    compile: Literal["auto"] | bool = "auto"
    """torch.compile each decoder block (fsdp2, ddp), as torchtitan does: fused kernels, the same losses. The first step
    pays the compilation (tens of seconds, in the start-up line's step_1); CPU workers need a C++ compiler. `auto`: on
    GPU workers where it applies (fsdp2 or ddp, no sequence or tensor parallelism, not GRPO or QLoRA), off on CPU
    workers; false opts out."""
    chunked_loss: Literal["auto"] | bool | int = "auto"
    """Compute the cross-entropy a chunk of tokens at a time, each chunk's logits recomputed in backward, so a
    micro-batch's whole fp32 logits never exist (fsdp2, ddp). `auto`: when they would pass 1 GiB (long sequences at a
    128k vocabulary); true: always; a number: that many tokens a chunk (else 256 MiB of fp32 logits' worth). The
    per-token losses are the same; their sum is taken in another order (~1e-7 relative)."""
    deepspeed: dict[str, Any] | None = None
    """Expert overrides merged into the generated DeepSpeed config (`zero3` only)."""

    @property
    def adapters(self) -> bool:
        """Only LoRA adapters train (`lora`, `qlora`): the base is frozen and never checkpointed."""
        return self.finetune != "full"
