"""Pre-flight: everything that can be checked on the driver, in seconds, before Ray starts
or a GPU is allocated. Every problem is collected (not just the first) and names the YAML
path, the bad value and the fix. No torch import here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from . import storage
from .config import JobSpec, apply_overrides
from .problems import Problem, from_validation_error

SECRET_KEY = re.compile(r"(token|secret|password|passwd|api[_-]?key|access[_-]?key|credential)", re.I)
OVERRIDE_ALIASES = {"train.": "training.", "optim.": "optimizer.", "ckpt.": "checkpoint."}


def load_raw(path: str, overrides: list[str]) -> tuple[dict | None, list[Problem]]:
    file = Path(path)
    if not file.is_file():
        return None, [Problem("(job file)", repr(path), "no such file; pass the path of a job YAML, e.g. jobs/quickstart.yaml", "file")]
    try:
        raw = yaml.safe_load(file.read_text())  # safe_load only: a job file never runs code
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        return None, [Problem("(job file)", repr(path), f"not valid YAML at {where}: {getattr(exc, 'problem', exc)}", "file")]
    if not isinstance(raw, dict):
        return None, [Problem("(job file)", repr(path), "a job is a YAML mapping with name:, model:, data:, ...", "file")]
    fixed = []
    for text in overrides:
        for short, full in OVERRIDE_ALIASES.items():
            text = full + text[len(short):] if text.startswith(short) else text
        fixed.append(text)
    try:
        return apply_overrides(raw, fixed), []
    except ValueError as exc:
        return None, [Problem("--set", "", str(exc), "file")]


def secret_problems(tree, prefix: str = "") -> list[Problem]:
    out = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if SECRET_KEY.search(str(key)) and isinstance(value, (str, int)) and value not in ("", None):
                out.append(Problem(name, "<redacted>", "secrets do not belong in a job file (it is logged to MLflow "
                                   "and stored with the run); remove it and export it as an environment variable "
                                   "(e.g. HF_TOKEN, AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD)", "security"))
            else:
                out.extend(secret_problems(value, name + "."))
    return out


def absolutize(raw: dict, base: str) -> dict:
    """Workers run in another directory: local paths become absolute on the driver. A model
    path that is not a local folder is left alone (a hub id)."""
    model, data, ck = raw.get("model") or {}, raw.get("data") or {}, raw.get("checkpoint") or {}
    for section, key, always in ((model, "path", False), (model, "tokenizer", False), (data, "path", True),
                                 (ck, "storage_path", True)):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, str) and value and not storage.is_remote(value):
            if always or Path(base, value).exists():
                section[key] = storage.absolute(value, base)
    return raw


def check_job(path: str, overrides: list[str] = (), probes: bool = True) -> tuple[JobSpec | None, list[Problem]]:
    raw, problems = load_raw(path, list(overrides))
    if raw is None:
        return None, problems
    problems += secret_problems(raw)
    raw = absolutize(raw, os.getcwd())
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        return None, problems + from_validation_error(exc)
    if problems:
        return None, problems
    if probes:
        problems += probe(spec)
    return (None if problems else spec), problems


# ---------------------------------------------------------------- probes of the world outside the YAML
def probe(spec: JobSpec) -> list[Problem]:
    return model_problems(spec) + data_problems(spec) + storage_problems(spec)


def _local_model_config(spec: JobSpec) -> dict | None:
    config = Path(spec.model.path, "config.json")
    return json.loads(config.read_text()) if config.is_file() else None


def model_problems(spec: JobSpec) -> list[Problem]:
    path = spec.model.path
    if Path(path).is_absolute() and not Path(path).exists():
        return [Problem("model.path", repr(path), "no such folder; give a local model folder or a hub id like meta-llama/Llama-3.1-8B", "model")]
    config = _local_model_config(spec)
    if config is None:
        if Path(path).is_dir():
            return [Problem("model.path", repr(path), "folder has no config.json; point at a Hugging Face model folder", "model")]
        return []  # a hub id: read on the cluster, where the hub is reachable
    out = []
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        out.append(Problem("model.path", repr(path), f"architecture {archs} is not a causal LM (…ForCausalLM)", "model"))
    if config.get("auto_map") and not spec.model.trust_remote_code:
        out.append(Problem("model.trust_remote_code", "false", "this model ships its own code (auto_map); "
                           "set model.trust_remote_code: true if you trust it", "security"))
    window = config.get("max_position_embeddings") or config.get("n_positions")
    if window and spec.data.seq_len > window:
        out.append(Problem("data.seq_len", str(spec.data.seq_len), f"longer than the model's context window ({window}); "
                           f"use data.seq_len <= {window}", "model"))
    return out


def data_problems(spec: JobSpec) -> list[Problem]:
    path = spec.data.path
    if storage.is_remote(path):
        return []  # probed by storage_problems' reachability on the cluster side
    p = Path(path)
    if not p.exists():
        return [Problem("data.path", repr(path), "no such file or folder; give a .jsonl/.parquet file or a folder of them", "data")]
    files = sorted(f for f in ([p] if p.is_file() else p.rglob("*")) if f.suffix in (".jsonl", ".json", ".parquet"))
    if not files:
        return [Problem("data.path", repr(path), "no .jsonl, .json or .parquet files there", "data")]
    return []


def storage_problems(spec: JobSpec) -> list[Problem]:
    why = storage.probe_writable(spec.checkpoint.storage_path)
    if why:
        return [Problem("checkpoint.storage_path", repr(spec.checkpoint.storage_path),
                        f"not writable ({why}); choose a folder or bucket this job may write to", "storage")]
    return []
