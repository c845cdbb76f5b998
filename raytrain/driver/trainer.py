"""Ray Train's trainer for one job, with torch only in its workers: Ray Train's TorchTrainer imports
torch in the driver and its TorchConfig in the controller (`ray.train.torch`), so the driver gives
Ray Train's DataParallelTrainer a config and a backend of its own that run the same steps, their
torch parts imported where they run, in the workers. The train function is
train/entry.py's, which imports the worker inside each worker process."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig

from raytrain import private_apis
from raytrain.driver.worker_env import runtime_env
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.rundir.job_file import sign_plan
from raytrain.tracking.timeline import Timeline
from raytrain.train import entry


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
        return private_apis.torch_train_func_context()

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


def build_trainer(
    spec: JobSpec,
    run_id: str,
    prepared: dict,
    control=None,
    relay=None,
    timeline: Timeline | None = None,
    lease_token: str = "",
):
    """Ray Train's trainer of this job: its workers, run directory and restarts (all of them: the
    control actor decides what counts, driver/control.py), and the signed plan each worker acts on."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    lo, hi = spec.scaling.worker_range
    scaling = ScalingConfig(
        num_workers=lo if lo == hi else (lo, hi),
        use_gpu=spec.scaling.use_gpu,
        resources_per_worker={"CPU": spec.scaling.cpus_per_worker, **spec.scaling.resources_per_worker},
        elastic_resize_monitor_interval_s=spec.scaling.resize_check_interval_s,
    )
    run = RunConfig(
        name=spec.name,
        storage_path=spec.checkpoint.storage_path,
        checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep_last),
        # Ray restarts without limit; raytrain's control actor decides what counts (control.py).
        failure_config=FailureConfig(max_failures=-1),
        worker_runtime_env=runtime_env(spec, relay.env if relay else None),
    )
    # No Ray Data inside the training workers: each rank reads its rows of each global batch straight
    # from the prepared token store (raytrain/data/), so the trainer has no datasets, and no dataset
    # actor. Each worker first receives the secrets its node lacks from the driver's relay (train/entry.py).
    config = {
        "run_id": run_id,  # the job rides inside the signed plan
        "control": control,  # the job's control actor (driver/control.py), by handle
        **({entry.RELAY_CONFIG: relay.config} if relay else {}),
        "plan": sign_plan(RunPlan.of(spec, prepared, lease=lease_token), spec),
        "timeline": (timeline or Timeline()).to_config(),
    }
    return private_apis.trainer_without_datasets(
        train_loop_per_worker=entry.train_func,
        train_loop_config=config,
        scaling_config=scaling,
        run_config=run,
        backend_config=TorchBackend(backend="nccl" if spec.scaling.use_gpu else "gloo"),
    )
