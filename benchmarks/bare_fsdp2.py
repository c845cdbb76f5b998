"""The bare baseline: a plain torchrun FSDP2 (or, with --fsdp1, FSDP1) training script.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/bare_fsdp2.py --model M --store URI --seq-len 128 --global-batch 16 --micro-batch 4 --steps 25

No Ray, no raytrain: torch and transformers only. It does the work raytrain does per step,
so that the difference between the two is framework overhead and nothing else:
- the same packed rows in the same order: read from the job's token store (`raytrain prepare`)
  in raytrain's global order, rank r taking its slice of each global batch;
- the same loss: sum of token cross-entropy / global label tokens x world size, with the
  same two all-reduces (token count, logged loss) and no gradient sync until the last
  micro-batch; AdamW (betas 0.9/0.95; torch's default kernel, as a hand-rolled script gets, or with
  --fused the fused one raytrain uses), clipping at 1.0, the same warmup + cosine LR;
- the same sharding: fully_shard per decoder block, then the root; fp32 on CPU, bf16
  params with fp32 reduction on GPU.
Rank 0 appends one line per finished step to $BENCH_STEP_LOG/rank0.jsonl (as raytrain
does with that variable), so the bench process times both arms the same way, and writes
its own per-step timings to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--store", required=True, help="a raytrain token store (raytrain prepare) of the job's data")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--window", type=int, default=256, help="data.shuffle_window of the job, in packed rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fused", action="store_true", help="AdamW on torch's fused kernel, as raytrain's (default: torch's)"
    )
    p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel (FSDP1) instead of fully_shard")
    p.add_argument("--gpu", action="store_true", help="CUDA + NCCL, bf16 compute with fp32 reduction")
    p.add_argument("--out", required=True, help="rank 0 writes its timings here (JSON)")
    return p.parse_args()


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def batches(args, rank: int, world: int):
    """This rank's micro-batches of consecutive global batches: the rows raytrain trains on,
    read from the same token store in the same global order (raytrain.data's reader parts;
    no Ray, no prefetch thread)."""
    from raytrain.data import GlobalOrder, rank_slice
    from raytrain.data.store import TokenStore

    store = TokenStore.open(args.store)
    order = GlobalOrder(store.rows, args.seed, True, args.window)
    start, stop = rank_slice(args.global_batch, world, rank)
    micro = -(-(-(-args.global_batch // world)) // args.micro_batch)
    for first in itertools.count(0, args.global_batch):
        _, rows = order.rows_at(np.arange(first + start, first + stop))
        ids, labels, positions = store.read(rows).transpose(1, 0, 2)  # [rows, planes, seq] -> planes
        yield [
            (
                torch.from_numpy(ids[part]).long(),
                torch.from_numpy(labels[part]).long(),
                torch.from_numpy(positions[part]).long(),
            )
            for part in np.array_split(np.arange(len(rows)), micro)
        ]


def build(args, device, world: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.to(device)  # every rank loads the full model, then shards it: the plain way, fine at these sizes
    blocks = list(model.model.layers)
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.gpu else None
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({type(blocks[0])}),
            mixed_precision=mp,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=True,
            device_id=device,
        )  # on CPU too: FSDP1 refuses to guess "cpu"
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.gpu else None, reduce_dtype=torch.float32)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True if args.fused else None
    )
    return model, params, optimizer


def lr_at(step: int, args) -> float:
    """raytrain.loop.lr_at for warmup + cosine down to 0.1 x lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - 1 - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def all_reduce(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def main() -> None:
    args = parse()
    dist.init_process_group("nccl" if args.gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if args.gpu else "cpu")
    if args.gpu:
        torch.cuda.set_device(device)
    start_rss = rss_gb()
    model, params, optimizer = build(args, device, world)
    data = batches(args, rank, world)
    step_log = os.environ.get("BENCH_STEP_LOG")
    timings: dict[str, list[float]] = {
        k: [] for k in ("step_time_s", "data_wait_s", "forward_backward_s", "optimizer_s", "loss")
    }
    for step in range(args.steps):
        step_start = time.perf_counter()
        torch.manual_seed(hash((args.seed, step, rank)) % (2**63))
        micro = next(data)
        data_wait = time.perf_counter() - step_start
        global_tokens = max(1.0, all_reduce(sum(int((lab[:, 1:] != IGNORE).sum()) for _, lab, _ in micro), device))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss_sum, compute_start = 0.0, time.perf_counter()
        for i, (x, y, pos) in enumerate(micro):
            last = i == len(micro) - 1
            if not args.fsdp1:
                model.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if last or not args.fsdp1 else model.no_sync():
                logits = model(input_ids=x.to(device), position_ids=pos.to(device)).logits
                y = y.to(device)
                ce = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
                )
                (ce * (world / global_tokens)).backward()
            loss_sum += float(ce.detach())
        optimizer_start = time.perf_counter()
        if args.fsdp1:
            model.clip_grad_norm_(1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # raytrain logs it: same sync
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - optimizer_start
        loss = all_reduce(loss_sum, device) / global_tokens
        for key, value in (
            ("step_time_s", time.perf_counter() - step_start),
            ("data_wait_s", data_wait),
            ("forward_backward_s", optimizer_start - compute_start),
            ("optimizer_s", optimizer_s),
            ("loss", loss),
        ):
            timings[key].append(value)
        if rank == 0 and step_log:
            with open(os.path.join(step_log, "rank0.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": "bare", "step": step + 1, "loss": loss}) + "\n")
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**30
        if args.gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    memory = [None] * world
    dist.all_gather_object(memory, {"peak_gb": peak, "start_rss_gb": start_rss})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    **timings,
                    "memory": memory,
                    "fsdp": 1 if args.fsdp1 else 2,
                    "world": world,
                    "tokens_per_step": args.global_batch * args.seq_len,
                },
                f,
            )
    # Leave together: a rank that tears gloo down while its peer is still in the last
    # collective aborts the peer ("terminate called without an active exception", seen once in CI).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
