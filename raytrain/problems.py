"""Turn pydantic's validation errors into problems a user can act on:
the YAML path, the bad value, and the fix (with a did-you-mean for unknown keys)."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ValidationError

from .config import JobSpec


@dataclass
class Problem:
    field: str  # dotted YAML path, e.g. training.strategy
    value: str  # the offending value, shown as the YAML had it
    message: str  # what is wrong and how to fix it
    kind: str = "schema"

    def __str__(self) -> str:
        shown = f" = {self.value}" if self.value != "" else ""
        return f"{self.field}{shown}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def _model_at(loc: tuple) -> type[BaseModel] | None:
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
        model = _model_at(loc)
        known = list(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown key; {hint}known keys here: {', '.join(known)}"
    if kind == "missing":
        model = _model_at(loc)
        doc = model.model_fields[loc[-1]].description if model and loc[-1] in model.model_fields else ""
        return f"required and missing; add it ({doc})" if doc else "required and missing; add it"
    if kind in ("literal_error", "enum"):
        return f"not allowed; use one of {ctx.get('expected', '')}"
    if kind.startswith(("greater_than", "less_than")):
        return f"out of range: {err['msg'].lower()}"
    if kind == "string_pattern_mismatch":
        return "use letters, digits, '_', '.', '-' (start with a letter or digit, at most 100 characters)"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    return f"{err['msg']}"


def from_validation_error(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        field = ".".join(str(p) for p in loc) or "(job)"
        value = "" if err["type"] in ("missing",) or not loc else repr(err.get("input"))[:120]
        if err["type"] == "value_error" and isinstance(err.get("input"), dict):
            value = ""  # a cross-field rule: its message names the fields
        problems.append(Problem(field, value, _fix(err)))
    return problems
