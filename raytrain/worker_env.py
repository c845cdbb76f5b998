"""What the training workers get from the submitter's environment: settings always, secrets
only where a node lacks them (a forwarded value is readable in Ray's dashboard and state API),
and the per-process setup raytrain needs (the SIGTERM handler, the preemption grace)."""

from __future__ import annotations

import os

from . import preemption, signing
from .config import JobSpec

# Read by Ray Train's controller, which inherits them from the driver's environment.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
_SUBMITTERS = {k: os.environ.get(k) for k in (HEALTH_CHECK_ENV, START_TIMEOUT_ENV)}  # as the user's shell set them


def controller_env(spec: JobSpec) -> dict[str, str]:
    """Ray Train controller settings for this job; what the submitter's shell set wins.

    Health checks every 0.5 s (its default, 2 s, is added to every exit and every restart).
    An elastic job waits 15 s, not Ray's 60, for a worker group's resources before it starts
    with the ones there are (the resize check grows it later): after a spot notice, Ray still
    counts the draining node's resources as ready, so a restart first asks for the old size
    and would wait out the whole timeout on the node being reclaimed (chaos.py spot: 83 s
    from the reclaim to the first step, 60 of them this wait)."""
    lo, hi = spec.scaling.worker_range
    env = {HEALTH_CHECK_ENV: "0.5", START_TIMEOUT_ENV: "15" if lo < hi else "60"}
    return {k: _SUBMITTERS[k] or v for k, v in env.items()}


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
