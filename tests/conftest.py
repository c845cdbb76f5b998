"""Shared fixtures: one real local Ray cluster for the whole session, and the offline demo
model/tokenizer/data built once (the same files `raytrain quickstart` makes)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from raytrain.config import JobSpec
from raytrain.demo_assets import make_all

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return make_all(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def ray_address():
    """A real local Ray cluster (6 logical CPUs on 2 cores: 2 train workers + Ray Data)."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=True)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


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
        "training": {"strategy": "fsdp2", "finetune": "lora", "global_batch_size": 8, "micro_batch_size": 2,
                     "max_steps": 10, "seed": 0, "lora": {"rank": 4, "alpha": 8}},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(storage), "every_n_steps": 5, "keep_last": 2},
        "tracking": {"experiment": "tests"},
    }
    return JobSpec.model_validate(deep_merge(base, over))


def metric_history(spec: JobSpec, run_id: str, key: str = "loss") -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    from raytrain.tracking import tracking_uri

    history = MlflowClient(tracking_uri(spec)).get_metric_history(run_id, key)
    return {m.step: m.value for m in history}
