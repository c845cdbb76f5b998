"""How big one Kubernetes pod of a job is, from the job and the memory estimate (memory.py).

A pod is one Ray node with `scaling.workers_per_node` training workers: ranks of one machine
share its NVLink and one pod's memory, so an 8-GPU node runs one pod, not eight. Its requests:

  GPUs        workers_per_node (when use_gpu)
  CPUs        workers_per_node x cpus_per_worker + 2 for Ray Data's tasks
  memory      per rank: the process (torch, CUDA, the Ray worker) + what the job offloads to
              host memory + an async checkpoint's staged copy; plus the full copies held while
              loading (every rank under ddp; none under fsdp2 and zero3, which read their shards
              or one module at a time, and export one gathered tensor at a time), Ray Data, and
              /dev/shm (a memory-backed volume counts against the pod's memory); x 1.2
  disk        (ephemeral storage, /tmp) the model's download, one whole checkpoint (a restart
              downloads it to every node), this pod's staged checkpoint parts, this pod's files
              of the final export (a full model's are spread over the ranks), Ray's logs; x 1.2
Without the model's dimensions (a hub id whose config.json is not in the local cache) the
template's sizes stand and `raytrain k8s` says how to get them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from raytrain.job import strategies
from raytrain.job.spec import JobSpec
from raytrain.model.facts import DTYPE_BYTES, ModelFacts
from raytrain.validate import memory

GiB = memory.GiB
MARGIN = 1.2
DATA_CPUS = 2  # beside the training workers, for Ray Data's read/tokenize tasks
PROCESS_GIB = {True: 6, False: 3}  # a training worker process, GPU (CUDA context, NCCL) or CPU
DATA_GIB = 4
RAY_DISK_GIB = 5  # Ray's session directory: logs, spilled objects
SHM_GIB_PER_GPU_WORKER, SHM_GIB_CPU = 2, 1


@dataclass
class PodSize:
    pods: tuple[int, int]  # replica range of the worker group
    workers: int  # training workers per pod
    gpus: int
    cpus: int
    shm_gib: int
    memory_gib: int | None = None  # None: unknown here (no model dimensions)
    disk_gib: int | None = None
    basis: list[str] = field(default_factory=list)  # the terms, for a comment in the manifest


def size_pods(spec: JobSpec, facts: ModelFacts | None) -> PodSize:
    s = spec.scaling
    per = s.workers_per_node
    lo, hi = s.worker_range
    size = PodSize(
        pods=(math.ceil(lo / per), math.ceil(hi / per)),
        workers=per,
        gpus=per if s.use_gpu else 0,
        cpus=math.ceil(per * s.cpus_per_worker) + DATA_CPUS,
        shm_gib=per * SHM_GIB_PER_GPU_WORKER if s.use_gpu else SHM_GIB_CPU,
    )
    if facts is None:
        return size
    est = memory.estimate(spec, facts, lo)  # the fewest workers: the largest share per rank
    model = facts.n_params * DTYPE_BYTES[spec.model.dtype]
    whole_ckpt = memory.checkpoint_bytes(spec, facts)
    ckpt_rank = whole_ckpt / lo  # sharded; under ddp DCP writes each replicated tensor once, spread over ranks
    host_offload = sum(t.bytes for t in est.host)
    staging = ckpt_rank if spec.checkpoint.async_save else 0
    copies = per if strategies.of(spec).replicated else 0
    mem = {
        "processes": per * PROCESS_GIB[s.use_gpu] * GiB,
        "offloaded state": per * host_offload,
        "async checkpoint staging": per * staging,
        f"loading ({copies} full cop{'y' if copies == 1 else 'ies'})": copies * model,
        "Ray Data": DATA_GIB * GiB,
        "/dev/shm": size.shm_gib * GiB,
    }
    export = model * per / lo if spec.training.finetune == "full" else whole_ckpt
    disk = {
        "model download": model,
        "restored checkpoint": whole_ckpt,
        "staged checkpoint parts": per * ckpt_rank,
        "final export": export,
        "Ray logs": RAY_DISK_GIB * GiB,
    }
    size.memory_gib = math.ceil(MARGIN * sum(mem.values()) / GiB)
    size.disk_gib = math.ceil(MARGIN * sum(disk.values()) / GiB)
    size.basis = [
        f"memory {size.memory_gib}Gi = {MARGIN} x ("
        + " + ".join(f"{k} {memory.size(v)}" for k, v in mem.items() if v)
        + ")",
        f"ephemeral-storage {size.disk_gib}Gi = {MARGIN} x ("
        + " + ".join(f"{k} {memory.size(v)}" for k, v in disk.items() if v)
        + ")",
    ]
    return size
