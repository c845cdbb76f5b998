"""The raytrain arm: `raytrain run job.yaml`, the product's submit path, in this process.

    python -m benchmarks.arm_raytrain JOB.yaml [--address ADDR] [--probe-log DIR] [--blocking-check]
                     [--torch-threads N] [--ckpt timed --ckpt-log DIR]

Without options this is exactly `raytrain run JOB.yaml` (pre-flight, local Ray cluster or
--address, MLflow run, TorchTrainer). --probe-log times the per-step stop check in the
workers; --blocking-check and --torch-threads 2 put back what raytrain did before P1's fixes
(a blocking per-step stop check, probe.py; torch's thread pool sized by the core count, not by
the worker's CPUs), for P1's "before" arm; --ckpt times the parts of
each checkpoint save (P5, ckpt_timing.py). All work by
handing Ray Train a train function that patches the worker, then runs raytrain's own.
"""

from __future__ import annotations

import argparse
import os


def make_train_func(
    ckpt: str | None, ckpt_log: str | None, probe_log: str | None, blocking_check: bool, torch_threads: int | None
):
    from benchmarks import ckpt_timing, probe

    # Functions, not modules, in the closure: cloudpickle ships these by value (see main).
    install_ckpt, install_probe, dump_probe = ckpt_timing.install, probe.install, probe.dump
    install_blocking_check = probe.install_blocking_check

    def train_func(config: dict) -> None:
        import ray.train
        import torch

        from raytrain.train import worker

        if torch_threads:  # after raytrain's own sizing (worker.train_func) would be too late: patch it
            torch.set_num_threads = lambda _n, _set=torch.set_num_threads: _set(torch_threads)
        if ckpt:
            install_ckpt(ckpt, ckpt_log)
        if blocking_check:
            install_blocking_check()  # before the probe, so that the probe times it
        if probe_log:
            install_probe()
        try:
            worker.train_func(config)
        finally:
            if probe_log:
                dump_probe(probe_log, ray.train.get_context().get_world_rank())

    return train_func


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--address")
    p.add_argument("--ckpt", choices=["timed"])
    p.add_argument("--ckpt-log")
    p.add_argument("--probe-log")
    p.add_argument("--blocking-check", action="store_true", help="P1's before arm: the per-step stop check before P1")
    p.add_argument(
        "--torch-threads", type=int, help="P1's before arm: torch threads per worker (raytrain: Ray's CPU share)"
    )
    args = p.parse_args()
    if args.ckpt or args.probe_log or args.blocking_check or args.torch_threads:
        import cloudpickle

        from benchmarks import ckpt_timing, probe
        from raytrain.train import entry

        # Shipped to the workers by value: they need not find the benchmarks folder on their path.
        for module in (ckpt_timing, probe):
            cloudpickle.register_pickle_by_value(module)
        entry.train_func = entry.with_secrets(
            make_train_func(args.ckpt, args.ckpt_log, args.probe_log, args.blocking_check, args.torch_threads)
        )  # read by build_trainer
    from raytrain.cli import entry

    step_log = os.environ.get("BENCH_STEP_LOG")  # harness.run_arm: the steps are timed from raytrain's sample log
    entry(
        ["run", args.job]
        + (["--address", args.address] if args.address else [])
        + (["--set", f"data.sample_log={step_log}"] if step_log else [])
    )


if __name__ == "__main__":
    main()  # ends the process as `raytrain run` does
