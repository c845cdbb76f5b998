"""The job spec: one YAML file, validated into typed sections before Ray is touched.

Every field has a docstring (it is the reference documentation of the YAML), and every
rule that ties sections together is a function in rules.py with a message that names the fix.
The spec crosses into the workers as plain JSON and is validated again there, so a
worker never runs on a dict nobody checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from raytrain.job import rules
from raytrain.job.data import DataSpec
from raytrain.job.grpo import GRPOSpec
from raytrain.job.section import Section

LOSS_CHUNK_BYTES = 256 << 20  # fp32 logits a chunk of `training.chunked_loss` holds
# The URI schemes a run directory may have besides a plain path: its lease is a record that changes
# only by conditional writes (rundir/versioned.py has them for S3; a file system has flock and rename).
LEASE_SCHEMES = ("s3://", "file://")
# A key that names a secret: a job file holds none (validate refuses one), and MLflow never gets one.
SECRET_KEY = re.compile(
    r"(^|[_\-.])(token|secrets?|password|passwd|pwd|api[_-]?key|access[_-]?key|credentials?|auth)($|[_\-.])", re.I
)


class ModelSpec(Section):
    path: str
    """Local directory or hub id of a Hugging Face causal LM, loaded with `from_pretrained`."""
    revision: str | None = None
    """Hub branch, tag or commit of `model.path` (default: the hub's main). The driver resolves it
    to a commit once; every worker, every restart and the export load that commit."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; defaults to `model.path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model is loaded in and a LoRA job's frozen base is kept in. Trained weights (a full fine-tune's) always
    keep an fp32 master copy with fp32 AdamW state, under every strategy; compute precision is `training.precision`."""
    trust_remote_code: bool = False
    """Run the model repository's own Python code. Off unless the job says so: it executes code from the hub."""
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """Attention implementation. `auto`: the fastest the model's class supports on the workers (sdpa where it does;
    else flash_attention_2 on GPUs in bf16 where the class takes flash-attn's kernel; else eager, as gpt-oss's
    attention sinks on CPU), named in the start-up line. An explicit one the class cannot run is refused by validate.
    Packed rows keep raytrain's own document boundaries under each."""

    def hub_kwargs(self, path: str | None = None) -> dict:
        """What every `from_pretrained` of `path` (default: model.path) passes: the pinned
        revision (for the tokenizer too when it is model.path's) and trust_remote_code."""
        path = path or self.path
        return {"revision": self.revision if path == self.path else None, "trust_remote_code": self.trust_remote_code}


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
    strategy: Literal["fsdp2", "zero3", "ddp"] = "fsdp2"
    """Parallelism: `fsdp2` (torch fully_shard), `zero3` (DeepSpeed ZeRO-3), `ddp` (replicated, small models)."""
    finetune: Literal["lora", "qlora", "full"] = "lora"
    """`lora` trains adapters only (base weights frozen); `qlora` the same over a base stored in NF4 (4-bit NormalFloat,
    as QLoRA; about a quarter of bf16's bytes; fsdp2 only); `full` trains every weight."""
    objective: Literal["sft", "dpo", "simpo", "reward", "kto", "grpo"] = "sft"
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


class OptimizerSpec(Section):
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to `lr`."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, down to `lr * min_lr_ratio` at `max_steps`."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final LR as a fraction of `lr`."""


class ScalingSpec(Section):
    num_workers: int | None = Field(None, gt=0)
    """Fixed worker count; or give `min_workers`/`max_workers` for an elastic job."""
    min_workers: int | None = Field(None, gt=0)
    """Fewest workers the job runs with (elastic)."""
    max_workers: int | None = Field(None, gt=0)
    """Most workers the job grows to (elastic)."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); otherwise CPU workers on gloo."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved per training worker."""
    resources_per_worker: dict[str, float] = {}
    """Extra Ray resources each worker needs (e.g. {"spot-gpu": 1} to pin workers to a node pool)."""
    resize_check_interval_s: float = Field(60.0, gt=0)
    """Elastic jobs: how often Ray Train checks whether more workers fit (growing restarts from the latest checkpoint).
    """
    accelerator_memory_gb: float | None = Field(None, gt=0)
    """Memory of one accelerator, for the pre-flight memory estimate (e.g. 80 for an H100)."""
    workers_per_node: int = Field(1, gt=0)
    """Training workers on one machine (e.g. 8 on an 8-GPU node): `raytrain k8s` packs them into one
    pod, so ranks of a node share its NVLink; worker counts must be multiples of it."""
    hsdp: bool | Literal["auto"] = "auto"
    """FSDP2's mesh: shard the model within a node (`workers_per_node` ranks) and replicate it across
    nodes (HSDP: the per-layer all-gathers stay on the node's fast links; gradients are all-reduced
    across nodes once per step), instead of one flat mesh over every rank. auto: HSDP on GPU
    clusters when the job spans more than one node; true: whenever it spans more than one node;
    false: one flat mesh. Checkpoints reshard between any meshes."""
    sequence_parallel: int = Field(1, gt=0)
    """Ranks one sequence is split over along its length (DeepSpeed-Ulysses: attention gathers the
    sequence and scatters the heads with one all-to-all each way), for sequences whose activations
    do not fit one device. These ranks read the same rows; a global batch is cut into
    N / (sequence_parallel x tensor_parallel) data-parallel slices."""
    tensor_parallel: int = Field(1, gt=0)
    """Ranks each decoder layer's weights are split over (fsdp2): q/k/v/gate/up by output column,
    o/down by input row, so a layer is never gathered whole on one device. Keep it within a node."""

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel slice: sequence_parallel x tensor_parallel."""
        return self.sequence_parallel * self.tensor_parallel

    @model_validator(mode="after")
    def _one_way_to_size(self):
        if self.num_workers is not None and (self.min_workers or self.max_workers):
            raise ValueError("give either `num_workers` (fixed) or `min_workers`/`max_workers` (elastic), not both")
        if self.num_workers is None and (self.min_workers is None) != (self.max_workers is None):
            raise ValueError("an elastic job needs both `min_workers` and `max_workers`")
        if self.min_workers and self.max_workers and self.min_workers > self.max_workers:
            raise ValueError(f"min_workers={self.min_workers} > max_workers={self.max_workers}: swap them")
        if any(n % self.workers_per_node for n in self.worker_range):
            raise ValueError(
                f"workers_per_node={self.workers_per_node} does not divide the worker count(s) "
                f"{sorted(set(self.worker_range))}: nodes are whole, so use multiples of it"
            )
        group = self.model_parallel
        if group > 1 and any(n % group for n in self.worker_range):
            raise ValueError(
                f"sequence_parallel x tensor_parallel = {group} does not divide the worker count(s) "
                f"{sorted(set(self.worker_range))}: use multiples of {group} (only the data-parallel "
                "ranks change with the worker count)"
            )
        if group > 1 and self.workers_per_node > 1 and self.workers_per_node % group:
            raise ValueError(
                f"workers_per_node={self.workers_per_node} is not a multiple of sequence_parallel x "
                f"tensor_parallel = {group}: a sequence's ranks must share a node (their exchanges run "
                f"every layer); use a sequence_parallel x tensor_parallel that divides {self.workers_per_node}"
            )
        if group > 1 and self.min_workers and self.workers_per_node % group:
            raise ValueError(
                f"an elastic job with sequence_parallel x tensor_parallel = {group} must grow and shrink "
                f"by whole groups: set scaling.workers_per_node to a multiple of {group} (its nodes hold "
                "that many workers), or give a fixed num_workers"
            )
        return self

    @property
    def worker_range(self) -> tuple[int, int]:
        if self.num_workers is not None:
            return self.num_workers, self.num_workers
        if self.min_workers is not None:
            return self.min_workers, self.max_workers
        return 2, 2


class CheckpointSpec(Section):
    storage_path: str = "./runs"
    """Where runs live (local path or s3://...): checkpoints, exported model, and the default MLflow store."""
    every_n_steps: int = Field(50, gt=0)
    """Commit a sharded checkpoint every N optimizer steps (and at the end)."""
    async_save: bool = False
    """Write and upload periodic checkpoints in the background: training blocks only while the state is copied to CPU
    memory (FSDP2/DDP; ZeRO-3 writes its files first). Costs one extra copy of the model+optimizer shards in host memory
    while a save is in flight. A crash before the commit resumes from the previous checkpoint; preemption and final
    checkpoints always commit before going on."""
    keep_last: int = Field(2, gt=0)
    """Committed checkpoints to keep; older ones are pruned after a newer one commits."""
    export_final: bool = True
    """At the end, write a plain Hugging Face model (or LoRA adapter) to `<run>/final_model`."""

    @model_validator(mode="after")
    def _storage_holds_a_lease(self):
        # One driver per run directory is a compare-and-swap record there (rundir/lease.py, versioned.py)
        if "://" in self.storage_path and not self.storage_path.startswith(LEASE_SCHEMES):
            scheme = self.storage_path.split("://", 1)[0]
            raise ValueError(
                f"storage_path={self.storage_path!r}: a run directory on {scheme}:// cannot hold the "
                "run's lease (one driver per run directory needs conditional writes, which raytrain "
                "has for s3:// and for local or shared file systems); use an s3:// bucket (or an "
                "S3-compatible store with conditional writes) or a shared file system with locks "
                "(NFS: Filestore on GCP, EFS on AWS) mounted on every node"
            )
        return self


class FailureSpec(Section):
    max_failures: int = Field(3, ge=-1)
    """Worker failures (a crash, a node lost without notice) the job survives, each resumed from the latest committed
    checkpoint; -1: no limit. A preemption whose notice committed a checkpoint (SIGTERM, a Ray drain) and an elastic
    resize never count."""
    checkpoint_on_preemption: bool = True
    """Commit a checkpoint at the next step boundary on Ray's preemption/drain notice (checked every step)."""
    preemption_grace_s: float = Field(120.0, gt=0)
    """After SIGTERM, a worker finishes its step and checkpoint, and is killed at this deadline at the latest; keep it
    below the pod's terminationGracePeriodSeconds."""


class TrackingSpec(Section):
    uri: str | None = None
    """MLflow tracking URI (http://host:5000, sqlite:///...); default: the sqlite file
    <checkpoint.storage_path>/mlflow.db."""
    experiment: str = "raytrain"
    """MLflow experiment name."""
    log_every_n_steps: int = Field(1, gt=0)
    """Metric logging interval."""
    log_model: bool = False
    """Also upload the final model into the MLflow run's artifacts. Off: the run gets the tag `raytrain.final_model`
    with the export's URI (`<run_dir>/final_model`), and a large model is not stored twice."""


class JobSpec(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    """Run name: the run directory under `storage_path` and the MLflow run name."""
    model: ModelSpec
    """What to fine-tune."""
    data: DataSpec
    """What to train on."""
    training: TrainingSpec = TrainingSpec()
    """How to train."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """AdamW and LR schedule."""
    scaling: ScalingSpec = ScalingSpec()
    """How many workers, on what."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Sharded checkpoints and final export."""
    failure: FailureSpec = FailureSpec()
    """Automatic restarts."""
    tracking: TrackingSpec = TrackingSpec()
    """MLflow."""

    @model_validator(mode="after")
    def _sections_fit_together(self):
        for rule in rules.RULES:  # each raises ValueError with the fields and the fix
            rule(self)
        return self

    def loss_chunk_tokens(self, model_config: dict) -> int:
        """Tokens per cross-entropy chunk for this model (its config.json), 0 for the whole logits at
        once: the one place `training.chunked_loss` is resolved (the strategy computes by it, the
        estimate counts it). A model that transforms its logits after the output layer (Gemma 2's
        softcapping, Cohere's logit scale) computes them whole."""
        vocab, chunked = model_config.get("vocab_size") or 0, self.training.chunked_loss
        if any(model_config.get(k) is not None for k in ("final_logit_softcapping", "logit_scale")):
            chunked = False
        tokens = (
            self.training.micro_batch_size
            * self.sequences_per_row
            * self.data.seq_len
            // self.scaling.sequence_parallel
        )
        # auto: chunked once the logits pass a chunk's 256 MiB of fp32 (a CPU worker's DPO pair of 1k
        # tokens at a 49k vocabulary kept 1.1 GiB of logits and their gradient at once); the price is
        # the output layer's matmul again in backward, ~3% of a 135M model's step, less for larger ones.
        if (
            chunked is False
            or not vocab
            or self.training.strategy == "zero3"
            or self.scores
            or (chunked == "auto" and tokens * vocab * 4 <= LOSS_CHUNK_BYTES)
        ):
            return 0
        if chunked is True or chunked == "auto":
            return max(1, LOSS_CHUNK_BYTES // (vocab * 4))  # 523 tokens at 128k
        return chunked

    @property
    def preference(self) -> bool:
        """Rows are (prompt, chosen, rejected) pairs, or KTO's labelled rows: not single sequences."""
        return self.training.objective not in ("sft", "grpo")

    @property
    def packed(self) -> bool:
        """Rows hold several documents (SFT with data.pack); pairs, KTO rows and prompts never do."""
        return self.data.pack and self.training.objective == "sft"

    @property
    def rl(self) -> bool:
        """GRPO: rows are prompts, and the workers sample what is trained (rl/)."""
        return self.training.objective == "grpo"

    @property
    def scores(self) -> bool:
        """A reward model: a score head (`AutoModelForSequenceClassification`) instead of the LM head."""
        return self.training.objective == "reward"

    @property
    def unpaired(self) -> bool:
        """KTO: rows are a prompt, a completion and a label (data/unpaired.py)."""
        return self.training.objective == "kto"

    @property
    def row_kind(self) -> bool | str:
        """What a source row is, as the prepare step and `validate` read it (and the store's key
        records it): False one sequence, True a preference pair, "reward" a pair and its margin,
        "kto" an unpaired labelled row, "prompt" a GRPO prompt."""
        return "prompt" if self.rl else "kto" if self.unpaired else "reward" if self.scores else self.preference

    @property
    def sequences_per_row(self) -> int:
        """Sequences a row trains in one forward: a preference pair's two (chosen and rejected), a
        GRPO prompt's num_generations completions."""
        return self.training.grpo.num_generations if self.rl else 1 if self.unpaired else 2 if self.preference else 1

    @property
    def stored_sequences(self) -> int:
        """Sequences a row is in the token store: a pair's two (a reward model's with its margin
        tag, data/pairs.py); a KTO row's example, its KL sequence and its label tag (data/unpaired.py);
        a GRPO prompt and its columns (data/prompts.py)."""
        return 2 if self.rl else 3 if self.unpaired or self.scores else self.sequences_per_row

    @property
    def reference_copy(self) -> bool:
        """DPO and KTO under full fine-tuning compare against a frozen copy of the starting model
        (under LoRA the reference is the same model with its adapter off)."""
        t = self.training
        return t.finetune == "full" and (t.objective in ("dpo", "kto") or (t.objective == "grpo" and t.grpo.beta > 0))

    @property
    def run_dir(self) -> str:
        return self.checkpoint.storage_path.rstrip("/") + "/" + self.name


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=20` -> (["training", "max_steps"], 20); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. training.max_steps=20")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    return raw


def load_yaml(path: str | Path, overrides: list[str] = ()) -> dict:
    """Read a job file with yaml.safe_load (never yaml.load: a job file must not run code)."""
    text = Path(path).read_text()
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a job file is a YAML mapping (name:, model:, data:, ...), got {type(raw).__name__}")
    return apply_overrides(raw, list(overrides))
