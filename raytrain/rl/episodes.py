"""Episodes of several turns (GRPO with tools and environments), as TRL 1.16's `_tool_call_loop`
plays them, batched across a rank's episodes turn by turn.

Each episode's first turn is sampled from its prompt (rendered with its tools' schemas); its
completion is parsed with the response template (a malformed call is plain text). While some have
tool calls and `max_tool_calling_iterations` allows: every call runs in the tool process
(tool_host.py: a timeout, a failure as `{"error": ...}`), its result becomes a `tool` message, and
the next turn continues from `prompt + completion + suffix` (the result as the template renders
it), never re-tokenized, for the episode's remaining budget. A result that would carry the episode
past max_completion_length, or the model's length, is rolled back and the episode stops (TRL's
rule). `mask` (TRL's tool_mask) is 0 on result tokens: the loss, the KL term, the engine's
importance ratio and the length metrics see only what the model wrote.

Turn t of an episode samples with `turn_key(key, t)`: the same sampler stream as a single turn,
so episodes are functions of (seed, step, prompt, generation, policy, tools), whatever the batch.
`generate` is either engine's (objectives/grpo.py): a list of token prompts, keys and budgets ->
(completions, log-probs or None); `agree` makes a count the ranks' maximum where every rank must
run the same forwards (engine: hf), and is the identity otherwise."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field

from raytrain.model.chat_templates import EpisodeTemplate, parse, suffix_ids


@dataclass
class Episode:
    id: str  # "step/source/epoch/row/generation": unique in a run
    key: int  # the completion's key (sampling.completion_key)
    env: str | None  # its environment's routing name ("" for the one environment, None for none)
    prompt: list[int]  # its prompt as rendered with its tools
    tools: list[dict]  # the schemas its prompt rendered
    completion: list[int] = field(default_factory=list)  # every turn's tokens, tool results included
    mask: list[int] = field(default_factory=list)  # TRL's tool_mask: 1 where the model wrote the token
    logps: list[float] | None = None  # the engine's, 0 on tool results (engine: vllm)
    messages: list[dict] = field(default_factory=list)  # the completion as TRL's rewards get it
    calls: int = 0
    failures: int = 0
    turns: int = 0
    pending: list = field(default_factory=list)  # the last turn's tool calls


def turn_key(key: int, turn: int) -> int:
    if turn == 0:
        return key
    return int.from_bytes(hashlib.blake2b(f"{key}/turn/{turn}".encode(), digest_size=4).digest(), "little")


def tool_round(host, episodes: list[Episode]) -> list[list[dict]]:
    """Run each episode's pending calls in order; its tool messages, appended to its messages."""
    out = []
    for e in episodes:
        results = []
        for call in e.pending:
            e.calls += 1
            if not isinstance(call, dict) or call.get("type", "function") != "function":
                e.failures += 1
                kind = call.get("type") if isinstance(call, dict) else type(call).__name__
                results.append(
                    {
                        "role": "tool",
                        "name": "unknown",
                        "content": str({"error": f"Unsupported tool call type: {kind}"}),
                    }
                )
                continue
            function = call.get("function", call)
            content, failed = host.call(e, function["name"], function.get("arguments") or {})
            e.failures += failed
            results.append({"role": "tool", "name": function["name"], "content": content})
        e.messages += results
        out.append(results)
    return out


def _accept(e: Episode, ids: list[int], post: list[int], logps, tok, template: EpisodeTemplate) -> None:
    """The episode continues with a turn: the result's tokens masked, the turn's parsed."""
    results = len(ids) - len(e.prompt) - len(e.completion)
    e.mask += [0] * results + [1] * len(post)
    if e.logps is not None:
        e.logps += [0.0] * results + list(logps or [])
    e.completion = ids[len(e.prompt) :] + list(post)
    e.turns += 1
    message = parse(tok, post, ids, e.tools, template.response_template) if post else {}
    if message:
        e.messages.append(message)
    e.pending = message.get("tool_calls") or []


def play(
    episodes: list[Episode], generate, host, tok, template: EpisodeTemplate, g, max_model_len: int, agree=len
) -> dict:
    """Every episode to its end; returns the seconds spent generating and in tools."""
    seconds = {"generation": 0.0, "tools": 0.0}
    started = time.perf_counter()
    outs, logps = generate(
        [e.prompt for e in episodes], [e.key for e in episodes], [g.max_completion_length] * len(episodes)
    )
    seconds["generation"] += time.perf_counter() - started
    for i, e in enumerate(episodes):
        e.completion, e.mask, e.turns = list(outs[i]), [1] * len(outs[i]), 1
        e.logps = list(logps[i]) if logps is not None else None
        first = parse(tok, e.completion, e.prompt, e.tools, template.response_template)
        e.messages, e.pending = [first], first.get("tool_calls") or []
    limit = math.inf if g.max_tool_calling_iterations is None else g.max_tool_calling_iterations
    iteration = 0
    while iteration < limit:
        calling = [e for e in episodes if e.pending]
        if agree(calling) == 0:
            break
        started = time.perf_counter()
        results = tool_round(host, calling)
        seconds["tools"] += time.perf_counter() - started
        going, prompts, budgets = [], [], []
        for e, tool_messages in zip(calling, results):
            ids = e.prompt + e.completion + suffix_ids(tok, tool_messages, template.chat_template)
            used = len(ids) - len(e.prompt)
            if used > g.max_completion_length or len(ids) >= max_model_len:  # rolled back: the sample stops
                del e.messages[len(e.messages) - len(tool_messages) :]
                e.pending = []
                continue
            budget = min(g.max_completion_length - used, max_model_len - len(ids))
            if budget <= 0:  # the result fits and ends the budget: nothing more to sample
                _accept(e, ids, [], [], tok, template)
                continue
            going.append(e)
            prompts.append(ids)
            budgets.append(budget)
        started = time.perf_counter()
        outs, logps = generate(prompts, [turn_key(e.key, iteration + 1) for e in going], budgets)
        seconds["generation"] += time.perf_counter() - started
        for i, (e, ids) in enumerate(zip(going, prompts)):
            _accept(e, ids, outs[i][: budgets[i]], logps[i][: budgets[i]] if logps is not None else None, tok, template)
        iteration += 1
    return seconds


def metrics(everyone: list[tuple[int, int, int]]) -> dict:
    """TRL's tool metrics over the global batch's episodes, each (calls, failures, turns)."""
    calls = sum(c for c, _, _ in everyone)
    failures = sum(f for _, f, _ in everyone)
    return {
        "tools/call_frequency": calls / len(everyone) if everyone else 0.0,
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "tools/turns_per_episode": sum(t for _, _, t in everyone) / len(everyone) if everyone else 0.0,
    }
