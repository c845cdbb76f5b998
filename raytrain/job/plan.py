"""The run plan: what the job means for this run, decided once by the driver, executed by every rank.

`JobSpec` is what the user wrote. `RunPlan` is what it resolves to: the prepared stores and the
data key a checkpoint's position refers to, the compute precision, the mesh rule, the
accumulation rule and the gradient-sync rule. The driver builds it (`RunPlan.of`), signs it for
the run directory and hands it to each worker group with the job; a rank verifies it
(rundir/job_file.py: `verify_plan`) and reads its decisions from it instead of deriving them again. What
depends on the world size is a rule of N here (an elastic group learns N only when it starts),
each written once: the memory estimate, `validate` and the strategies all call these.

Before this, precision was read in three modules with two different rules (the device type in
one, `scaling.use_gpu` in another), and every rank re-derived the mesh and accumulation from
the job. Tests and benchmarks that build a strategy without a driver use `RunPlan.of(spec)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain.job import strategies
from raytrain.job.spec import JobSpec


@dataclass(frozen=True)
class Mesh:
    """N ranks laid out as replicate x shard x sp x tp, tp fastest: rank = ((r·shard + d)·sp + k)·tp + t.
    Ranks that differ only in (k, t) read the same rows (one data-parallel rank, `dp_rank`); FSDP2
    shards and averages gradients over replicate x (shard·sp); the tp ranks of a layer split its
    weights and compute the same loss."""

    replicate: int
    shard: int
    sp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many slices a global batch is cut into."""
        return self.replicate * self.shard

    @property
    def gradient_ranks(self) -> int:
        """Ranks a gradient is averaged over (all but the tp copies)."""
        return self.dp * self.sp

    @property
    def row_ranks(self) -> int:
        """Ranks that read one row: each counts its units (labelled tokens, pairs) once; of them, a
        row's loss is added by each of its tp ranks (its sp ranks add a part each)."""
        return self.sp * self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.row_ranks

    def sp_rank(self, rank: int) -> int:
        return rank // self.tp % self.sp

    def sp_groups(self) -> list[list[int]]:
        """The ranks of each sequence-parallel group (one per dp rank and tp rank)."""
        return [
            [start + k * self.tp + t for k in range(self.sp)]
            for start in range(0, self.dp * self.row_ranks, self.row_ranks)
            for t in range(self.tp)
        ]


@dataclass(frozen=True)
class RunPlan:
    strategy: str
    bf16: bool  # training.precision resolved: auto is bf16 on GPU, fp32 on CPU
    compile: bool  # training.compile resolved: auto compiles on GPU where it applies (`compiles`)
    hsdp: bool  # scaling.hsdp resolved: auto is HSDP on GPU clusters; only FSDP2 has it
    workers_per_node: int
    global_batch: int
    micro_batch: int
    sync_every_micro_batch: bool  # training.gradient_sync resolved
    sequence_parallel: int = 1  # scaling.sequence_parallel: ranks one sequence is split over (Ulysses)
    tensor_parallel: int = 1  # scaling.tensor_parallel: ranks one layer's weights are split over
    stores: dict = field(default_factory=dict)  # {"train": [uri], "weights": [...], "eval": uri | None, "key": ...}
    lease: str = ""  # the run directory's lease this plan's driver holds (lease.py); "" without a launcher

    @classmethod
    def of(cls, spec: JobSpec, stores: dict | None = None, lease: str = "") -> "RunPlan":
        t, s = spec.training, spec.scaling
        sync = t.gradient_sync == "every_micro_batch" or (
            t.gradient_sync == "auto" and t.finetune == "full" and strategies.of(spec).shards
        )
        return cls(
            strategy=t.strategy,
            bf16=t.precision == "bf16" or (t.precision == "auto" and s.use_gpu),
            compile=t.compile is True or (t.compile == "auto" and s.use_gpu and compiles(spec)),
            hsdp=bool(s.use_gpu if s.hsdp == "auto" else s.hsdp) and strategies.of(spec).hsdp,
            workers_per_node=s.workers_per_node,
            global_batch=t.global_batch_size,
            micro_batch=t.micro_batch_size,
            sync_every_micro_batch=sync,
            sequence_parallel=s.sequence_parallel,
            tensor_parallel=s.tensor_parallel,
            stores=dict(stores or {}),
            lease=lease,
        )

    # --- rules of the world size N
    def mesh(self, workers: int) -> Mesh:
        """The one mesh rule: N ranks as dp_replicate x dp_shard x sp x tp (`Mesh`). sp and tp are
        the job's; only the data-parallel ranks change with N (an elastic job resizes them alone).
        Under HSDP a node's ranks are one dp_shard group with its sp and tp ranks, so the per-layer
        gathers and the sequence and tensor exchanges stay on the node's links."""
        group = self.sequence_parallel * self.tensor_parallel
        if workers % group:
            raise ValueError(
                f"{workers} workers cannot form sequence_parallel x tensor_parallel = {group} groups: "
                f"use a multiple of {group} workers"
            )
        dp = workers // group
        if self.hsdp and 1 < self.workers_per_node < workers and self.workers_per_node % group == 0:
            per_node = self.workers_per_node // group
            return Mesh(dp // per_node, per_node, self.sequence_parallel, self.tensor_parallel)
        return Mesh(1, dp, self.sequence_parallel, self.tensor_parallel)

    def mesh_shape(self, workers: int) -> tuple[int, ...]:
        """FSDP2's data-parallel mesh at N ranks: (replicas, shard size) under HSDP, else (shard size,).
        Sequence-parallel ranks are in the shard dimension: they hold one model and average gradients."""
        m = self.mesh(workers)
        return (m.replicate, m.shard * m.sp) if m.replicate > 1 else (m.shard * m.sp,)

    def shard_degree(self, workers: int) -> int:
        """Ranks one copy of the model is sharded over (1: every rank holds it whole)."""
        return {"fsdp2": self.mesh_shape(workers)[-1] * self.tensor_parallel, "zero3": workers}.get(self.strategy, 1)

    def accumulation_steps(self, workers: int) -> int:
        """Micro-batches per step on every rank: enough for the largest slice, ceil(G/dp) rows, where
        dp = N / (sp x tp): a sequence's sp and tp ranks share its rows."""
        rows = -(-self.global_batch // self.mesh(workers).dp)
        return -(-rows // self.micro_batch)


TP_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
)  # decoder layouts the tensor-parallel plan names (strategies/tensor_parallel.py)


def compiles(spec: JobSpec) -> bool:
    """Where `training.compile: auto` compiles on GPU workers: everywhere validate takes compile=true
    (not zero3, sequence or tensor parallelism, GRPO) less QLoRA, whose NF4 weights no test compiles."""
    t = spec.training
    return strategies.of(spec).compiles and spec.scaling.model_parallel == 1 and not spec.rl and t.finetune != "qlora"


def frozen_head_apart(spec: JobSpec) -> bool:
    """Where fsdp2 keeps a frozen output layer outside its units (FSDP2Strategy._ignored reads the same
    of the model): adapters (the layer does not train; not a reward model's score head), the table
    computing in the dtype it is loaded in (FSDP2 casts only what it manages), not offloaded."""
    t, plan = spec.training, RunPlan.of(spec)
    return (
        t.strategy == "fsdp2"
        and t.adapters
        and not spec.scores
        and (not plan.bf16 or spec.model.dtype == "bfloat16")
        and not (spec.scaling.use_gpu and (t.offload.params or t.offload.optimizer))
    )


WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # model.dtype's, as the frozen table is held


def vocabulary_split_bytes(spec: JobSpec, workers: int, config: dict) -> tuple[float, float]:
    """(what splitting the frozen output layer by rows saves a rank, what it costs it at the loss).
    Saved: the other ranks' rows of the table, V·d × w × (1 − 1/N). Cost: the split loss gathers every
    rank's last hidden states, keeps them for its backward and computes their fp32 gradient there,
    N × T·d × (c + 4) on every rank, T a rank's tokens in a micro-batch (strategies/vocab_parallel.py).
    d cancels: the split saves memory while N·T·(c + 4) < V·w·(1 − 1/N). (An untied frozen lookup is
    split too; its saving is not counted, since its lookup gathers N × T·d of its own.)"""
    text = config.get("text_config") or {}
    vocab = config.get("vocab_size") or text.get("vocab_size") or 0
    d = config.get("hidden_size") or text.get("hidden_size") or config.get("n_embd") or 0
    n = RunPlan.of(spec).mesh_shape(workers)[-1]
    c, w = (2 if RunPlan.of(spec).bf16 else 4), WEIGHT_BYTES[spec.model.dtype]
    t = rank_tokens(spec)
    return vocab * d * w * (1 - 1 / n), n * t * d * (c + 4)


def rank_tokens(spec: JobSpec) -> int:
    """The most tokens a rank's micro-batch holds: its sequences (a pair's two) x its part of each."""
    return spec.training.micro_batch_size * spec.sequences_per_row * spec.data.seq_len // spec.scaling.sequence_parallel


def splits_vocabulary(spec: JobSpec, workers: int, config: dict) -> bool:
    """Where that frozen output layer (and the lookup tied to it) is split by rows over the ranks
    (strategies/vocab_parallel.py) rather than kept whole on each: one flat mesh of more than one
    rank, no tensor parallelism, the loss through the token objectives at temperature 1 (not GRPO's
    rollouts and tempered log-probs), and only where it saves memory (`vocabulary_split_bytes`: at
    N = 64 a Llama-3-8B's gathered states would be 6 GiB against the 1 GiB of rows saved). The model
    may still decline (`vocab_parallel.tables`: a bias, a scaled lookup). `config`: its config.json."""
    plan = RunPlan.of(spec)
    shape = plan.mesh_shape(workers) if spec.training.strategy == "fsdp2" else (1,)
    if not (frozen_head_apart(spec) and len(shape) == 1 and shape[0] > 1 and plan.tensor_parallel == 1 and not spec.rl):
        return False
    saved, cost = vocabulary_split_bytes(spec, workers, config)
    return saved > cost


def model_parallel_problems(config: dict, sp: int, tp: int) -> list[tuple[str, str, str]]:
    """(field, value, what to do) for each way this model's config.json cannot be split over sp x tp.
    Heads: tp splits them by rank, then Ulysses splits each rank's heads over sp. KV heads fewer
    than sp are repeated up to sp when sp is a multiple of them (each rank gets one)."""
    heads = config.get("num_attention_heads") or 0
    kv = config.get("num_key_value_heads") or heads
    out = []
    if tp > 1:
        family = config.get("model_type", "?")
        if family not in TP_FAMILIES:
            out.append(
                (
                    "scaling.tensor_parallel",
                    str(tp),
                    f"the tensor-parallel plan knows {', '.join(TP_FAMILIES)} "
                    f"decoders, not {family!r}: remove scaling.tensor_parallel (FSDP2 alone shards any model)",
                )
            )
        for key, n in (
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv),
            ("intermediate_size", config.get("intermediate_size") or 0),
        ):
            if n % tp:
                fits = [d for d in range(1, tp) if n % d == 0 and d & (d - 1) == 0]
                out.append(
                    (
                        "scaling.tensor_parallel",
                        str(tp),
                        f"the model's {key}={n} is not divisible by {tp}: "
                        f"each rank takes an equal part; use tensor_parallel {max(fits or [1])}",
                    )
                )
    if sp > 1 and heads and not out:
        local_heads, local_kv = heads // tp, max(1, kv // tp)
        if local_heads % sp:
            out.append(
                (
                    "scaling.sequence_parallel",
                    str(sp),
                    f"{local_heads} attention heads per tensor-parallel rank "
                    f"are not divisible by {sp}: Ulysses gives each rank an equal part of the heads; use a "
                    f"sequence_parallel that divides {local_heads}",
                )
            )
        elif local_kv % sp and sp % local_kv:
            out.append(
                (
                    "scaling.sequence_parallel",
                    str(sp),
                    f"{local_kv} key/value heads per tensor-parallel rank "
                    f"neither divide by {sp} nor divide it: use a sequence_parallel that divides {local_kv} or is a "
                    f"multiple of it",
                )
            )
    return out
