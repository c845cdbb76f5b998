"""Every job file in jobs/ validates, with its probes (litgpt's config hub: a shipped recipe
that does not validate is a bug). Run from a fresh directory holding the quickstart's
demo assets where `raytrain quickstart` puts them.

What this machine cannot reach offline is skipped honestly, never passed silently: a hub
id that is not in the local Hugging Face cache, an s3:// bucket or an MLflow host that does
not resolve here must each come back as a note naming its field (`raytrain run` turns
the unreachable ones into errors). With the model's config.json in the cache, the memory
estimate is checked against the job's declared accelerator memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import KNOWN_CONFIGS, hub_cache
from test_validate import cli

from raytrain.job.plan import RunPlan
from raytrain.job.spec import DataSpec
from raytrain.rundir import storage

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))


@pytest.fixture
def workdir(assets, tmp_path) -> Path:
    (tmp_path / ".raytrain").mkdir()
    (tmp_path / ".raytrain" / "quickstart").symlink_to(assets)
    # jobs/grpo-tools.yaml starts from jobs/grpo-tools-sft.yaml's export: here the model that job starts
    # from stands in for it (the same architecture, tokenizer and chat template; test_rl_agents.py runs both)
    (tmp_path / "runs" / "grpo-tools-sft").mkdir(parents=True)
    (tmp_path / "runs" / "grpo-tools-sft" / "final_model").symlink_to(assets / "model-tools")
    return tmp_path


def unreachable_here(job: dict, workdir: Path) -> set[str]:
    """The fields of a job that point outside this offline machine."""
    out = set()
    model = job["model"]["path"]
    if not (workdir / model).exists() and not Path(model).exists():
        out.add("model.path")
    out |= {
        field for field, data in DataSpec.model_validate(job["data"]).named_inputs() if storage.is_remote(data.path)
    }
    if storage.is_remote((job.get("checkpoint") or {}).get("storage_path", "")):
        out.add("checkpoint.storage_path")
    if str((job.get("tracking") or {}).get("uri") or "").startswith("http"):
        out.add("tracking.uri")
    return out


def test_there_are_jobs():
    assert {"quickstart.yaml", "llama3-8b-lora-fsdp2.yaml"} <= {p.name for p in JOBS}


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_file_validates_and_says_what_it_could_not_check(job, workdir):
    code, out, err = cli(
        "validate", str(job), "--json", cwd=workdir, env={"HF_HUB_CACHE": str(workdir / "empty-cache")}
    )
    report = json.loads(out)
    assert code == 0 and report["valid"], report["problems"] or err
    noted = {n["field"] for n in report["notes"]}
    assert unreachable_here(yaml.safe_load(job.read_text()), workdir) <= noted, report["notes"]
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "job", [p for p in JOBS if yaml.safe_load(p.read_text())["model"]["path"] in KNOWN_CONFIGS], ids=lambda p: p.name
)
def test_hub_model_job_fits_its_declared_memory_and_less_is_refused(job, workdir):
    """The declared accelerator memory holds what every rank must keep whatever the estimator
    says (counted here from the model's config: the trained weights' fp32 masters, gradients and
    AdamW moments, or a LoRA job's frozen base, over the shard group), and validate refuses the
    same job with less than that, naming the field: a job that cannot fit is rejected in seconds."""
    from raytrain.job.spec import JobSpec

    raw = yaml.safe_load(job.read_text())
    hub_id = raw["model"]["path"]
    env = hub_cache(workdir / "hf-cache", hub_id)
    spec = JobSpec.model_validate(raw)
    floor_gib = held_per_rank(KNOWN_CONFIGS[hub_id], spec) / 2**30
    assert raw["scaling"]["accelerator_memory_gb"] >= floor_gib, (job.name, floor_gib)
    code, out, err = cli("validate", str(job), "--json", cwd=workdir, env=env)
    report = json.loads(out)
    assert code == 0, report["problems"] or err
    [memory] = [n for n in report["notes"] if n["field"] == "scaling.accelerator_memory_gb"]
    assert memory["message"].startswith("fits: ") and memory["value"] == f"{raw['scaling']['accelerator_memory_gb']:g}"

    raw["scaling"]["accelerator_memory_gb"] = max(1, int(floor_gib) - 1)
    smaller = workdir / job.name
    smaller.write_text(yaml.safe_dump(raw))
    code, out, err = cli("validate", str(smaller), "--json", cwd=workdir, env=env)
    report = json.loads(out)
    assert code != 0 and "scaling.accelerator_memory_gb" in {p["field"] for p in report["problems"]}, report


def held_per_rank(config: dict, spec) -> float:
    """Bytes a rank keeps for the whole run, from the config alone (no activations, no buffers)."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    bias = h + 2 * kv if config["model_type"] == "qwen2" else 0  # Qwen2's q/k/v biases
    per_layer = 2 * h * h + 2 * h * kv + bias + 3 * h * config["intermediate_size"] + 2 * h
    params = vocab * h * (1 if config.get("tie_word_embeddings") else 2) + layers * per_layer + h
    shards = RunPlan.of(spec).shard_degree(spec.scaling.worker_range[0]) if spec.training.strategy != "ddp" else 1
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[spec.model.dtype]
    if spec.training.finetune == "full":  # fp32 master or its 16-bit copy + fp32 moments + a gradient: >= 14 B
        return 14 * params / shards
    if spec.training.finetune == "qlora":  # the linear layers' weights in NF4: >= 4 bits and a byte a block of 64
        linear = layers * (per_layer - 2 * h - bias)
        return (linear * (0.5 + 1 / 64) + dtype_bytes * (params - linear)) / shards
    return dtype_bytes * params / shards


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_a_job_validates_again_from_what_the_workers_receive(job, workdir):
    """The workers validate the spec again from its whole dump (rundir/job_file.py: every field set):
    each rule must hold there as on the driver. Stop 65's GRPO jobs failed in every worker on a rule
    that read `model_fields_set` (environment_workers "set" because dumped)."""
    from raytrain.job.spec import JobSpec

    spec = JobSpec.model_validate(yaml.safe_load(job.read_text()))
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec
