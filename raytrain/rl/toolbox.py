"""The user's tools and environments, loaded and run: what the tool process (tool_host.py) and an
environment actor (env_actors.py) hold, never the training worker, which only sends them calls.

Semantics are TRL 1.16's GRPOTrainer's: a tool is a function whose type hints and docstring give
its JSON schema (transformers' get_json_schema); an environment class gets one instance a rollout,
from a pool (constructed once, `reset` for each episode), whose public methods besides `reset` and
`get_reward` are that episode's tools; a call's result is `str(result)`, or `str({"error": ...})`
when it raises or names no tool (a failure). Beyond TRL: a function (or `reset`) with a parameter
`episode_key` receives the episode's key, which the schema leaves out, so that randomness a tool
wants is a function of (seed, step, prompt, generation) and a resumed step draws the same."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

from raytrain.job.agents import EPISODE_KEY


class ToolError(Exception):
    """A tool or environment that cannot be loaded: the message names it and the fix."""


def load(target: str, field: str, error: type[Exception] = ToolError):
    """`module:name` imported from the job's working directory (where Ray unpacks it for each worker):
    the one way raytrain imports a job's own code (tools, environments, reward functions); `error`
    names it and the fix."""
    module_name, name = target.split(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(
            f"{field}: {target!r}: cannot import {module_name!r} ({exc}); ship it with the job "
            "(`ray job submit --working-dir .`, or a package the image has)"
        ) from None
    found = getattr(module, name, None)
    if found is None:
        raise error(f"{field}: {target!r}: {module_name} has no {name!r}")
    return found


def schema(function) -> dict:
    """transformers' get_json_schema of a tool, without its `episode_key` parameter."""
    from transformers.utils import get_json_schema

    signature = inspect.signature(function)
    if EPISODE_KEY in signature.parameters:

        @functools.wraps(function)
        def shown(*args, **kwargs):
            return function(*args, **kwargs)

        shown.__signature__ = signature.replace(
            parameters=[p for p in signature.parameters.values() if p.name != EPISODE_KEY]
        )
        shown.__annotations__ = {k: v for k, v in getattr(function, "__annotations__", {}).items() if k != EPISODE_KEY}
        function = shown
    return get_json_schema(function)


def takes_key(function) -> bool:
    return EPISODE_KEY in inspect.signature(function).parameters


def methods(cls) -> list[str]:
    """An environment's tools, as TRL lists them: its public functions but reset and get_reward."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


class Toolbox:
    def __init__(self, tools: list[str], environments: dict):
        self.tools = {}
        for target in tools:
            function = load(target, "training.grpo.tools")
            if not callable(function):
                raise ToolError(f"training.grpo.tools: {target!r} is not a function")
            self.tools[function.__name__] = function
        self.classes = {}
        for name, target in environments.items():
            cls = load(target, "training.grpo.environment")
            if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
                raise ToolError(
                    f"training.grpo.environment: {target!r} must be a class with a `reset` method (TRL's "
                    "environment_factory)"
                )
            self.classes[name or ""] = cls
        self.pools = {name: [] for name in self.classes}
        self.live = {}  # episode -> (environment name, instance)

    def catalog(self) -> dict:
        """The schemas each episode's prompt renders with: the tools, and each environment's methods."""
        try:
            tools = {name: schema(f) for name, f in self.tools.items()}
            envs = {
                name: {
                    "class": cls.__name__,
                    "tools": {m: schema(getattr(cls, m)) for m in methods(cls)},
                    "reward": callable(getattr(cls, "get_reward", None)),
                }
                for name, cls in self.classes.items()
            }
        except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException, a bad hint
            raise ToolError(
                f"training.grpo.tools: a tool's JSON schema cannot be built ({type(exc).__name__}: {exc}); give "
                "each parameter a type hint and a line under `Args:` in the docstring"
            ) from None
        return {"tools": tools, "environments": envs}

    def reset(self, episode: str, env: str, row: dict, key: int):
        if episode in self.live:  # a restarted step opens its episodes again
            self.end([episode])
        pool = self.pools[env]
        instance = pool.pop() if pool else self.classes[env]()
        self.live[episode] = (env, instance)
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        if takes_key(instance.reset):
            kwargs[EPISODE_KEY] = key
        return instance.reset(**kwargs)

    def call(self, episode: str, name: str, arguments, key: int) -> tuple[str, bool]:
        """(the tool message's content, whether the call failed), as TRL's tool loop makes them."""
        instance = self.live.get(episode, (None, None))[1]
        function = self.tools.get(name)
        if function is None and instance is not None and name in methods(type(instance)):
            function = getattr(instance, name)
        try:
            if function is None:
                raise ValueError(f"Tool {name} not found.")
            kwargs = dict(arguments)  # a non-mapping argument fails the call, as TRL's `**arguments` does
            if takes_key(function):
                kwargs[EPISODE_KEY] = key
            return str(function(**kwargs)), False
        except Exception as exc:  # noqa: BLE001 - the model's call failed: its result says why
            return str({"error": str(exc)}), True

    def rewards(self, episodes: list[str]) -> list[float | None]:
        out = []
        for episode in episodes:
            env, instance = self.live.get(episode, (None, None))
            getter = getattr(instance, "get_reward", None)
            out.append(None if getter is None else float(getter()))  # host: the environment's number
        return out

    def end(self, episodes: list[str]) -> None:
        for episode in episodes:
            if episode in self.live:
                env, instance = self.live.pop(episode)
                self.pools[env].append(instance)
