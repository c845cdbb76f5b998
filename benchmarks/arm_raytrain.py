"""The raytrain arm: `raytrain run job.yaml`, the product's submit path, in this process.

    python -m benchmarks.arm_raytrain JOB.yaml [--address ADDR] [--probe-log DIR] [--fast-check]
                                               [--early-data] [--ckpt timed|async-dcp --ckpt-log DIR]

Without options this is exactly `raytrain run JOB.yaml` (pre-flight, local Ray cluster or
--address, MLflow run, TorchTrainer). --probe-log times the per-step stop check in the
workers and --fast-check replaces it by P1's prototype fix (probe.py); --early-data starts
the data pipeline before the model build (P2's prototype, startup_proto.py); --ckpt puts P5's
checkpoint arm in place (ckpt_proto.py). All work by
handing Ray Train a train function that patches the worker, then runs raytrain's own.
"""

from __future__ import annotations

import argparse
import sys


def make_train_func(ckpt: str | None, ckpt_log: str | None, probe_log: str | None, fast_check: bool,
                    early_data: bool):
    from benchmarks import ckpt_proto, probe, startup_proto

    # Functions, not modules, in the closure: cloudpickle ships these by value (see main).
    install_ckpt, install_probe, dump_probe = ckpt_proto.install, probe.install, probe.dump
    install_fast_check, install_early_data = probe.install_fast_check, startup_proto.install

    def train_func(config: dict) -> None:
        import ray.train

        from raytrain import worker

        if ckpt:
            install_ckpt(ckpt, ckpt_log)
        if early_data:
            install_early_data()
        if fast_check:
            install_fast_check()  # before the probe, so that the probe times the prototype
        if probe_log:
            install_probe()
        try:
            worker.train_func(config)
        finally:
            if probe_log:
                dump_probe(probe_log, ray.train.get_context().get_world_rank())

    return train_func


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--address")
    p.add_argument("--ckpt", choices=["timed", "async-dcp"])
    p.add_argument("--ckpt-log")
    p.add_argument("--probe-log")
    p.add_argument("--fast-check", action="store_true", help="P1's prototype of a stop check without Ray round trips")
    p.add_argument("--early-data", action="store_true", help="P2's prototype: start the data before the model build")
    args = p.parse_args()
    if args.ckpt or args.probe_log or args.fast_check or args.early_data:
        import cloudpickle

        from benchmarks import ckpt_proto, probe, startup_proto
        from raytrain import worker

        # Shipped to the workers by value: they need not find the benchmarks folder on their path.
        for module in (ckpt_proto, probe, startup_proto):
            cloudpickle.register_pickle_by_value(module)
        worker.train_func = make_train_func(args.ckpt, args.ckpt_log, args.probe_log, args.fast_check, args.early_data)  # read by launcher.build_trainer
    from raytrain.cli import main as raytrain_main

    return raytrain_main(["run", args.job] + (["--address", args.address] if args.address else []))


if __name__ == "__main__":
    sys.exit(main())
