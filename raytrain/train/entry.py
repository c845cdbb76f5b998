"""How a Ray Train worker process enters raytrain, torch-free: the driver hands Ray Train `train_func`
(and names `setup_worker` as the process hook) without importing anything a step needs. In the
worker: SIGTERM means "checkpoint, then go" from the start; the secrets its node lacks come from
the driver (never through a runtime_env, which Ray's dashboard and state API show); then the
worker itself (train/worker.py: torch, transformers, the strategy) is imported and run.

The names a driver and its workers share about the secrets live here, on the workers' side: the
driver imports this module, never the other way round."""

from __future__ import annotations

import functools
import importlib
import os
import threading

from raytrain.rundir import signing
from raytrain.train import preemption, worker_launch

# Names and ids only, never a value: these are in the workers' runtime_env.
WANTED_ENV = "RAYTRAIN_SECRETS_WANTED"  # the secret names set on the driver, comma-separated
KEY_ID_ENV = (
    "RAYTRAIN_KEY_ID"  # "salt:id", the driver's signing.key_id(salt) with a fresh salt: a node tells a different key
)
RELAY_CONFIG = "secret_relay"  # train_loop_config: (the control actor, the job's capability), its only way in
RELAY_TIMEOUT_S = 30.0
GRACE_ENV = "RAYTRAIN_PREEMPTION_GRACE_S"  # failure.preemption_grace_s, for the SIGTERM handler
SETUP_HOOK = "raytrain.train.entry.setup_worker"  # the workers' process hook, by name (Ray imports it there)


def _run_worker(config: dict) -> None:
    await_preimport()
    from raytrain.train import worker  # torch and the rest of a step: in the worker process only

    worker.train_func(config)


def _present(names: list[str], key_id: str | None) -> list[str]:
    """Which of `names` this process has. The signing key counts as present where this process
    would sign with the same key (from its environment or its key file) as the driver: `key_id`
    is the driver's "salt:id"."""
    have = [n for n in names if n in os.environ and n != signing.KEY_ENV]
    salt, _, theirs = (key_id or "").rpartition(":")
    same = bool(theirs) and signing.key_id(salt) == theirs
    return have + ([signing.KEY_ENV] if signing.KEY_ENV in names and same else [])


def setup_worker() -> None:
    """Ray `worker_process_setup_hook` of the train workers: SIGTERM means "checkpoint, then go".

    Ray runs it in each worker process after the process has connected to the cluster and
    before it takes its first task, so before the Ray Train worker actor is constructed
    (ray/_private/workers/default_worker.py). The secrets are not fetched here: ray.get_actor
    works, but submitting any call from a process that has run no task yet crashes it (Ray
    2.60: `shared_lru.h:66 Check failed: value != nullptr`, the caller's runtime env is unset;
    a call given a runtime_env of its own goes through, then the next task assignment fails
    `context.cc:95 Check failed: task_index_ == 0`). See `with_secrets` for where they come.

    It also starts importing what a step needs (`PREIMPORT`) in a thread: the process would otherwise
    import torch, transformers' modelling and peft only once Ray Train has set the group up (its
    actors, the rendezvous, the process group), one after the other, where most of that setup is
    waiting on other processes."""
    preemption.install_sigterm_handler(float(os.environ.get(GRACE_ENV, "120")))  # host: an environment value
    global _preimporting
    _preimporting = threading.Thread(target=_preimport, name="raytrain-preimport", daemon=True)
    _preimporting.start()


PREIMPORT = worker_launch.STEP_IMPORTS  # a forked worker has them already: the thread then finds them imported


_preimporting: threading.Thread | None = None


def _preimport() -> None:
    """Import PREIMPORT, while Ray Train sets the group up. The train function waits for it before it
    imports anything of a step: two threads importing transformers at once can each hold a module the
    other needs (its lazy `__getattr__` imports submodules), and Python's import-deadlock detection then
    hands one of them a partly initialised module (CI at stop 65: `cannot import name 'AutoConfig' from
    'transformers'`, twice before the first step, in 4 jobs of 700)."""
    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except Exception:  # the main thread's own import of it will say what is wrong
            return


def await_preimport() -> None:
    """Wait for `_preimport`, in a worker, before importing anything it imports (torch included: Ray
    Train's process-group steps import it, process_group.TorchProcessGroup waits first)."""
    if _preimporting is not None:
        _preimporting.join()


def with_secrets(train_func):
    """The train function, first receiving the secrets this node lacks from the driver's relay.

    The earliest point where a worker may call the relay is its first task; of those, raytrain
    runs only the train function, and Ray Train reads no secret on a worker before it (its
    checkpoint storage is first touched by `ray.train.report`). A partial, not a closure:
    cloudpickle ships it by reference, and Ray Train still sees one `config` parameter."""
    return functools.partial(_train_with_secrets, train_func)


def _train_with_secrets(train_func, config: dict):
    config = dict(config)
    receive_secrets(config.pop(RELAY_CONFIG, None))
    return train_func(config)


def receive_secrets(relay: tuple | None) -> None:
    """Set in os.environ the secrets the driver has and this process lacks, from the relay the driver
    gave this worker (the job's control actor and the capability it asks for; the runtime_env says
    which names, never a value). Never
    raises: without them, the job fails at their first use with that use's own message (e.g.
    signing's "no signing key")."""
    wanted = [n for n in os.environ.get(WANTED_ENV, "").split(",") if n]
    missing = [n for n in wanted if n not in _present(wanted, os.environ.get(KEY_ID_ENV))]
    if not missing or relay is None:
        return
    import ray

    try:
        actor, capability = relay
        values = ray.get(actor.give.remote(missing, capability), timeout=RELAY_TIMEOUT_S)
    except ray.exceptions.RayError as exc:  # the driver (and its relay) is gone
        print(
            f"[raytrain] this node lacks {', '.join(missing)} and the driver's secret relay did not answer "
            f"({type(exc).__name__}); going on without them: set them on the node",
            flush=True,
        )
        return
    os.environ.update(values)
    if values:
        print(
            f"[raytrain] this node lacks {', '.join(values)}: received from the driver for this worker (values "
            "never shown); setting them on the node is the better way (cluster/*.yaml, or the Secret "
            "raytrain-secrets on Kubernetes)",
            flush=True,
        )


# What the driver hands Ray Train: a partial, so cloudpickle ships it by reference (this module,
# torch-free) and Ray Train still sees one `config` parameter.
train_func = with_secrets(_run_worker)
