"""Ray Train's trainer for one job, with torch only in its workers: Ray Train's DataParallelTrainer
with train/process_group.py's torch backend (TorchTrainer would import torch here and in the
controller) and train/entry.py's train function, which imports the worker inside each worker."""

from __future__ import annotations

from raytrain import private_apis
from raytrain.driver.worker_env import runtime_env
from raytrain.job.plan import RunPlan
from raytrain.job.spec import JobSpec
from raytrain.rundir.job_file import sign_plan
from raytrain.tracking.timeline import Timeline
from raytrain.train import entry
from raytrain.train.process_group import TorchBackend


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
    workers_env = runtime_env(spec, relay.env if relay else None)
    run = RunConfig(
        name=spec.name,
        storage_path=spec.checkpoint.storage_path,
        checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep_last),
        # Ray restarts without limit; raytrain's control actor decides what counts (control.py).
        failure_config=FailureConfig(max_failures=-1),
        worker_runtime_env=workers_env,
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
        # Ray Train's controller and the actors it starts fork from the workers' server too (the same environment).
        controller_runtime_env=workers_env if "py_executable" in workers_env else None,
        train_loop_per_worker=entry.train_func,
        train_loop_config=config,
        scaling_config=scaling,
        run_config=run,
        backend_config=TorchBackend(backend="nccl" if spec.scaling.use_gpu else "gloo"),
    )
