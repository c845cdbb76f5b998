"""validate's checks of a job's tools and environments (training.grpo.tools, .environment), before
Ray is touched. Nothing of the user's code runs here, as with reward functions: each module is
found from the job's working directory and its source read (the function, or the class and its
`reset`, must be there, with a docstring and type hints where a schema is built from them).

The chat template is checked with the job's own tokenizer (model/chat_templates.py): that it
renders tool calls and preserves its prefix, else that TRL's training template of its family does
(said in a note), else refused naming the turn that changes; that the tokenizer has a response
template to parse calls with; and the conformance check, a probe episode built as the trainer
builds it against the template's rendering of the same messages. With engine: vllm the engine is
sent those token IDs as they are (it renders nothing, and checks that it received them)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

from raytrain.job.agents import EPISODE_KEY, agent_notes
from raytrain.job.spec import JobSpec
from raytrain.validate.problems import NOTE, Problem


def _source(module: str) -> tuple[ast.Module | None, str]:
    """The module's parsed source, found (not imported) from the working directory; or why not."""
    sys.path.insert(0, "")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove("")
    if found is None or not found.origin or not found.origin.endswith(".py"):
        return None, (
            f"no module {module!r} here: run from the folder that holds it (it ships with `ray job submit "
            "--working-dir .`), or install it in the image"
        )
    try:
        return ast.parse(Path(found.origin).read_text()), ""
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return None, f"{found.origin} cannot be read as Python ({type(exc).__name__}: {exc})"


def _schema_problem(fn: ast.FunctionDef, method: bool) -> str | None:
    """What get_json_schema would refuse of a function, read from its source."""
    if ast.get_docstring(fn) is None:
        return f"{fn.name} has no docstring: its description and `Args:` become the tool's schema"
    params = [a for a in fn.args.args + fn.args.kwonlyargs if a.arg != EPISODE_KEY][1 if method else 0 :]
    missing = [a.arg for a in params if a.annotation is None]
    if missing:
        return f"{fn.name}'s parameter {missing[0]!r} has no type hint: the tool's schema needs one"
    return None


def code_problems(spec: JobSpec) -> list[Problem]:
    g, out = spec.training.grpo, []
    for i, target in enumerate(g.tools):
        module, name = target.split(":")
        tree, why = _source(module)
        field = f"training.grpo.tools[{i}]"
        if tree is None:
            out.append(Problem(field, repr(target), why, "data"))
            continue
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is None:
            out.append(Problem(field, repr(target), f"{module} defines no function {name!r}", "data"))
        elif problem := _schema_problem(fn, method=False):
            out.append(Problem(field, repr(target), problem, "data"))
    for route, target in g.environments.items():
        module, name = target.split(":")
        field = "training.grpo.environment" + (f".{route}" if route else "")
        tree, why = _source(module)
        if tree is None:
            out.append(Problem(field, repr(target), why, "data"))
            continue
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
        methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)} if cls else {}
        if cls is None:
            out.append(Problem(field, repr(target), f"{module} defines no class {name!r}", "data"))
        elif "reset" not in methods and not cls.bases:
            out.append(Problem(field, repr(target), f"{name} has no reset method (TRL's environment_factory)", "data"))
        else:
            for method in methods.values():
                if method.name.startswith("_") or method.name in ("reset", "get_reward"):
                    continue
                if problem := _schema_problem(method, method=True):
                    out.append(Problem(field, repr(target), f"its tool {problem}", "data"))
            if not g.rewards and "get_reward" not in methods:
                out.append(
                    Problem(
                        field,
                        repr(target),
                        f"{name} has no get_reward and training.grpo.rewards is empty: the episodes have no reward",
                        "data",
                    )
                )
    return out


def template_problems(spec: JobSpec) -> list[Problem]:
    """The chat template's fitness for episodes, with the job's tokenizer (where it is here)."""
    from raytrain.model.chat_templates import TemplateProblem, conformance, episode_template, schema_tokens
    from raytrain.model.hub import load_tokenizer

    field, value = "model.tokenizer" if spec.model.tokenizer else "model.path", spec.model.tokenizer or spec.model.path
    if not Path(value).is_dir():
        return [Problem(field, repr(value), "its chat template is checked for tools on the cluster", "model", NOTE)]
    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        return [Problem(field, repr(value), f"the tokenizer does not load ({type(exc).__name__}: {exc})", "model")]
    try:
        choice = episode_template(tok)
    except TemplateProblem as exc:
        return [Problem("training.grpo.tools", "", str(exc), "model")]
    out = [Problem(field, repr(value), choice.note, "model", NOTE)] if choice.note else []
    broken = conformance(tok, choice)
    if broken:
        out.append(Problem("training.grpo.tools", "", f"the template conformance check failed: {broken}", "model"))
    else:
        from raytrain.model.chat_templates import PROBE_TOOL

        extra = schema_tokens(tok, choice, [PROBE_TOOL])
        out.append(
            Problem(
                "training.grpo.tools",
                "",
                "template conformance: a probe episode's tokens built turn by turn equal the template's rendering"
                + (" (and are what the vLLM engine is sent)" if spec.training.grpo.engine == "vllm" else "")
                + f"; a tool's schema adds about {extra} tokens to each prompt (data.seq_len holds them beside "
                "the prompt and max_completion_length)",
                "model",
                NOTE,
            )
        )
    return out


def problems(spec: JobSpec) -> list[Problem]:
    out = code_problems(spec)
    out += [Problem("training.grpo.nondeterministic_tools", "", text, "data", NOTE) for text in agent_notes(spec)]
    return out + template_problems(spec)
