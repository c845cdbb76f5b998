"""The job's other sections: `model`, `optimizer`, `scaling`, `checkpoint`, `failure` and `tracking`.
Pure pydantic, torch-free; JobSpec holds them (spec.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raytrain.job.section import Section

# The URI schemes a run directory may have besides a plain path: its lease is a record that changes
# only by conditional writes (rundir/versioned.py has them for S3; a file system has flock and rename).
LEASE_SCHEMES = ("s3://", "file://")


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
