"""The base of every section of the job YAML (spec.py's, data.py's, grpo.py's)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors, docstrings become field docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
