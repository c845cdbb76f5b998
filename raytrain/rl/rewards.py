"""GRPO's rewards: built-ins that need no code, a user's function with TRL's signature,
`f(prompts, completions, completion_ids, **columns) -> list[float | None]`, named `module:function`
and imported in the workers from the job's working directory, and a reward model (reward_model.py,
the one part that imports torch).

Each reward scores every completion of a micro-batch; None (the function cannot judge that
completion) is NaN, as TRL keeps it: a completion no reward judges gets advantage 0. A function
that raises, or returns the wrong number of values, stops the job with its name, the row and the
fix (`RewardError`), never a bare worker traceback."""

from __future__ import annotations

import math
import re

from raytrain.errors import JobError
from raytrain.job.grpo import RewardSpec
from raytrain.rl import toolbox

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


class RewardError(JobError):
    """A reward that cannot be computed: the job stops with this message."""


def answer_of(text: str, pattern: str | None = None) -> str | None:
    """The answer in a text: `pattern`'s first group (or whole match), else the last \\boxed{...},
    else the last number (GSM8K's "#### 72" and a bare "72" both give "72")."""
    if pattern:
        m = None
        for m in re.finditer(pattern, text, re.DOTALL):
            pass
        return None if m is None else (m.group(1) if m.groups() else m.group(0)).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    depth, start = 0, at + len("\\boxed{")
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[start:i]
    return None


def same_answer(a: str | None, b: str | None) -> bool:
    """Numbers compare as numbers (1,000 = 1000.0); anything else as stripped text."""
    if a is None or b is None:
        return False
    try:
        x, y = float(a.replace(",", "").strip("$ ")), float(b.replace(",", "").strip("$ "))  # host: text, parsed
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a.strip() == b.strip()


def text_of(completion) -> str:
    """A completion as text: TRL gives conversational prompts' completions as [{role, content}]; an
    episode's (tools) as its assistant and tool messages, of which only the model's own words count."""
    if isinstance(completion, str):
        return completion
    return "\n".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


class Reward:
    """One configured reward: `__call__` gives a score (or None) per completion."""

    def __init__(self, spec: RewardSpec, max_completion_length: int, device=None, dtype=None):
        self.spec, self.name, self.weight = spec, spec.label, spec.weight
        self.limit = max_completion_length
        self.function = _import(spec.function) if spec.function else None
        self.model = None
        if spec.model:  # torch and transformers only where a reward model is asked for
            from raytrain.rl.reward_model import RewardModel

            try:
                self.model = RewardModel(spec.model, device or "cpu", dtype)
            except (OSError, ValueError, KeyError) as exc:
                raise RewardError(
                    f"training.grpo.rewards: model {spec.model!r} does not load as a reward model "
                    f"({type(exc).__name__}: {str(exc)[:200]}); give a folder `raytrain run` exported "
                    "for objective: reward, or a ...ForSequenceClassification model"
                ) from None

    def __call__(
        self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list], rows: list
    ) -> list[float]:
        s = self.spec
        if self.model is not None:
            return self.model(prompts, completions)
        if s.builtin == "length":
            return [len(ids) / self.limit for ids in completion_ids]
        if s.builtin == "format":
            return [float(re.search(s.pattern, text_of(c), re.DOTALL) is not None) for c in completions]  # host: 0/1
        if s.builtin == "accuracy":
            if s.column not in columns:
                raise RewardError(
                    f"training.grpo.rewards: accuracy reads column {s.column!r}, which row {rows[0]} "
                    f"does not have (its columns: {sorted(columns)}); set `column` to one of them"
                )
            return [
                float(same_answer(answer_of(text_of(c), s.pattern), answer_of(str(ref))))  # host: 0/1
                for c, ref in zip(completions, columns[s.column])
            ]
        try:
            out = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:
            raise RewardError(
                f"reward function {s.function} raised {type(exc).__name__}: {exc} (on the completions "
                f"of rows {rows[:4]} (source, epoch, row)); fix the function, or return None for a "
                "completion it cannot judge"
            ) from None
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise RewardError(
                f"reward function {s.function} returned {got} for {len(completions)} completions: it "
                "must return one float (or None) per completion, in order"
            )
        try:
            if any(isinstance(v, (str, bytes)) for v in out):  # TRL's tensor of them refuses text too
                raise TypeError
            return [math.nan if v is None else float(v) for v in out]  # host: the function's numbers
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {s.function} returned {str(out)[:80]}: each value must be a number or None"
            ) from None


class EnvironmentReward:
    """An environment's own `get_reward`, a reward named after its class with weight 1 (TRL's); its
    values come from the episodes' environments (objectives/grpo_agents.py), not from a call here."""

    def __init__(self, name: str):
        self.name, self.weight, self.spec = name, 1.0, None


def _import(target: str):
    function = toolbox.load(target, "training.grpo.rewards: function", RewardError)
    if not callable(function):
        raise RewardError(f"training.grpo.rewards: function {target!r} is not a function")
    return function


def score(
    rewards: list[Reward],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    rows: list,
) -> list[list[float]]:
    """Per completion, each reward's score (NaN where it returned None): [completions][rewards]."""
    per = [r(prompts, completions, completion_ids, columns, rows) for r in rewards]
    return [list(v) for v in zip(*per)]
