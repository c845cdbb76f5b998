"""cluster/: the Ray cluster-launcher YAMLs for AWS and GCP, validated by Ray's own cluster
config schema (the file as written, then merged with the provider defaults as `ray up` does);
their invariants (on-demand head that runs no training, autoscaling spot GPU workers big
enough for every GPU job in jobs/, dashboard private, token auth, spot notices drained);
and the local cluster script's syntax (tests/test_deploy.py runs it for real)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from conftest import REPO
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain.job.spec import JobSpec

CONFIGS = {"aws": REPO / "cluster" / "aws.yaml", "gcp": REPO / "cluster" / "gcp.yaml"}
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, whatever PATH says
GPU_JOBS = [
    s
    for s in (JobSpec.model_validate(yaml.safe_load(p.read_text())) for p in sorted((REPO / "jobs").glob("*.yaml")))
    if s.scaling.use_gpu
]


def load(cloud: str) -> dict:
    return yaml.safe_load(CONFIGS[cloud].read_text())


def is_spot(cloud: str, node_config: dict) -> bool:
    if cloud == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    scheduling = node_config.get("scheduling", {})
    return scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True


@pytest.mark.parametrize("cloud", sorted(CONFIGS))
def test_rays_own_schema_accepts_the_file_and_the_prepared_config(cloud):
    config = load(cloud)
    jsonschema.validate(config, RAY_SCHEMA)  # the file itself: no unknown or mistyped keys
    prepared = prepare_config(copy.deepcopy(config))  # merged with Ray's provider defaults, as `ray up` does
    validate_config(prepared)
    assert prepared["provider"]["type"] == cloud
    # What we set survives the defaults (they would otherwise bind the dashboard to 0.0.0.0).
    assert prepared["head_start_ray_commands"] == config["head_start_ray_commands"]


@pytest.mark.parametrize("cloud", sorted(CONFIGS))
def test_on_demand_head_and_autoscaling_spot_gpu_workers(cloud):
    config = load(cloud)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not head["resources"].get("GPU")  # no training on the head
    assert not is_spot(cloud, head["node_config"])
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(is_spot(cloud, t["node_config"]) for t in workers)
    assert all(t["resources"].get("GPU", 0) >= 1 for t in workers)
    # Autoscaling from zero, up to the largest GPU job in jobs/, with room for Ray Data per worker
    # and, for a job that places workers_per_node on each node, nodes with that many GPUs.
    assert all(t["min_workers"] == 0 for t in workers)
    assert sum(t["max_workers"] for t in workers) <= config["max_workers"]
    assert GPU_JOBS, "jobs/ has no GPU job to size the cluster for"
    for spec in GPU_JOBS:
        _, hi = spec.scaling.worker_range
        fits = [
            t
            for t in workers
            if t["resources"]["CPU"] / t["resources"]["GPU"] >= spec.scaling.cpus_per_worker + 1
            and t["resources"]["GPU"] >= (spec.scaling.workers_per_node or 1)
        ]
        assert sum(t["max_workers"] * t["resources"]["GPU"] for t in fits) >= hi, spec.name


@pytest.mark.parametrize("cloud", sorted(CONFIGS))
def test_private_dashboard_token_auth_and_spot_notices_become_ray_drains(cloud):
    config = load(cloud)
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert "~/.ray/auth_token" in config["file_mounts"]
    # The same signing key on every node and launch; only the package and the jobs from the
    # checkout (never the whole of it: .venv, runs/, an .env), and nothing .gitignore names.
    assert config["file_mounts"]["~/.raytrain/checkpoint.key"] == "~/.raytrain/checkpoint.key"
    shipped = {src for src in config["file_mounts"].values() if not src.startswith("~/")}
    assert shipped == {"./raytrain", "./jobs", "./pyproject.toml", "./README.md", "./k8s/constraints.txt"}
    assert all((REPO / src).exists() for src in shipped)
    assert config["rsync_filter"] == [".gitignore"] and "**/.env" in config["rsync_exclude"]
    assert "RAY_JOB_STOP_WAIT_TIME_S=" in head_start  # `ray job stop` leaves time for a checkpoint
    help_text = subprocess.run([RAY, "drain-node", "--help"], capture_output=True, text=True, check=True).stdout
    (drain,) = re.findall(r"ray drain-node[^']*", worker_start)
    for flag in (w for w in drain.split() if w.startswith("--")):
        assert flag in help_text, flag
    assert "DRAIN_NODE_REASON_PREEMPTION" in drain and "DRAIN_NODE_REASON_PREEMPTION" in help_text
    for command in config["setup_commands"] + config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        subprocess.run(["bash", "-n", "-c", command], check=True)
    text = CONFIGS[cloud].read_text()
    assert not re.search(r"(?i)(secret|password|aws_access_key_id|hf_[a-z0-9]{20,})\s*[:=]\s*\S", text)


def test_local_cluster_script_is_valid_bash_and_never_runs_ray_stop():
    script = REPO / "cluster" / "local-cluster.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.stat().st_mode & 0o111, "cluster/local-cluster.sh must be executable"
    code = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
    # `ray stop` would kill every Ray cluster of this user on the machine, not just this one.
    assert not re.search(r"\bray stop\b", code)
    assert "--node-ip-address 127.0.0.1" in code and "--dashboard-host 127.0.0.1" in code
