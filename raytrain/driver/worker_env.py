"""What the training workers get from the submitter's environment: settings always, secrets
only where a node lacks them and never through a runtime_env (which Ray's dashboard and state
API show), and the per-process setup raytrain needs (the SIGTERM handler, the preemption grace)."""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from raytrain import allocator, private_apis
from raytrain.job.spec import JobSpec
from raytrain.rundir import signing
from raytrain.train import worker_launch
from raytrain.train.entry import GRACE_ENV, KEY_ID_ENV, SETUP_HOOK, WANTED_ENV

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


# What the workers need from the submitter's environment. Settings travel in the workers'
# runtime_env; secrets never do, since whatever rides in a runtime_env is readable in Ray's
# dashboard and state API. A node has its secrets from its own environment (on Kubernetes the
# manifests set them on every pod from the Secret raytrain-secrets; cluster/*.yaml from the
# cloud's secret store); a worker process on a node that lacks some asks the driver's secret
# relay (the control actor) for them as its train function starts (train/entry.py), so a spot node an autoscaler
# adds mid-run is covered as well as the nodes alive at submit.
# The host allocator's variables are allocator.worker_env's (mimalloc on CPU workers, unless the
# submitter chose).
SETTINGS_ENV = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "TORCH_EXTENSIONS_DIR")
SECRETS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    signing.KEY_ENV,
)


@dataclass
class Relay:
    """What a worker needs to ask the control actor for the secrets its node lacks: the actor's handle
    and the job's capability (in the workers' train_loop_config only), and the names-only variables of
    its runtime_env."""

    actor: object  # the job's control actor (driver/control.py), which holds the values
    capability: str
    env: dict[str, str]  # names and a salted key id only: for the workers' runtime_env

    @property
    def config(self) -> tuple:
        return self.actor, self.capability


def relay_secrets(actor) -> Relay:
    """Driver: the values of the SECRETS_ENV names set here go to the control actor, by a method call
    (never with its creation, whose options Ray's dashboard shows), behind a fresh capability."""
    values = {k: os.environ[k] for k in SECRETS_ENV if k in os.environ}
    capability = secrets.token_hex(16)
    actor.hold.remote(values, capability)  # not waited for: a worker that asks first waits on the actor
    salt = secrets.token_hex(8)
    key_id = signing.key_id(salt)
    env = {WANTED_ENV: ",".join(values), **({KEY_ID_ENV: f"{salt}:{key_id}"} if key_id else {})}
    return Relay(actor, capability, env)


def runtime_env(spec: JobSpec, relay: dict[str, str] | None = None) -> dict:
    """The train workers' runtime_env: settings, and the relay's names-only variables (`relay_secrets`)."""
    env = {"TOKENIZERS_PARALLELISM": "false", GRACE_ENV: str(spec.failure.preemption_grace_s)}
    if not spec.scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    for key in SETTINGS_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(allocator.worker_env(spec.scaling.use_gpu, os.environ))
    env.update(relay or {})
    env.update(_own_cluster())
    # A worker-process setup hook runs in each worker's main thread at start-up, so that
    # SIGTERM means "checkpoint, then go" (`setup_worker`). Ray turns a job-level
    # `worker_process_setup_hook` into this variable only in ray.init; for the train workers'
    # own env we set it directly.
    env[private_apis.worker_setup_hook_variable()] = SETUP_HOOK
    return {"env_vars": env, **launcher(os.environ)}


def _own_cluster() -> dict[str, str]:
    """RAY_ADDRESS, the connected cluster's: Ray Train's actors that ask Ray's state API about the run (its
    state actor, with RAY_TRAIN_ENABLE_STATE_TRACKING) give it no address, and with none that API takes the
    newest Ray instance started on the machine. Beside a second local cluster (a laptop's, the tests' own) it
    asked the other: seen in a clean-clone run, where Ray Train's placement-group cleaner (since dropped:
    private_apis.trainer_without_datasets) found no controller there and removed a live job's placement group."""
    if not connected():
        return {}
    import ray

    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def connected() -> bool:
    """Whether this process is connected to a Ray cluster, without importing Ray where it has not been (`raytrain
    run` starts the fork server before its own imports of Ray: start_fork_server)."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def cluster_address(address: str | None = None) -> str | None:
    """The cluster this driver joins: --address, else RAY_ADDRESS (set by `ray job submit`); None: it starts a
    local cluster of its own."""
    return address or os.environ.get("RAY_ADDRESS") or None


FORKSERVER_ENV = "RAYTRAIN_FORKSERVER"  # 0 (or false, off, no): every worker a fresh interpreter, as Ray starts it


def launcher(submitted: Mapping[str, str]) -> dict:
    """The workers' py_executable: train/worker_launch.py has each worker forked from a process that imported
    what a worker needs once (a start or restart without ~8 CPU-seconds of imports a worker). Linux only (its
    abstract sockets); the submitter's RAYTRAIN_FORKSERVER=0 turns it off. The path is the driver's, as the
    allocator's is: the nodes of a cluster run one image."""
    if sys.platform != "linux" or submitted.get(FORKSERVER_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return {}
    return {"py_executable": f"{shlex.quote(sys.executable)} -I -S {shlex.quote(worker_launch.__file__)}"}  # bash


_base_started = False


def start_fork_server(spec: JobSpec, address: str | None = None) -> None:
    """Where this driver will start a local cluster of its own (no `address`, no RAY_ADDRESS): the machine's base
    fork server, started before that cluster, so that it imports a worker's modules while Ray starts, not after
    (P2's cold start). `raytrain run` calls it as soon as the job is valid, before its own imports of Ray and the
    driver; the launcher's `connect` again (a second call does nothing). Its environment is a worker's on this node
    (`runtime_env`, over this one); Ray's own variables, which a worker gets and this process lacks yet, are not in
    a base server's key. It lives while this driver does."""
    global _base_started
    if _base_started or cluster_address(address) or connected():
        return
    _base_started = True
    env = runtime_env(spec)
    if "py_executable" in env:
        logs = private_apis.ray_temp_dir()
        os.makedirs(logs, exist_ok=True)
        worker_launch.start_base_server({**os.environ, **env["env_vars"]}, [f"--temp-dir={logs}"], os.getpid())


def warm_nodes(spec: JobSpec) -> list:
    """Start the fork servers (train/forkserver.py) on each node that can hold this job's workers, while the
    driver opens the run and Ray Train starts its controller: one zero-CPU task a node in the workers'
    environment, not waited for. A node's server then imports what a worker needs once, and the workers it
    forks skip those imports. Each task runs in a process of its own (max_calls=1) that exits after it, so its
    result (whether it was forked: the server was ready) says the node's state; a caller may wait on them."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env = runtime_env(spec)
    if "py_executable" not in env:
        return []
    need = {"CPU": spec.scaling.cpus_per_worker, **spec.scaling.resources_per_worker}
    if spec.scaling.use_gpu:
        need["GPU"] = 1
    task = ray.remote(num_cpus=0, max_calls=1, max_retries=0)(worker_launch.forked)
    return [
        task.options(
            runtime_env=env, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote()
        for node in ray.nodes()
        if node["Alive"] and all(node["Resources"].get(k, 0) >= v for k, v in need.items())
    ]
