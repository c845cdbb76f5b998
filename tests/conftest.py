"""Shared fixtures: one real local Ray cluster for the whole session, and the offline demo
model/tokenizer/data built once (the same files `raytrain quickstart` makes)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from raytrain.demo_assets import make_all
from raytrain.job.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
# The session's checkpoint-signing key, as a cluster's Secret would set it on every node: the
# Ray cluster below inherits it, and no test writes ~/.raytrain.
os.environ.setdefault("RAYTRAIN_CHECKPOINT_KEY", secrets.token_hex(32))


# The published config.json of hub models the shipped jobs use (what `hf download ID config.json`
# fetches): with one in a Hugging Face cache, validate and `raytrain k8s` see the model's size.
KNOWN_CONFIGS = {
    "meta-llama/Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    "meta-llama/Llama-3.1-70B": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    },
    "Qwen/Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 152064,
    },
}


def hub_cache(root: Path, *hub_ids: str) -> dict:
    """A Hugging Face cache under `root` holding only these models' config.json, laid out as the
    hub client lays it out; returns the environment that points at it."""
    for hub_id in hub_ids:
        repo = root / f"models--{hub_id.replace('/', '--')}"
        (repo / "snapshots" / "0e9e39f").mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("0e9e39f")
        (repo / "snapshots" / "0e9e39f" / "config.json").write_text(json.dumps(KNOWN_CONFIGS[hub_id]))
    return {"HF_HUB_CACHE": str(root)}


# The suite runs in two lanes (pytest-xdist, `-n 2 --dist loadfile` in pyproject.toml): each lane takes
# the next module when it is nearly done with its last. Most of a module's time is waiting on Ray, a
# subprocess or a restart, so two lanes fill two cores where one left a fifth of them idle; the longest
# modules go first (measured, `--durations`), so that none starts last and runs on alone.
LONGEST_FIRST = (  # lane-seconds from the lane summary of a clean-clone run at eb71ff9, in that run's order
    "test_combinations.py",  # 1237; 1414 at stop 72 beside miniature and vllm, 700 s of it its 7 compiled cases
    "test_operations.py",  # 732, before the MLflow server's job runner was turned off (the outage test: 136 s)
    "test_fault_tolerance.py",  # 671
    "test_miniature_jobs.py",  # 461; 585 at stop 72 beside combinations
    "test_rl_agents.py",  # 1179, before its killed run stopped at step 10 (f3e9cb8)
    "test_vllm.py",  # 630; 537 at stop 72 (its killed run B gone to rl_agents' calculator B) beside combinations
    "test_strategies.py",  # 370 at f6c4196
    "test_preference.py",  # 324
    "test_deploy.py",  # 437
    "test_elastic.py",  # 352
    "test_rl.py",  # 329
    "test_spine.py",  # 262
    "test_qlora.py",  # 222
    "test_store.py",  # 133 at f6c4196, and the rest
    "test_benchmarks_smoke.py",
    "test_meshes.py",
    "test_mesh.py",
    "test_supply_chain.py",
    "test_loading.py",
    "test_moe.py",
    "test_agents.py",
    "test_validate.py",
    "test_bad_rows.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a module, its own order


_LANES: dict[str, dict] = {}  # the controller's view of each lane: its busy seconds, first start, last stop


def pytest_runtest_logreport(report) -> None:
    node = getattr(report, "node", None)  # xdist's lane that ran it (absent in a one-lane run)
    lane = _LANES.setdefault(getattr(getattr(node, "gateway", None), "id", "main"), {"busy": 0.0, "modules": {}})
    lane["busy"] += report.duration
    module = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    lane["modules"][module] = lane["modules"].get(module, 0.0) + report.duration
    if report.start:
        lane["first"] = min(lane.get("first", report.start), report.start)
        lane["last"] = max(lane.get("last", report.stop), report.stop)


def pytest_terminal_summary(terminalreporter) -> None:
    """One line a lane: how long it was busy, when it went idle, its modules of 30 s or more (to order
    LONGEST_FIRST by, and to see a lane that ran on alone)."""
    if not _LANES:
        return
    start = min(lane.get("first", 0) for lane in _LANES.values())
    for name, lane in sorted(_LANES.items()):
        top = [kv for kv in sorted(lane["modules"].items(), key=lambda kv: -kv[1]) if kv[1] >= 30]
        terminalreporter.write_line(
            f"lane {name}: busy {lane['busy']:.0f} s, idle from {lane.get('last', start) - start:.0f} s; "
            + ", ".join(f"{m.removeprefix('test_').removesuffix('.py')} {t:.0f}" for m, t in top)
        )


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return make_all(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def split_model(assets, tmp_path_factory) -> Path:
    """The demo model stored in bf16 over several safetensors files (with an index), as hub models are."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("split") / "model"
    AutoModelForCausalLM.from_pretrained(str(assets / "model"), dtype=torch.bfloat16).save_pretrained(
        str(folder), max_shard_size="40KB"
    )
    for f in assets.joinpath("model").glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    assert len(list(folder.glob("*.safetensors"))) >= 3 and (folder / "model.safetensors.index.json").exists()
    return folder


INJECT = Path(__file__).resolve().parent / "inject"  # the fault injector (inject/sitecustomize.py)


def with_fault_injection(plan_file: Path) -> None:
    """Before a cluster starts: its Python processes load the injector and read `plan_file`."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")]))
    os.environ["RAYTRAIN_TEST_FAULTS"] = str(plan_file)


def write_plan(plan_file: Path, faults: list[dict], marker_dir: Path) -> None:
    marker_dir.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps({"dir": str(marker_dir), "faults": faults}))


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "plan.json"


@pytest.fixture(scope="session")
def ray_address(plan_file):
    """A real local Ray cluster (6 logical CPUs on 2 cores: 2 train workers + Ray Data), whose
    processes load the fault injector (tests/inject): a test arms it with `inject_faults`."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with_fault_injection(plan_file)
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=True)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def inject_faults(ray_address, plan_file, tmp_path):
    """inject_faults([{"at": "step", "step": 6, "rank": 1, "action": "exit"}, ...]) arms the
    cluster's injector for this test; it is disarmed afterwards."""
    yield lambda faults: write_plan(plan_file, faults, tmp_path / "fault-markers")
    plan_file.unlink(missing_ok=True)


def mlflow_server_env() -> dict[str, str]:
    """The plain MLFLOW_* settings k8s/mlflow.yaml gives `mlflow server` (not its secrets), so that the
    tests' servers run as the deployed one does (its job runner off, for one)."""
    docs = yaml.safe_load_all((REPO / "k8s" / "mlflow.yaml").read_text())
    (deployment,) = [d for d in docs if d and d.get("kind") == "Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "mlflow"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"].startswith("MLFLOW_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """(environment, boto3 client) of a real S3 API on loopback: moto in server mode, with the
    dummy credentials it accepts. Each user makes its own bucket."""
    import boto3

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    for _ in range(300):
        assert proc.poll() is None, f"moto_server exited with {proc.returncode}"
        try:
            client.list_buckets()
            break
        except Exception:  # not up yet
            time.sleep(0.2)
    yield env, client
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def make_job(assets: Path, storage: Path, **over) -> JobSpec:
    """A small valid job on the demo assets; keyword sections override (deep-merged)."""
    base = {
        "name": "t",
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "text.jsonl"), "seq_len": 32, "shuffle_window": 64},
        "training": {
            "strategy": "fsdp2",
            "finetune": "lora",
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 10,
            "seed": 0,
            "lora": {"rank": 4, "alpha": 8},
        },
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(storage), "every_n_steps": 5, "keep_last": 2},
        "tracking": {"experiment": "tests"},
    }
    return JobSpec.model_validate(deep_merge(base, over))


def shipped_grpo_job(job_file: str, model: str, assets: Path, storage: Path, name: str, steps: int, **over) -> JobSpec:
    """A shipped GRPO job (jobs/<job_file>) as users run it, on the demo assets' `model` folder and
    prompts, checkpointing every 5 steps, one restart allowed; keyword sections override (deep-merged)."""
    raw = yaml.safe_load((REPO / "jobs" / job_file).read_text())
    raw = deep_merge(
        raw,
        {
            "name": name,
            "model": {"path": str(assets / model)},
            "data": {"path": str(assets / "prompts.jsonl")},
            "checkpoint": {"storage_path": str(storage), "every_n_steps": 5, "keep_last": 3},
            "training": {"max_steps": steps},
            "failure": {"max_failures": 1},
            "tracking": {"experiment": "tests"},
        },
    )
    return JobSpec.model_validate(deep_merge(raw, over))


class Planted:
    """Unpickling it creates a file: what a forged checkpoint file would do on a worker."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@contextlib.contextmanager
def altered(run_dir):
    """`run_dir` to tamper with in place for one case, put back as it was afterwards. In place,
    since signed files name their run directory: a copy elsewhere is refused for that first."""
    backup = Path(tempfile.mkdtemp(prefix="raytrain-backup-")) / "run"
    shutil.copytree(run_dir, backup)
    try:
        yield Path(run_dir)
    finally:
        shutil.rmtree(run_dir)
        shutil.move(str(backup), str(run_dir))
        shutil.rmtree(backup.parent, ignore_errors=True)


@contextlib.contextmanager
def without_checkpoint(run_dir, step: int):
    """The storage holding `run_dir`, its step-`step` checkpoint and its export deleted (as a user
    deletes a folder): the same job there resumes from the checkpoint before. Put back as it was
    afterwards, for the other tests that share the run."""
    with altered(run_dir) as here:
        shutil.rmtree(here / f"step_{step:08d}")
        shutil.rmtree(here / "final_model", ignore_errors=True)
        yield here.parent


def warm_forkserver(spec: JobSpec, timeout_s: float = 300) -> None:
    """Wait until this lane's node forks `spec`'s workers from its warm server (train/forkserver.py): the
    driver's warm-up tasks, until one runs forked."""
    import ray

    from raytrain.driver.worker_env import warm_nodes

    deadline = time.time() + timeout_s
    while not all(ray.get(warm_nodes(spec))):
        assert time.time() < deadline, "the node's fork server did not become ready"
        time.sleep(1)


def ray_train_workers(marker: str) -> set[int]:
    """PIDs of the Ray Train workers of the Ray instance whose temp dir or session name is `marker`: the workers
    whose standard output is a log file of that session, as the raylet opens one for each worker it starts,
    forked (train/forkserver.py: the launcher hands its streams to the child) or not. A fork server serves
    every cluster on the machine, so its process tree says nothing of which one a worker is of."""
    import psutil

    pids = set()
    for proc in psutil.process_iter(["cmdline"]):
        if " ".join(proc.info["cmdline"] or []).startswith("ray::RayTrainWorker"):
            with contextlib.suppress(OSError):  # it may exit meanwhile
                if marker in os.readlink(f"/proc/{proc.pid}/fd/1"):
                    pids.add(proc.pid)
    return pids


def session_of(pid: int) -> str:
    """The session name of the Ray instance a process (a driver with a local instance) started."""
    import psutil

    for proc in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for arg in proc.cmdline() if proc.name() == "raylet" else ():
                if arg.startswith("--session-name="):
                    return arg.split("=", 1)[1]
    raise AssertionError(f"no raylet under pid {pid}")


def metric_history(spec: JobSpec, run_id: str, key: str = "loss") -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    from raytrain.tracking.mlflow_run import tracking_uri

    history = MlflowClient(tracking_uri(spec)).get_metric_history(run_id, key)
    return {m.step: m.value for m in history}


def through(history: dict[int, float], step: int) -> dict[int, float]:
    """A metric's history up to `step`: what a shorter run of the same job logs, where the schedule is
    constant (a killed run that stops early is compared with the uninterrupted run so)."""
    return {s: v for s, v in history.items() if s <= step}


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256sum of a model folder's weight files, by name."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors"))}
