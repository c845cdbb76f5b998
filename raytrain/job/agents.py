"""`training.grpo`'s agent settings: tools and environments that make a GRPO rollout an episode of
several turns (TRL 1.16's `GRPOTrainer(tools=, environment_factory=)`, its names and semantics), and
the rules that tie them to the rest of a job. Pure pydantic, like grpo.py, whose GRPOSpec takes
these fields: `raytrain validate` reads them without torch, and without importing the user's code
(validate/agents.py finds the modules and reads their source; only the tool process runs them)."""

from __future__ import annotations

import hashlib

from pydantic import Field, field_validator

from raytrain.job.section import Section

TARGET = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"  # module:function, module:Class
EPISODE_KEY = "episode_key"  # the parameter a tool or reset() names to receive its episode's key
ACTOR_NAMESPACE = "raytrain-environments"


class AgentFields(Section):
    tools: list[str] = Field(default_factory=list)
    """Tools the model may call, `module:function` each, imported from the job's working directory (as reward
    functions are) by a process apart from the training worker, which runs every call with `tool_timeout_s`. Each
    function's type hints and docstring become the JSON schema the chat template renders (transformers'
    `get_json_schema`); calls are parsed from each completion with the tokenizer's response template, as TRL does, a
    malformed call being plain text. A function with a parameter `episode_key` receives its episode's key (an int, a
    function of the seed, step, prompt and generation) for any randomness of its own, and the schema omits it."""
    environment: str | dict[str, str] | None = None
    """An environment class, `module:Class` (TRL's `environment_factory`): one instance a rollout, pooled and reused.
    `reset(**row)` opens each episode (the row's columns, and `episode_key` where it names one); what it returns, if
    anything, is appended to the prompt's last message; its public methods are the episode's tools; `get_reward()`,
    where defined, is a reward named after the class (weight 1). A mapping {name: module:Class} routes each row by its
    `environment` column."""
    environment_workers: int = Field(0, ge=0)
    """0: environments live in each training worker's tool process. N: in a pool of N Ray actors apart from the
    trainers (episodes spread over them by key), which heavy environments scale by and which outlive a trainer's
    restart; the driver removes them when the run ends."""
    max_tool_calling_iterations: int | None = Field(None, ge=0)
    """Rounds of tool calls an episode may make (TRL's name): None, unlimited (the token budget ends it); 0, none."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Seconds one tool call (or reset, or get_reward) may take. A call that hangs or crashes its process costs that
    call (its result is `{"error": ...}`, counted as a failure), never the worker: the process is started again and
    the episodes it held are rebuilt by replaying their calls."""
    nondeterministic_tools: list[str] = Field(default_factory=list)
    """Tools whose results are not a function of their arguments and episode key (a web search, a clock), by name.
    They run; a resumed or resized run then re-samples what follows their calls, so its steps are not promised equal
    to an uninterrupted run's (validate says so)."""

    @field_validator("tools")
    @classmethod
    def _targets(cls, value: list[str]) -> list[str]:
        import re

        for target in value:
            if not re.match(TARGET, target):
                raise ValueError(f"tool {target!r} is not `module:function` (e.g. my_tools:calculator)")
        return value

    @field_validator("environment")
    @classmethod
    def _environment(cls, value):
        import re

        for name, target in value.items() if isinstance(value, dict) else [(None, value)] if value else []:
            if not re.match(TARGET, target):
                raise ValueError(
                    f"environment {target!r}{f' (for rows of environment {name!r})' if name else ''} is not "
                    "`module:Class` (e.g. my_envs:Game)"
                )
        if isinstance(value, dict) and not value:
            raise ValueError("environment: an empty mapping; give {name: module:Class, ...} or one module:Class")
        return value

    @property
    def agents(self) -> bool:
        """Whether a rollout is an episode of tool calls (tools or an environment)."""
        return bool(self.tools or self.environment)

    @property
    def environments(self) -> dict[str | None, str]:
        """{routing name (None: every row), module:Class}."""
        if not self.environment:
            return {}
        return dict(self.environment) if isinstance(self.environment, dict) else {None: self.environment}


def tool_name(target: str) -> str:
    return target.split(":")[1]


def actor_prefix(run_dir: str) -> str:
    """The names of a run's environment actors begin so (the driver removes them by it)."""
    return f"env-{hashlib.blake2b(run_dir.encode(), digest_size=6).hexdigest()}-"


AGENT_FIELDS = tuple(AgentFields.model_fields)


def agent_problems(spec) -> list[str]:
    """What makes a job's tools or environment unusable, each with its fix ([] when it fits). `spec`
    is a JobSpec whose objective is grpo (grpo_problems calls this)."""
    g = spec.training.grpo
    out = []
    if not g.agents:
        # By value, never by `model_fields_set`: the workers validate the spec from its whole dump
        # (every field set), and a job that never named these must pass there as it did here.
        unused = [
            f
            for f in ("environment_workers", "max_tool_calling_iterations")
            if getattr(g, f) != AgentFields.model_fields[f].default
        ]
        if g.nondeterministic_tools:
            unused.append("nondeterministic_tools")
        if unused:
            out.append(
                f"training.grpo.{unused[0]} is a setting of tools and environments, and the job has "
                "neither: set training.grpo.tools or training.grpo.environment, or remove it"
            )
        return out
    names = [tool_name(t) for t in g.tools]
    if len(set(names)) < len(names):
        out.append(f"training.grpo.tools: two tools share a name ({names}): the model calls a tool by its name")
    if g.environment_workers and not g.environment:
        out.append(
            "training.grpo.environment_workers sizes a pool of environment actors, and training.grpo.environment "
            "is unset: set an environment, or remove environment_workers (tools run in the worker's tool process)"
        )
    unknown = [n for n in g.nondeterministic_tools if n not in names and not g.environment]
    if unknown:
        out.append(
            f"training.grpo.nondeterministic_tools names {unknown[0]!r}, which is not one of the tools {names}: "
            "name a tool by its function's name"
        )
    return out


def agent_notes(spec) -> list[str]:
    """What validate says about a job's tools (not refusals)."""
    g = spec.training.grpo
    if not g.agents:
        return []
    out = []
    if g.nondeterministic_tools:
        out.append(
            f"training.grpo.nondeterministic_tools: {', '.join(g.nondeterministic_tools)} may answer a call "
            "differently each time: a resumed or resized run re-samples what follows, so its steps are not "
            "promised equal to an uninterrupted run's (the rest of raytrain's exactness holds)"
        )
    return out
