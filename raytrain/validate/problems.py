"""Problems a user can act on: the YAML path, the bad value, and the fix. Pydantic's
validation errors (with a did-you-mean for unknown keys), cross-field rules pointed at
their field, and what the schema cannot see: duplicate keys and secrets in the file.

A problem is an `error` (the job is refused, exit 2) or a `note` (said, not refused:
something only the cluster can check, or an estimate worth reading).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from raytrain.job.spec import SECRET_KEY, JobSpec

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # org/name: what the Hugging Face hub would resolve


def is_hub_id(path: str) -> bool:
    return bool(HUB_ID.match(path)) and not path.startswith(("/", ".", "~")) and not path.count("/") > 1


ERROR, NOTE = "error", "note"
# Keys whose values are secrets: whole words of the key, so `tokenizer` or `max_tokens` is not a token.
SECRET_VALUE = re.compile(
    r"\b(hf_[A-Za-z0-9]{30,}|A[KS]IA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}|"
    r"sk-[A-Za-z0-9_-]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|-----BEGIN [A-Z ]*PRIVATE KEY)"
)
URI_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s:]+:[^/@\s]+@", re.I)
# Cross-field rules name their field first: "training.global_batch_size=64 is not ...",
# or, inside a section, "min_workers=3 > ..." / "give either `num_workers` ...".
_LEADING_FIELD = re.compile(
    r"^`?(?P<field>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)`?(?:=(?P<value>\S+?))?[:,]?\s+(?P<rest>.+)$", re.S
)
_BACKTICKED = re.compile(r"`([a-z_][a-z0-9_.]*)`")


@dataclass
class Problem:
    field: str  # dotted YAML path, e.g. training.strategy
    value: str  # the offending value, shown as the YAML had it
    message: str  # what is wrong and how to fix it
    kind: str = "schema"  # schema | file | security | model | memory | speed | data | storage | tracking | environment
    severity: str = ERROR

    def __str__(self) -> str:
        shown = f" = {self.value}" if self.value != "" else ""
        return f"{self.field}{shown}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def did_you_mean(word: str, known: list[str] | set[str]) -> str:
    """ "did you mean 'x'? " or "" (difflib, the same cutoff everywhere)."""
    close = difflib.get_close_matches(str(word), sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def section_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic section class that holds the key at `loc`."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _fix(err: dict) -> str:
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    if kind == "extra_forbidden":
        model = section_at(loc)
        known = list(model.model_fields) if model else []
        return f"unknown key; {did_you_mean(loc[-1], known)}known keys here: {', '.join(known)}"
    if kind == "missing":
        model = section_at(loc)
        doc = model.model_fields[loc[-1]].description if model and loc[-1] in model.model_fields else ""
        doc = " ".join((doc or "").split())  # a docstring wrapped in the source is one line here
        return f"required and missing; add it ({doc})" if doc else "required and missing; add it"
    if kind in ("literal_error", "enum"):
        return f"not allowed; use one of {ctx.get('expected', '')}"
    if kind.startswith(("greater_than", "less_than")):
        return f"out of range: {err['msg'].lower()}"
    if kind == "string_pattern_mismatch":
        return "use letters, digits, '_', '.', '-' (start with a letter or digit, at most 100 characters)"
    if kind == "model_type" or kind == "dict_type":
        return "expected a section (a YAML mapping of key: value), got " + type(err.get("input")).__name__
    return f"{err['msg']}"


def cross_field(loc: tuple, message: str, given: Any) -> Problem:
    """A rule over several fields: name the field the message leads with (or the first
    backticked one), relative to the section at `loc`, so the user is pointed at a key."""
    prefix = ".".join(str(p) for p in loc)
    known = set(section_at(loc + ("",)).model_fields) if section_at(loc + ("",)) else set()
    field, value, rest = "", "", message
    m = _LEADING_FIELD.match(message)
    if m and ("." in m["field"] or m["field"] in known):
        field, value = m["field"], m["value"] or ""
        rest = m["rest"] if m["rest"][:1].isalpha() else message  # "min_workers=4 > max_workers=2" reads whole
    else:
        named = [n for n in _BACKTICKED.findall(message) if "." in n or n in known]
        field = named[0] if named else ""
    if field and "." not in field and prefix:
        field = f"{prefix}.{field}"
    if field and not value and isinstance(given, dict):
        leaf = field.rsplit(".", 1)[-1]
        value = repr(given[leaf]) if leaf in given else ""
    return Problem(field or prefix or "(job)", value, rest)


def from_validation_error(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        if err["type"] == "value_error" and isinstance(err.get("input"), dict):
            problems.append(cross_field(loc, _fix(err).removeprefix("Value error, "), err["input"]))
            continue
        field = ".".join(str(p) for p in loc) or "(job)"
        value = "" if err["type"] in ("missing",) or not loc else repr(err.get("input"))[:120]
        fix = _fix(err)
        problems.append(Problem(field, value, fix.removeprefix("Value error, ")))
    return problems


# ---------------------------------------------------------------- problems of the file itself
def duplicate_keys(text: str) -> list[Problem]:
    """safe_load keeps the last of two equal keys silently: a second `training:` block
    would replace the first. The node tree (composed, never constructed) shows both."""
    out = []

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                name = f"{prefix}{key.value}"
                if name in lines:
                    out.append(
                        Problem(
                            name,
                            "",
                            f"appears twice (lines {lines[name]} and {key.start_mark.line + 1}); "
                            "YAML keeps only the last: merge them into one",
                            "file",
                        )
                    )
                lines[name] = key.start_mark.line + 1
                walk(value, name + ".")
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, prefix)

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return out


def secret_problems(tree, prefix: str = "") -> list[Problem]:
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for key, value in items:
        name = f"{prefix}{key}"
        scalar = isinstance(value, (str, int)) and not isinstance(value, bool) and value != ""
        secret_key = isinstance(key, str) and SECRET_KEY.search(key) and scalar
        if secret_key or (isinstance(value, str) and SECRET_VALUE.search(value)):
            out.append(
                Problem(
                    name,
                    "<redacted>",
                    "looks like a secret; secrets do not belong in a job file (it is "
                    "logged to MLflow and stored with the run): remove it and export it as an environment "
                    "variable (e.g. HF_TOKEN, AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD)",
                    "security",
                )
            )
        elif isinstance(value, str) and URI_PASSWORD.search(value):
            out.append(
                Problem(
                    name,
                    "<redacted>",
                    "a password in a URI; remove it from the URI and export it "
                    "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for MLflow)",
                    "security",
                )
            )
        else:
            out.extend(secret_problems(value, name + "."))
    return out
