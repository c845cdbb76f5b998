"""Probes of the world outside the job file: the dataset's first rows, the checkpoint
storage (a probe write and delete), the MLflow tracking server.

Each probe is quick (short timeouts, a few KB read) and honest about what it could not
reach: a host that does not resolve from here (a laptop validating a job whose bucket or
MLflow server lives inside the cluster) is a note under `raytrain validate`. Under
`raytrain run` (`network_required`) it is an error: the driver itself writes the run
directory, lists the dataset and opens the MLflow run, so it must reach all three.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from raytrain.data import FILE_EXTENSIONS, to_value
from raytrain.data.pairs import record_of, to_margin, to_pair
from raytrain.data.prompts import to_prompt
from raytrain.data.sources import list_sources, sample_rows
from raytrain.data.unpaired import to_unpaired
from raytrain.job.data import DEFAULT_COLUMNS, DEFAULT_TAGS
from raytrain.job.grpo import reward_model_base
from raytrain.job.spec import JobSpec
from raytrain.rundir import storage, versioned
from raytrain.tracking.mlflow_run import REMOTE_WITHOUT_SERVER, tracking_uri
from raytrain.validate.problems import NOTE, Problem, did_you_mean, is_hub_id

TIMEOUT_S = 3.0
SAMPLE_FILES, SAMPLE_ROWS = 8, 20
# Failures that mean "could not get there", as opposed to "got there and was refused".
_UNREACHABLE = re.compile(
    r"NETWORK_CONNECTION|resolve host|curlCode: (6|7|28)|timed out|Name or service not known|"
    r"name resolution|Network is unreachable",
    re.I,
)


def _resolve_error(host: str) -> str | None:
    """None if `host` resolves; else why not. In a thread: a slow resolver must not hang validate."""
    result: dict = {}

    def lookup():
        try:
            socket.getaddrinfo(host, None)
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        return f"looking up {host} took over {TIMEOUT_S:.0f}s"
    return f"{host} does not resolve here ({result['error']})" if "error" in result else None


def _object_store_host(uri: str) -> str | None:
    if uri.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        return urllib.parse.urlparse(endpoint).hostname if endpoint else "s3.amazonaws.com"
    if uri.startswith(("gs://", "gcs://")):
        return "storage.googleapis.com"
    return None


def unreachable(field: str, value: str, why: str, network_required: bool, kind: str) -> Problem:
    if network_required:
        return Problem(
            field,
            repr(value),
            f"cannot be reached from this machine ({why}); the driver of a run must "
            "reach it: fix the address or the network, or run from inside the cluster",
            kind,
        )
    return Problem(
        field,
        repr(value),
        f"not checked: cannot be reached from this machine ({why}); "
        "`raytrain run` checks it again from the driver and refuses the job if it is unreachable there",
        kind,
        NOTE,
    )


# ---------------------------------------------------------------- dataset
def data_problems(spec: JobSpec, network_required: bool = False) -> list[Problem]:
    return [
        p
        for field, data in spec.data.named_inputs()
        for p in dataset_problems(data, field, network_required, spec.row_kind)
    ]


def dataset_problems(d, field: str, network_required: bool, pairs: bool | str = False) -> list[Problem]:
    """One dataset's files and first rows, as the prepare step will read them (`pairs`: preference
    pairs, or "kto" for unpaired labelled rows)."""
    path = d.path
    host = _object_store_host(path)
    why = _resolve_error(host) if host else None
    if why:
        return [unreachable(field, path, why, network_required, "data")]
    try:
        fs, root = storage.filesystem(path)
        try:
            files = [s.path for s in list_sources(fs, root)]  # the files the prepare step reads, by the same rule
        except FileNotFoundError:
            return [
                Problem(
                    field,
                    repr(path),
                    "no such file or folder, and no match for a glob; give a "
                    ".jsonl/.json/.parquet file, a folder or a glob of them",
                    "data",
                )
            ]
        if not files:
            return [
                Problem(
                    field,
                    repr(path),
                    f"no .{', .'.join(FILE_EXTENSIONS)} files there "
                    "(the only formats raytrain reads); convert the data or point at the right folder",
                    "data",
                )
            ]
        rows = [(f, n, raw) for f in files[:SAMPLE_FILES] for n, raw in sample_rows(fs, f, SAMPLE_ROWS)]
    except (OSError, ValueError) as exc:  # unreadable, not a JSON array, not parquet, ...: a message, not a traceback
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if host and _UNREACHABLE.search(text):
            return [unreachable(field, path, text, network_required, "data")]
        return [Problem(field, repr(path), f"cannot read it ({text})", "data")]
    return row_problems(d, rows, path, field, pairs)


def _decoded(row):
    """A sample row as a JSON object where it is one (for the column check), else None."""
    if isinstance(row, (bytes, str)):
        try:
            return json.loads(row)
        except ValueError:
            return None
    return row


REQUIRED_COLUMNS = {
    "text": ("text",),
    "chat": ("messages",),
    "sharegpt": ("messages",),
    "alpaca": ("prompt", "response"),
}
PAIR_COLUMNS = {
    "text": ("prompt", "chosen", "rejected"),
    "chat": ("chosen", "rejected"),  # chat: prompt may be implicit
    "sharegpt": ("messages", "chosen", "rejected"),
    "alpaca": ("prompt", "chosen", "rejected"),
}
UNPAIRED_COLUMNS = {
    "text": ("prompt", "completion", "label"),
    "chat": ("label",),  # chat: prompt + completion, or messages
    "sharegpt": ("messages", "label"),
    "alpaca": ("prompt", "response", "label"),
}


def _format_of(columns: set[str]) -> str | None:
    """The format whose default columns the rows have (a hint for a wrong data.format)."""
    for fmt, names in REQUIRED_COLUMNS.items():
        if all(DEFAULT_COLUMNS[fmt][n] in columns for n in names):
            return fmt
    return None


def _row_kind(pairs: bool | str) -> str:
    """What a row is, in a message: `pairs` as the job's row kind gives it (JobSpec.row_kind)."""
    return {"kto": "unpaired feedback ", "prompt": "prompt "}.get(pairs, "preference " if pairs else "")


def mapping_problems(d, records: list[dict], n_rows: int, pairs: bool | str = False) -> list[Problem]:
    """A required column, or a turn key, that none of the first rows has: named, with the fix."""
    seen = set().union(*(set(r) for r in records)) if records else set()
    if not seen:
        return []
    wanted = (
        (("prompt",) if d.format == "prompt" else REQUIRED_COLUMNS[d.format])
        if pairs == "prompt"
        else (UNPAIRED_COLUMNS if pairs == "kto" else PAIR_COLUMNS if pairs else REQUIRED_COLUMNS)[d.format]
    )
    for name in wanted:
        column = d.column(name)
        if not any(column in r for r in records):
            fmt = _format_of(seen)
            hint = f"; these rows look like {fmt} data: set data.format: {fmt}" if fmt and fmt != d.format else ""
            if not pairs and {"chosen", "rejected"} <= seen:
                hint = "; these rows are preference pairs: set training.objective: dpo (or simpo, or reward)"
            if not pairs and "label" in seen:
                hint = "; these rows are labelled feedback: set training.objective: kto"
            return [
                Problem(
                    f"data.columns.{name}",
                    repr(column),
                    f"no such column in the first {n_rows} rows (columns "
                    f"there: {', '.join(sorted(seen))}); {did_you_mean(column, seen)}set data.columns.{name} to "
                    f"one of them{hint}",
                    "data",
                )
            ]
    if d.format in ("chat", "sharegpt"):
        turns = [t for r in records for t in (r.get(d.column("messages")) or []) if isinstance(t, dict)]
        keys = set().union(*(set(t) for t in turns)) if turns else set()
        for tag in ("role_tag", "content_tag"):
            if keys and d.tag(tag) not in keys:
                other = next((f for f, tags in DEFAULT_TAGS.items() if f != d.format and tags[tag] in keys), None)
                hint = f" (these are {other} keys: set data.format: {other})" if other else ""
                return [
                    Problem(
                        f"data.tags.{tag}",
                        repr(d.tag(tag)),
                        f"no such key in the turns of the first {n_rows} "
                        f"rows (keys there: {', '.join(sorted(keys))}); set data.tags.{tag}{hint}",
                        "data",
                    )
                ]
    return []


def row_problems(
    d, rows: list[tuple[str, int, object]], path: str, field: str = "data.path", pairs: bool | str = False
) -> list[Problem]:
    """The first rows against the format and mapping, with the checks the prepare step applies per row."""
    if not rows:
        return [Problem(field, repr(path), "the files hold no rows", "data")]
    records, bad = [], []
    for file, n, raw in rows:
        record = _decoded(raw)
        if isinstance(record, dict):
            records.append(record)
        try:
            to_prompt(d, raw) if pairs == "prompt" else to_unpaired(d, raw) if pairs == "kto" else to_pair(
                d, raw
            ) if pairs else to_value(d, raw)
            if pairs == "reward":
                to_margin(d, record_of(raw))
        except ValueError as why:
            bad.append(f"{file} row {n}: {why}")
    mapping = mapping_problems(d, records, len(rows), pairs)
    if mapping:
        return mapping
    if len(bad) == len(rows):
        return [
            Problem(
                field,
                repr(path),
                f"none of the first {len(rows)} rows is usable as {d.format} {_row_kind(pairs)}data, e.g. {bad[0]}",
                "data",
            )
        ]
    if bad and d.bad_rows == "fail":
        return [
            Problem(
                "data.bad_rows",
                "'fail'",
                f"{bad[0]}: the run would stop there; fix the row or set data.bad_rows: skip",
                "data",
            )
        ]
    if bad:
        return [
            Problem(
                "data.bad_rows",
                "'skip'",
                f"{len(bad)} of the first {len(rows)} rows will be skipped "
                f"(and counted in MLflow's bad_rows), e.g. {bad[0]}",
                "data",
                NOTE,
            )
        ]
    return []


# ---------------------------------------------------------------- GRPO's reward functions
def reward_problems(spec: JobSpec) -> list[Problem]:
    """A reward function whose module is not importable from here (the job's working directory, which
    `ray job submit --working-dir` ships to the workers). Found, not imported: nothing of it runs here."""
    import importlib.util
    import sys

    out = []
    for i, reward in enumerate(spec.training.grpo.rewards):
        if reward.model:
            out += reward_model_problems(f"training.grpo.rewards[{i}].model", reward.model)
            continue
        if not reward.function:
            continue
        module = reward.function.split(":")[0]
        try:
            sys.path.insert(0, "")
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove("")
        if not found:
            out.append(
                Problem(
                    f"training.grpo.rewards[{i}].function",
                    repr(reward.function),
                    f"no module {module!r} "
                    "here: run from the folder that holds it (it ships with `ray job submit --working-dir "
                    ".`), or install it in the image",
                    "data",
                )
            )
    return out


def reward_model_problems(field: str, path: str) -> list[Problem]:
    """A reward model's folder: a model (config.json) or a LoRA adapter (adapter_config.json over a
    base it names), each with safetensors weights (nothing pickled is read). A hub id is the cluster's."""
    folder = Path(path)
    if not folder.is_dir():
        if is_hub_id(path):  # its head could not be checked, and the hub's main moves under a running job
            return [
                Problem(
                    field,
                    repr(path),
                    "is a hub id: a reward model is read from a folder, whose scoring "
                    f"head validate checks; download it at a fixed commit (`hf download {path} --revision "
                    "COMMIT --local-dir DIR`) and give DIR",
                    "model",
                )
            ]
        return [
            Problem(
                field,
                repr(path),
                "no such folder, and not a hub id: give the final_model folder of a "
                "`raytrain run` with objective: reward, or a ...ForSequenceClassification model",
                "model",
            )
        ]
    adapter = folder / "adapter_config.json"
    kind = "adapter_model.safetensors" if adapter.is_file() else "*.safetensors"
    if not adapter.is_file() and not (folder / "config.json").is_file():
        return [
            Problem(field, repr(path), "has no config.json (a model) or adapter_config.json (a LoRA adapter)", "model")
        ]
    if not list(folder.glob(kind)):
        return [
            Problem(
                field,
                repr(path),
                f"has no {kind}: only safetensors weights are read (a pickled file can "
                "run code); save the reward model with safetensors",
                "model",
            )
        ]
    if adapter.is_file():
        base = reward_model_base(path)
        if not Path(base).is_dir() and not is_hub_id(base):
            return [
                Problem(
                    field,
                    repr(path),
                    f"is a LoRA adapter over {base!r}, which is neither a folder here nor "
                    "a hub id: export the reward model whole (finetune: full) or keep its base where it names",
                    "model",
                )
            ]
    return reward_head_problems(field, path, folder.glob(kind))


def reward_head_problems(field: str, path: str, files) -> list[Problem]:
    """The scoring head must be in the weights, with one label: transformers otherwise makes up a
    random head (a different one on each rank), and GRPO trains on noise."""
    from raytrain.model.facts import SCORE_HEADS, read_safetensors_header

    shapes = {}
    for f in files:
        shapes.update(read_safetensors_header(f))
    heads = {k: v for k, v in shapes.items() if k.endswith(".weight") and set(k.split(".")) & set(SCORE_HEADS)}
    if not heads:
        return [
            Problem(
                field,
                repr(path),
                "holds no scoring head (no score.weight in its safetensors): it is a causal "
                "LM, not a reward model, and transformers would give it a random head. Train one with "
                "training.objective: reward and give its final_model folder",
                "model",
            )
        ]
    labels = {v[0] for v in heads.values()}
    if labels != {1}:
        return [
            Problem(
                field,
                repr(path),
                f"its scoring head has {max(labels)} labels ({', '.join(sorted(heads))}): "
                "a GRPO reward is one number a completion; give a reward model with num_labels 1",
                "model",
            )
        ]
    return []


# ---------------------------------------------------------------- checkpoint storage and MLflow
def storage_problems(spec: JobSpec, network_required: bool = False) -> list[Problem]:
    uri = spec.checkpoint.storage_path
    host = _object_store_host(uri)
    why = _resolve_error(host) if host else None
    if why:
        return [unreachable("checkpoint.storage_path", uri, why, network_required, "storage")]
    why = storage.probe_writable(uri)
    if why and host and _UNREACHABLE.search(why):
        return [unreachable("checkpoint.storage_path", uri, why, network_required, "storage")]
    if why:
        return [
            Problem(
                "checkpoint.storage_path",
                repr(uri),
                f"not writable ({why}); choose a folder or bucket this job may write to",
                "storage",
            )
        ]
    why = versioned.problems(spec.run_dir)  # the lease's compare-and-swap (rundir/versioned.py)
    if why:
        return [Problem("checkpoint.storage_path", repr(uri), why, "storage")]
    return []


def tracking_problems(spec: JobSpec, network_required: bool = False) -> list[Problem]:
    given = spec.tracking.uri
    if given is None and storage.is_remote(spec.checkpoint.storage_path):
        return [Problem("tracking.uri", "null", REMOTE_WITHOUT_SERVER.split(": ", 1)[1], "tracking")]
    uri = tracking_uri(spec)
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme == "sqlite":
        return [] if given is None and not storage.is_remote(spec.checkpoint.storage_path) else _sqlite(uri)
    if scheme in ("http", "https"):
        return _http(uri, network_required)
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
        return [
            Problem(
                "tracking.uri",
                repr(given),
                "MLflow 3 refuses file stores by default; use "
                "sqlite:///<folder>/mlflow.db (or an http:// tracking server)",
                "tracking",
            )
        ]
    if scheme not in ("file", "databricks"):
        return [
            Problem(
                "tracking.uri",
                repr(given),
                f"not checked: raytrain does not probe {scheme}:// stores",
                "tracking",
                NOTE,
            )
        ]
    return []


def _sqlite(uri: str) -> list[Problem]:
    db = Path(uri[len("sqlite:///") :]).expanduser()
    folder = next((p for p in [db.parent, *db.parent.parents] if p.exists()), Path("/"))
    if db.exists() and not db.is_file():
        why = f"{db} exists and is not a file"
    elif not folder.is_dir():
        why = f"{folder} is a file, not a folder"
    elif not os.access(folder, os.W_OK):
        why = f"{folder} is not writable"
    else:
        return []
    return [Problem("tracking.uri", repr(uri), f"the sqlite database needs a writable folder: {why}", "tracking")]


def _http(uri: str, network_required: bool) -> list[Problem]:
    host = urllib.parse.urlparse(uri).hostname or ""
    why = _resolve_error(host)
    if not why:
        try:  # any HTTP answer (even 401/404) means a server is there; /health is MLflow's own
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=TIMEOUT_S).close()
            return []
        except urllib.error.HTTPError:
            return []
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if not _UNREACHABLE.search(str(reason)):
                return [
                    Problem(
                        "tracking.uri",
                        repr(uri),
                        f"no MLflow server answers there ({reason}); start it or fix the host and port",
                        "tracking",
                    )
                ]
            why = str(reason)
    return [unreachable("tracking.uri", uri, why, network_required, "tracking")]
