"""Chat templates for episodes of several turns (GRPO with tools), as TRL 1.16's GRPOTrainer needs
them, and the checks `raytrain validate` runs on them before anything starts.

An episode's tokens are built by concatenation, never re-tokenized: the prompt as the template
renders it, then what the model wrote, then the tool results as the template renders them
(`suffix_ids`), then the model again. That equals the template's rendering of the whole episode
only where the template preserves its prefix: appending a message never changes how the earlier
ones render. `episode_template` decides what a job renders with: its own template where that holds,
else TRL's training template of the same family (chat_templates/known.json, copied from TRL), else
it refuses, naming the turn that changes (`prefix_break`). `conformance` then builds a probe
episode the way the trainer does and compares it with the template's rendering of the same
messages, token for token, and parses the template's own tool call back with the response template
(the parser the trainer reads calls with). Torch-free: a tokenizer is all these need."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

KNOWN = json.loads((Path(__file__).parent / "chat_templates" / "known.json").read_text())
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "description": "the word"}},
            "required": ["word"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "two"}}}
PROBE = [  # a user turn, a tool call, its result, an answer, and a second exchange
    {"role": "user", "content": "what is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "lookup", "content": "5"},
    {"role": "assistant", "content": "it is 5"},
    {"role": "user", "content": "and 4 + 4?"},
    {"role": "assistant", "content": "8"},
]


class TemplateProblem(ValueError):
    """The job's chat template cannot train episodes of several turns; the message says why and the fix."""


@dataclass(frozen=True)
class EpisodeTemplate:
    chat_template: str | None  # what episodes render with; None: the tokenizer's own
    response_template: dict  # transformers' parse_response template, for the tool calls
    note: str = ""  # what validate says about the choice


def own_template(tok) -> str | None:
    template = tok.chat_template
    return template.get("default") if isinstance(template, dict) else template


def render(tok, messages: list[dict], template: str | None, gen: bool = False, tools=None) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=template,
            add_generation_prompt=gen,
            tokenize=True,
            return_dict=False,
        )
    )


def trimmed(tok, ids: list[int]) -> list[int]:
    """Up to and including the last end token (TRL's alignment: some templates add a newline after it)."""
    ends = [i for i, t in enumerate(ids) if t == tok.eos_token_id]
    return ids[: ends[-1] + 1] if ends else ids


def suffix_ids(tok, tool_messages: list[dict], template: str | None) -> list[int]:
    """The tokens of tool results and the next assistant header (TRL's _get_tool_suffix_ids): the
    rendering of a dummy call with them, less the rendering without them, cut after its end token."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = trimmed(tok, render(tok, dummy, template))
    full = render(tok, dummy + tool_messages, template, gen=True)
    if full[: len(prefix)] != prefix:
        raise TemplateProblem("the chat template renders a tool call differently once its result follows")
    return full[len(prefix) :]


def parse(tok, ids: list[int], prefix: list[int], tools: list | None, response_template: dict) -> dict:
    """One assistant turn as a message (TRL's parse_response): its tool calls where the response
    template finds them well-formed, else the whole turn as plain text (a malformed call is text)."""
    try:
        parsed = tok.parse_response(ids, schema=response_template, prefix=prefix, tools=tools or None)
        if parsed is None:  # heavily truncated: even the content is lost
            raise ValueError("nothing parsed")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tok.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a tool call without a name")
            if function.get("arguments") is None:
                function["arguments"] = {}
        if "tool_calls" in parsed and not isinstance(parsed["tool_calls"], list):
            raise ValueError("tool_calls is not a list")
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}
    return parsed


def renders_tool_calls(tok, template: str | None) -> bool:
    """TRL's supports_tool_calling: the call's name and argument and the result all appear rendered."""
    try:
        text = tok.apply_chat_template(PROBE[:3], chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses a role is one that cannot
        return False
    return all(s in text for s in ("lookup", "word", "two", "5"))


def prefix_break(tok, template: str | None) -> str | None:
    """None where appending each message of the probe episode keeps the rendering before it (the
    prompt before an assistant turn; the turns before a tool result or a user turn, up to their end
    token), else which turn changes and how."""
    for k in range(1, len(PROBE)):
        adding = PROBE[k]["role"]
        if adding == "assistant":
            before, after = render(tok, PROBE[:k], template, gen=True), render(tok, PROBE[: k + 1], template)
        else:
            before = trimmed(tok, render(tok, PROBE[:k], template))
            after = render(tok, PROBE[: k + 1], template, gen=True)
        if after[: len(before)] == before:
            continue
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        lengths = [len(render(tok, PROBE[: j + 1], template)) for j in range(k)]
        turn = next((j for j, n in enumerate(lengths) if n > at), k - 1)
        was, became = tok.decode(before[at : at + 12]), tok.decode(after[at : at + 12])
        return (
            f"appending turn {k + 1} ({adding}) changes how turn {turn + 1} ({PROBE[turn]['role']}) renders: "
            f"{was!r} becomes {became!r}"
        )
    return None


def episode_template(tok) -> EpisodeTemplate:
    """What a job's episodes render with, or TemplateProblem saying why there is none."""
    own = own_template(tok)
    if own is None:
        raise TemplateProblem("the tokenizer has no chat template: tools need one that renders tool calls")
    known = KNOWN.get(hashlib.sha256(own.encode()).hexdigest())
    training = (Path(__file__).parent / "chat_templates" / known["training"]).read_text() if known else None
    chosen, note = None, ""
    broken = None if renders_tool_calls(tok, own) else "it renders no tool call (or no tool result)"
    broken = broken or prefix_break(tok, own)
    if broken:
        if training is None or not renders_tool_calls(tok, training) or prefix_break(tok, training):
            raise TemplateProblem(
                f"the chat template does not preserve its prefix: {broken}. Episodes are built by appending "
                "tokens, never re-rendering, so training on them needs a template under which appending a message "
                "never changes earlier ones: set model.tokenizer to a tokenizer whose template does (TRL ships "
                "training templates, trl/chat_templates/*_training.jinja)"
            )
        chosen, note = (
            training,
            (
                f"the tokenizer's chat template ({known['family']}) does not preserve its prefix ({broken}); episodes "
                f"render with TRL's {known['training']}, which does (the same text for every turn it keeps)"
            ),
        )
    response = getattr(tok, "response_template", None) or (known or {}).get("response_template")
    if not response:
        raise TemplateProblem(
            "the tokenizer has no response_template to parse tool calls with (transformers' parse_response): "
            "add one to its tokenizer_config.json (TRL's add_response_schema sets it for known families)"
        )
    return EpisodeTemplate(chosen, response, note)


def conformance(tok, choice: EpisodeTemplate) -> str | None:
    """None where a probe episode built as the trainer builds it (prompt, then each assistant turn's
    tokens, then `suffix_ids` of the tool result) equals the template's rendering of its messages
    tokenized, and the response template parses the template's own call back; else the difference."""
    t, tools = choice.chat_template, [PROBE_TOOL]
    messages = PROBE[:4]
    prompt = render(tok, messages[:1], t, gen=True, tools=tools)
    first = trimmed(tok, render(tok, messages[:2], t, tools=tools))[len(prompt) :]
    call = parse(tok, first, prompt, tools, choice.response_template).get("tool_calls") or []
    got = [(c.get("function", c).get("name"), c.get("function", c).get("arguments")) for c in call]
    if got != [("lookup", {"word": "two"})]:
        return f"the response template does not parse the template's own tool call {tok.decode(first)!r} (got {got})"
    suffix = suffix_ids(tok, messages[2:3], t)
    before_answer = render(tok, messages[:3], t, gen=True, tools=tools)
    answer = trimmed(tok, render(tok, messages, t, tools=tools))[len(before_answer) :]
    built = prompt + first + suffix + answer
    whole = trimmed(tok, render(tok, messages, t, tools=tools))
    if built != whole:
        at = next((i for i, (a, b) in enumerate(zip(built, whole)) if a != b), min(len(built), len(whole)))
        return (
            f"the trainer's tokens for an episode differ from the template's rendering at token {at}: "
            f"{tok.decode(built[at : at + 12])!r} against {tok.decode(whole[at : at + 12])!r}"
        )
    return None


def schema_tokens(tok, choice: EpisodeTemplate, tools: list[dict]) -> int:
    """The tokens the tools' schemas add to every prompt."""
    user = [{"role": "user", "content": "x"}]
    return len(render(tok, user, choice.chat_template, True, tools)) - len(
        render(tok, user, choice.chat_template, True)
    )
