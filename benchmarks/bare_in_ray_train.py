"""P1's decomposition: the bare baseline's own loop, unchanged, inside Ray Train.

    python -m benchmarks.bare_in_ray_train --workers 2 -- --model M --data D --seq-len 128 \
        --global-batch 16 --micro-batch 4 --steps 60 --out /tmp/bare_in_ray.json

`bare_fsdp2.main` runs in the workers of a plain `TorchTrainer` (gloo on CPU, NCCL with --gpu),
in the process group Ray Train made. Against `bare_fsdp2.py` under torchrun this is what Ray
Train itself costs per step; against raytrain's arm, what raytrain adds inside the worker.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def train_func(config: dict) -> None:
    import os

    import torch
    import torch.distributed as dist

    sys.path.insert(0, config["benchmarks_dir"])
    import bare_fsdp2

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # as raytrain's worker does: torchrun's threads
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Ray Train made the process group and owns its teardown.
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    sys.argv = ["bare_fsdp2.py", *config["args"]]
    bare_fsdp2.main()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("bare_args", nargs=argparse.REMAINDER, help="after --: bare_fsdp2.py's arguments")
    args = p.parse_args()
    bare_args = args.bare_args[1:] if args.bare_args[:1] == ["--"] else args.bare_args
    # Ray's workers run in another directory: local paths become absolute.
    bare_args = [
        str(Path(a).resolve()) if prev in ("--model", "--data", "--out") and Path(a).parent.exists() else a
        for prev, a in zip([None, *bare_args], bare_args)
    ]
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpu = "--gpu" in bare_args
    ray.init(num_cpus=None if gpu else args.workers + 2, include_dashboard=False, log_to_driver=False)
    TorchTrainer(
        train_func,
        train_loop_config={"args": bare_args, "benchmarks_dir": str(Path(__file__).parent)},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=gpu),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
    ).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
