"""The run plan: what the job means for this run, decided once by the driver, executed by every rank.

`JobSpec` is what the user wrote. `RunPlan` is what it resolves to: the prepared stores and the
data key a checkpoint's position refers to, the compute precision, the mesh rule, the
accumulation rule and the gradient-sync rule. The driver builds it (`RunPlan.of`), signs it for
the run directory and hands it to each worker group with the job; a rank verifies it
(`RunPlan.verified`) and reads its decisions from it instead of deriving them again. What
depends on the world size is a rule of N here (an elastic group learns N only when it starts),
each written once: the memory estimate, `validate` and the strategies all call these.

Before this, precision was read in three modules with two different rules (the device type in
one, `scaling.use_gpu` in another), and every rank re-derived the mesh and accumulation from
the job. Tests and benchmarks that build a strategy without a driver use `RunPlan.of(spec)`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import signing
from .config import JobSpec


@dataclass(frozen=True)
class RunPlan:
    strategy: str
    bf16: bool  # training.precision resolved: auto is bf16 on GPU, fp32 on CPU
    hsdp: bool  # scaling.hsdp resolved: auto is HSDP on GPU clusters; only FSDP2 has it
    workers_per_node: int
    global_batch: int
    micro_batch: int
    sync_every_micro_batch: bool  # training.gradient_sync resolved
    stores: dict = field(default_factory=dict)  # {"train": [uri], "weights": [...], "eval": uri | None, "key": ...}

    @classmethod
    def of(cls, spec: JobSpec, stores: dict | None = None) -> "RunPlan":
        t, s = spec.training, spec.scaling
        sync = t.gradient_sync == "every_micro_batch" or (
            t.gradient_sync == "auto" and t.finetune == "full" and t.strategy != "ddp")
        return cls(strategy=t.strategy, bf16=t.precision == "bf16" or (t.precision == "auto" and s.use_gpu),
                   hsdp=bool(s.use_gpu if s.hsdp == "auto" else s.hsdp) and t.strategy == "fsdp2",
                   workers_per_node=s.workers_per_node, global_batch=t.global_batch_size,
                   micro_batch=t.micro_batch_size, sync_every_micro_batch=sync, stores=dict(stores or {}))

    # --- rules of the world size N
    def mesh_shape(self, workers: int) -> tuple[int, ...]:
        """FSDP2's device mesh at N ranks: (replicas, shard size) under HSDP, else (N,)."""
        if self.hsdp and 1 < self.workers_per_node < workers:
            return workers // self.workers_per_node, self.workers_per_node
        return (workers,)

    def shard_degree(self, workers: int) -> int:
        """Ranks one copy of the model is sharded over (1: every rank holds it whole)."""
        return {"fsdp2": self.mesh_shape(workers)[-1], "zero3": workers}.get(self.strategy, 1)

    def accumulation_steps(self, workers: int) -> int:
        """Micro-batches per step on every rank: enough for the largest slice, ceil(G/N) rows."""
        rows = -(-self.global_batch // workers)
        return -(-rows // self.micro_batch)

    # --- driver -> workers
    def signed(self, run_dir: str) -> dict:
        return signing.sign_document({**asdict(self), "run_dir": signing.place(run_dir)})

    @classmethod
    def verified(cls, doc: dict, run_dir: str) -> "RunPlan":
        """The driver's plan, if its signature holds and it was made for this run directory."""
        what = f"the run plan for {run_dir}"
        doc = signing.verify_document(doc, what)
        signing.require_place(doc, "run_dir", signing.place(run_dir), what)
        doc.pop("run_dir")
        return cls(**doc)
