"""What the training workers get from the submitter's environment: settings always, secrets
only where a node lacks them (a forwarded value is readable in Ray's dashboard and state API),
and the per-process setup raytrain needs (the SIGTERM handler, the preemption grace)."""

from __future__ import annotations

import os

from . import preemption, signing
from .config import JobSpec

HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # read by Ray Train's controller (propagated from here)


# What the workers need from the submitter's environment. Settings always travel; secrets
# travel only where the cluster's nodes lack them, since whatever rides in a runtime_env is
# readable in Ray's dashboard and state API (on Kubernetes the manifests set them on every
# pod from the Secret raytrain-secrets, and nothing is forwarded).
SETTINGS_ENV = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "TORCH_EXTENSIONS_DIR")
SECRETS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
               "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", signing.KEY_ENV)


def lacking(wanted: list[str], present_per_node: list[list[str]]) -> list[str]:
    """The secrets of `wanted` that at least one node does not have."""
    return [k for k in wanted if not all(k in present for present in present_per_node)]


def secrets_the_cluster_lacks() -> list[str]:
    """Ask every alive node which of the secrets set here its processes already have."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = [k for k in SECRETS_ENV if k in os.environ]
    if not wanted:
        return []
    present = ray.remote(num_cpus=0)(_present)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    answers = ray.get([present.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                       .remote(wanted, signing.key_id()) for n in nodes])
    return lacking(wanted, answers)


def _present(names: list[str], key_id: str | None) -> list[str]:
    """Names only: no value leaves the node. The signing key counts as present where the node
    would sign with the same key (from its environment or its key file)."""
    have = [n for n in names if n in os.environ and n != signing.KEY_ENV]
    return have + ([signing.KEY_ENV] if signing.key_id() == key_id else [])


def runtime_env(spec: JobSpec, forward: list[str]) -> dict:
    env = {"TOKENIZERS_PARALLELISM": "false", preemption.GRACE_ENV: str(spec.failure.preemption_grace_s)}
    if not spec.scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    for key in (*SETTINGS_ENV, *forward):
        if key in os.environ:  # secrets travel in the environment, never in the spec or MLflow
            env[key] = os.environ[key]
    # A worker-process setup hook runs in each worker's main thread at start-up, so that
    # SIGTERM means "checkpoint, then go". Ray turns a job-level `worker_process_setup_hook`
    # into this variable only in ray.init; for the train workers' own env we set it directly.
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    env[WORKER_PROCESS_SETUP_HOOK_ENV_VAR] = "raytrain.preemption.install_sigterm_handler"
    return {"env_vars": env}
