"""How Ray Train sets up a worker group's torch process group for raytrain, torch-free outside the
workers. Ray Train's TorchTrainer and TorchConfig live in `ray.train.torch`, which imports torch at
its top: in the driver (where TorchTrainer is built) and in the controller (which runs the backend's
hooks and builds the train function's context), 2-3 s of a CPU start-up each. These are their
twins: the same steps (rank 0's address, the torchrun variables, `init_process_group`, the CUDA
device around the train function), each reaching Ray's torch module only where it runs, in a worker,
through private_apis' functions. The driver hands them to Ray Train (driver/trainer.py); Ray pickles
them by reference to this module."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig

from raytrain import private_apis
from raytrain.train import entry


class TrainFuncContext:
    """TorchConfig's context around the train function (it sets the CUDA device), entered in a worker."""

    def __enter__(self):
        self._inner = private_apis.torch_train_func_context()()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@dataclass
class TorchBackend(BackendConfig):
    """TorchConfig's fields and behaviour (gloo on CPU workers, NCCL on GPUs), torch-free here."""

    backend: str = "gloo"
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchProcessGroup

    @property
    def train_func_context(self):
        return TrainFuncContext

    @property
    def framework(self):
        return private_apis.torch_framework()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


class TorchProcessGroup(Backend):
    """Ray Train's torch backend's steps (`_TorchBackend.on_start` for CPU and CUDA workers), run from
    the controller without importing torch there: rank 0's address, the torchrun variables, then
    `init_process_group` on every worker, each step a function of the torch-free private_apis."""

    share_cuda_visible_devices: bool = True  # every worker sees its node's GPUs and picks cuda:{local_rank}

    def on_start(self, worker_group, backend_config: TorchBackend) -> None:
        import ray

        worker_group.execute(entry.await_preimport)  # Ray's steps import torch: never beside the preimport
        addr, port = worker_group.execute_single(0, private_apis.worker_address)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(private_apis.set_torch_distributed_env_vars)
        n = len(worker_group)
        setup = [
            worker_group.execute_single_async(
                i,
                private_apis.setup_torch_process_group,
                backend=backend_config.backend,
                world_rank=i,
                world_size=n,
                init_method="env://",
                timeout_s=backend_config.timeout_s,
            )
            for i in range(n)
        ]
        ray.get(setup)

    def on_shutdown(self, worker_group, backend_config: TorchBackend) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        done = worker_group.execute_async(private_apis.shutdown_torch, destroy_process_group=len(worker_group) > 1)
        try:
            ray.get(done, timeout=private_apis.torch_shutdown_timeout_s())
        except GetTimeoutError:
            print("[raytrain] the workers' torch process group did not shut down in time", flush=True)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
