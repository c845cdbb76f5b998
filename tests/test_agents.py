"""GRPO with tools, without a cluster, against TRL 1.16's own code: the chat template checks
(prefix preservation, the training templates copied from TRL, parsing calls, the suffix of tool
results); episodes scripted at the token level as TRL's own tests script them (one valid call, one
with a wrong argument, one plain answer) played by rl/episodes.py and by TRL's `_tool_call_loop`
on the same completions; the loss with tool tokens masked against TRL's `_compute_loss`; the tool
process (a real subprocess: a timeout, a crash, the replay that rebuilds an environment, the
episode key); and what validate refuses. The demo agent's tokenizer (demo_agents.py) renders the
tools; TRL's Qwen3 template is the one that does not preserve its prefix."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grpo import trl_loss

from raytrain import demo_agents
from raytrain.data import IGNORE
from raytrain.job.grpo import GRPOSpec
from raytrain.model import chat_templates as ct
from raytrain.objectives.grpo_batch import training_rows
from raytrain.rl.episodes import Episode, metrics, play, turn_key
from raytrain.rl.hosts import Hosts
from raytrain.rl.losses import summed_loss, token_terms

CALC = "raytrain.demo_agents:calculator"


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets / "model-tools"))


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def with_template(tok, template: str, response: bool = False):
    other = copy.deepcopy(tok)
    other.chat_template = template
    if not response:
        other.response_template = None
    return other


# ---------------------------------------------------------------- templates
def test_the_training_templates_copied_are_trls(tok):
    from trl.chat_template_utils import add_response_schema, get_training_chat_template

    for digest, known in ct.KNOWN.items():
        original = trl_template(known["family"])
        assert hashlib.sha256(original.encode()).hexdigest() == digest
        family = with_template(tok, original)
        assert (
            get_training_chat_template(family)
            == (Path(ct.__file__).parent / "chat_templates" / known["training"]).read_text()
        )
        assert add_response_schema(family).response_template == known["response_template"]


def test_the_prefix_check_agrees_with_trls_and_names_the_turn_that_changes(tok):
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    cases = {
        "demo": tok.chat_template,
        "qwen3": trl_template("qwen3"),
        "qwen3_training": trl_template("qwen3_training"),
        "qwen2_5": trl_template("qwen2_5"),
    }
    for name, template in cases.items():
        t = with_template(tok, template, response=True)
        ours = ct.prefix_break(t, template)
        assert (ours is None) == is_chat_template_prefix_preserving(t), (name, ours)
    assert ct.prefix_break(with_template(tok, cases["qwen3"]), cases["qwen3"]).startswith(
        "appending turn 3 (tool) changes how turn 2 (assistant) renders"
    )


def rewrites_old_turns(tok) -> str:
    """The demo template, except that an assistant turn renders differently once another follows."""
    old = "<|im_start|>assistant\n{{ m.content }}"
    return tok.chat_template.replace(
        old, "<|im_start|>assistant\n{% if not loop.last %}[old] {% endif %}{{ m.content }}"
    )


def test_the_episode_template_is_the_jobs_own_else_trls_training_one_else_refused(tok):
    own = ct.episode_template(tok)
    assert own.chat_template is None and own.note == "" and ct.conformance(tok, own) is None
    qwen3 = with_template(tok, trl_template("qwen3"))
    swapped = ct.episode_template(qwen3)
    assert swapped.chat_template == trl_template("qwen3_training") and "qwen3_training.jinja" in swapped.note
    assert ct.conformance(qwen3, swapped) is None
    with pytest.raises(ct.TemplateProblem, match=r"appending turn 3 \(tool\) changes how turn 2 \(assistant\)"):
        ct.episode_template(with_template(tok, rewrites_old_turns(tok), response=True))
    with pytest.raises(ct.TemplateProblem, match="no response_template"):
        ct.episode_template(with_template(tok, tok.chat_template))


def test_parsing_calls_and_the_tool_results_suffix_equal_trls(tok):
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    schema = demo_agents.schemas()["calculator"]
    prompt = ct.render(tok, [{"role": "user", "content": "what is 2 + 3?"}], None, gen=True, tools=[schema])
    for text in (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call><|im_end|>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}</tool_call><|im_end|>',  # malformed
        "5<|im_end|>",
        '<tool_call>{"arguments": {"expression": "2"}}</tool_call><|im_end|>',  # no name: plain text
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ct.parse(tok, ids, prompt, [schema], tok.response_template) == parse_response(
            tok, ids, prefix=prompt, tools=[schema]
        ), text
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=None, chat_template_kwargs={}
    )
    results = [
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "tool", "name": "calculator", "content": "x"},
    ]
    assert ct.suffix_ids(tok, results, None) == GRPOTrainer._get_tool_suffix_ids(trainer, results)


# ---------------------------------------------------------------- episodes, scripted
def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def call(expression: str, argument: str = "expression") -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"{argument}": "{expression}"}}}}</tool_call><|im_end|>'


FIRST = {  # each sample's first turn
    "valid": call("23 + 58"),
    "wrong argument": call("23 + 58", "expr"),
    "plain": "81<|im_end|>",
    "twice": call("5 + 6"),
}


def next_turn(tok, ids: list[int]) -> list[int]:
    """A later turn, from the tool result it follows (the same script for raytrain's loop and TRL's)."""
    text = tok.decode(ids)
    if "unexpected keyword" in text[-200:]:
        return ids_of(tok, "no<|im_end|>")
    result = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    return ids_of(tok, call(f"{result} * 2") if result == "11" else f"{result}<|im_end|>")


def trl_tool_loop(tok, samples, prompt, max_iterations, max_completion_length, max_model_len):
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        processing_class=tok,
        _tokenizer=tok,
        _is_vlm=False,
        chat_template=None,
        chat_template_kwargs={},
        tools=[demo_agents.calculator],
        _sync_tool_dicts=[{"calculator": demo_agents.calculator} for _ in samples],
        _async_tool_dicts=[{} for _ in samples],
        max_tool_calling_iterations=math.inf if max_iterations is None else max_iterations,
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=max_model_len)),
        max_completion_length=max_completion_length,
        environment_factories=None,
        _generate_single_turn=lambda ids, *a, **k: ([next_turn(tok, p) for p in ids], None),
    )
    schema = demo_agents.schemas()["calculator"]
    first = [ids_of(tok, FIRST[s]) for s in samples]
    completions = [[parse_response(tok, c, prefix=prompt, tools=[schema])] for c in first]
    prompts = [[{"role": "user", "content": "what is 23 + 58?"}] for _ in samples]
    mask, completions, ids, _, calls, failures, _ = GRPOTrainer._tool_call_loop(
        trainer, prompts, [list(prompt) for _ in samples], first, completions, None, None, {}
    )
    return mask, completions, ids, calls, failures


class InProcess:
    """The tool process's answers, here (the process itself is tested below)."""

    def __init__(self):
        from raytrain.rl.toolbox import Toolbox

        self.toolbox = Toolbox([CALC], {})

    def call(self, e, name, arguments):
        return self.toolbox.call(e.id, name, arguments, e.key)


def play_script(tok, samples, max_iterations, max_completion_length, max_model_len=512, host=None):
    schema = demo_agents.schemas()["calculator"]
    prompt = ct.render(tok, [{"role": "user", "content": "what is 23 + 58?"}], None, gen=True, tools=[schema])
    episodes = [Episode(f"0/0/0/{i}/0", 1000 + i, None, list(prompt), [schema]) for i in range(len(samples))]
    first = {turn_key(e.key, 0): ids_of(tok, FIRST[s]) for e, s in zip(episodes, samples)}

    def generate(prompts, keys, budgets):
        return [(first[k] if k in first else next_turn(tok, p))[:b] for p, k, b in zip(prompts, keys, budgets)], None

    g = GRPOSpec(max_completion_length=max_completion_length, max_tool_calling_iterations=max_iterations)
    play(episodes, generate, host or InProcess(), tok, ct.episode_template(tok), g, max_model_len)
    return prompt, episodes


SCRIPTS = {
    "three": (["valid", "wrong argument", "plain"], None, 200),
    "one round": (["twice", "valid"], 1, 200),
    "overlong": (["valid", "wrong argument"], None, 40),  # the error's text would carry it past 40 tokens
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_scripted_episodes_are_trls_tool_loop(tok, script):
    samples, max_iterations, length = SCRIPTS[script]
    prompt, episodes = play_script(tok, samples, max_iterations, length)
    mask, messages, ids, calls, failures = trl_tool_loop(tok, samples, prompt, max_iterations, length, 512)
    assert [e.completion for e in episodes] == ids
    assert [e.mask for e in episodes] == mask
    assert [e.messages for e in episodes] == messages
    assert (sum(e.calls for e in episodes), sum(e.failures for e in episodes)) == (calls, failures)
    for e in episodes:  # the zeros are exactly the tool results' spans, as the template renders them
        assert len(e.mask) == len(e.completion)
        results = [m for m in e.messages if m["role"] == "tool"]
        spans = [ct.suffix_ids(tok, [m], None) for m in results]
        assert [t for t, m in zip(e.completion, e.mask) if not m] == [t for s in spans for t in s]
    out = metrics([(e.calls, e.failures, e.turns) for e in episodes])
    if script == "three":
        assert out["tools/call_frequency"] == pytest.approx(2 / 3) and out["tools/failure_frequency"] == 0.5
        assert [e.turns for e in episodes] == [2, 2, 1] and episodes[0].messages[-1]["content"] == "81"
    if script == "one round":  # its second call was made, never run: one round, one result
        assert episodes[0].calls == 1 and episodes[0].mask.count(0) > 0 and episodes[0].pending
        assert episodes[0].messages[-1]["tool_calls"][0]["function"]["arguments"] == {"expression": "11 * 2"}
    if script == "overlong":  # the valid call's short result fits; the error's is rolled back, the sample stops
        assert episodes[0].turns == 2 and episodes[1].turns == 1 and all(episodes[1].mask)
        assert [m["role"] for m in episodes[1].messages] == ["assistant"] and episodes[1].failures == 1


# ---------------------------------------------------------------- the loss sees only what the model wrote
def objective(assets, tmp_path, tok, **grpo):
    from conftest import make_job

    from raytrain.objectives.grpo import GRPO

    spec = make_job(
        assets,
        tmp_path,
        model={"path": str(assets / "model-tools")},
        data={"path": str(assets / "arithmetic.jsonl"), "format": "prompt", "seq_len": 256},
        training={
            "objective": "grpo",
            "grpo": {
                "num_generations": 2,
                "max_completion_length": 200,
                "tools": [CALC],
                "rewards": [{"builtin": "accuracy", "column": "solution"}],
                **grpo,
            },
        },
    )
    made = GRPO(spec)
    made.tokenizer, made.ends = tok, {tok.eos_token_id, tok.pad_token_id}
    return made


@pytest.mark.parametrize("loss_type,beta,engine", [("dapo", 0.0, False), ("grpo", 0.04, True), ("dr_grpo", 0.0, False)])
def test_the_loss_with_tool_results_masked_equals_trls(assets, tmp_path, tok, loss_type, beta, engine):
    """Training rows from scripted episodes (prompt + every turn, tool results unlabelled) give
    TRL's _compute_loss on the same completions with its tool_mask, gradient included; with
    engine: vllm's correction, the ratio over the model's tokens only (TRL's mask there too)."""
    from raytrain.rl.losses import importance_ratio, units_of

    prompt, episodes = play_script(tok, ["valid", "wrong argument", "plain"], None, 200)
    grpo = objective(assets, tmp_path, tok, loss_type=loss_type, beta=beta, epsilon_high=0.28)
    g = grpo.g
    mb = {}
    n = len(episodes)
    training_rows(
        grpo, mb, [prompt] * n, [e.completion for e in episodes], [1.2, -0.4, 0.7], n, None, [e.mask for e in episodes]
    )
    targets = mb["labels"][:, 1:]
    mask = (targets != IGNORE).double()
    gen = torch.Generator().manual_seed(0)
    logps = (-2 * torch.rand(targets.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    ref = logps.detach() + 0.5 * torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    sampled = logps.detach() + 0.05 * torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    adv = mb["advantages"].double()
    ratio = importance_ratio(old, sampled, mask, g) if engine else None
    loss, *_ = token_terms(logps, old, ref, adv, mask, g, ratio)
    tokens = int(mask.sum())
    assert mb["_units"] == units_of(loss_type, n, tokens, 200)
    ours = summed_loss(loss, mask, loss_type) / mb["_units"]

    # TRL's tensors: each completion from its first token, right-padded; tool_mask 0 on the results
    start, width = len(prompt) - 1, max(len(e.completion) for e in episodes)  # position t scores token t + 1
    cut = lambda x: x[:, start : start + width]  # noqa: E731
    completion_mask = torch.tensor([[1.0] * len(e.completion) + [0.0] * (width - len(e.completion)) for e in episodes])
    tool_mask = torch.tensor([e.mask + [1] * (width - len(e.mask)) for e in episodes], dtype=torch.float64)
    trl_ratio = None
    if engine:  # TRL's: from old vs sampled over completion_mask x tool_mask (the mode's default: sequence_mask)
        diff = ((cut(old) - cut(sampled)) * completion_mask * tool_mask).sum(-1, keepdim=True)
        trl_ratio = torch.exp(diff).masked_fill(torch.exp(diff) > 3.0, 0.0)
    theirs, _ = trl_loss(
        cut(logps),
        completion_mask.double(),
        cut(old),
        cut(ref),
        adv,
        g,
        trl_ratio,
        tool_mask,
        max_completion_length=200,
    )
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-9)
    (a,), (b,) = torch.autograd.grad(ours, logps), torch.autograd.grad(theirs, logps)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert a[mask == 0].abs().sum() == 0 and a.abs().sum() > 0  # no gradient through a tool's tokens


def test_a_truncated_completion_is_left_out_when_asked(assets, tmp_path, tok):
    grpo = objective(assets, tmp_path, tok, mask_truncated_completions=True)
    prompt = [5, 6, 7]
    ended, cut = [9, 10, tok.eos_token_id], [9, 10, 11]
    mb = {}
    training_rows(grpo, mb, [prompt, prompt], [ended, cut], [1.0, -1.0], 2, None, [[1, 0, 1], [1, 1, 1]])
    labels = mb["labels"]
    assert labels[0, 3:6].tolist() == [9, IGNORE, tok.eos_token_id] and (labels[1] == IGNORE).all()
    assert mb["_units"] == 2  # dapo: the labelled tokens; the truncated completion still counts in the rewards


# ---------------------------------------------------------------- the tool process
USER_TOOLS = '''
import os, time

def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"

def crash(code: int) -> str:
    """Ends its process.

    Args:
        code: the exit code
    """
    os._exit(code)

def die(sides: int, episode_key: int) -> int:
    """Rolls a die, drawn from the episode's key.

    Args:
        sides: the die's faces
    """
    return episode_key % sides + 1

class Counter:
    def reset(self, start, episode_key=0, **row):
        self.n, self.key = int(start), episode_key
        return f" from {start}"

    def add(self, k: int) -> str:
        """Adds.

        Args:
            k: how much
        """
        self.n += k
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n + self.key)
'''


def test_the_tool_process_survives_a_hang_and_a_crash_and_rebuilds_its_episodes(tmp_path, monkeypatch):
    (tmp_path / "agent_tools.py").write_text(USER_TOOLS)
    monkeypatch.chdir(tmp_path)  # user code is imported from the job's working directory
    spec = SimpleNamespace(
        run_dir=str(tmp_path),
        training=SimpleNamespace(
            grpo=GRPOSpec(
                tools=["agent_tools:slow", "agent_tools:crash", "agent_tools:die"],
                environment="agent_tools:Counter",
                tool_timeout_s=2.0,
            )
        ),
    )
    hosts = Hosts(spec)
    try:
        assert "episode_key" not in json.dumps(hosts.tools["die"]) and set(hosts.environments[""]["tools"]) == {"add"}
        assert [s["function"]["name"] for s in hosts.schemas("")] == ["slow", "crash", "die", "add"]
        e = Episode("0/0/0/1/0", 41, "", [], [])
        assert hosts.reset(e, {"start": 10, "solution": "x"}) == " from 10"
        assert hosts.call(e, "add", {"k": 5}) == ("15", False)
        assert hosts.call(e, "die", {"sides": 6}) == (str(41 % 6 + 1), False)  # the key, not the model, draws
        assert hosts.call(e, "nope", {}) == (str({"error": "Tool nope not found."}), True)
        assert hosts.call(e, "add", {"kk": 1})[1] is True  # a wrong argument fails the call, as TRL's does
        started = time.monotonic()
        content, failed = hosts.call(e, "slow", {"seconds": 60})
        assert failed and "tool_timeout_s=2" in content and time.monotonic() - started < 30
        assert hosts.call(e, "add", {"k": 1}) == ("16", False)  # rebuilt by replaying reset and add(5)
        content, failed = hosts.call(e, "crash", {"code": 3})
        assert failed and "exit code 3" in content
        assert hosts.call(e, "add", {"k": 1}) == ("17", False)
        assert hosts.reward(e) == 17 + 41 and hosts.restarts == 2
        hosts.end([e])
    finally:
        hosts.close()


# ---------------------------------------------------------------- validate
def tools_job(assets: Path, tmp: Path, **over) -> Path:
    from conftest import deep_merge

    raw = {
        "name": "t",
        "model": {"path": str(assets / "model-tools")},
        "data": {"path": str(assets / "arithmetic.jsonl"), "format": "prompt", "seq_len": 96},
        "training": {
            "objective": "grpo",
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "max_steps": 2,
            "grpo": {
                "num_generations": 2,
                "max_completion_length": 48,
                "tools": [CALC],
                "rewards": [{"builtin": "accuracy", "column": "solution"}],
            },
        },
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp / "runs")},
        "tracking": {"experiment": "tests"},
    }
    path = tmp / "job.yaml"
    path.write_text(json.dumps(deep_merge(raw, over)))
    return path


def test_validate_refuses_what_cannot_run_and_names_what_is_not_promised(assets, tmp_path, tok, monkeypatch):
    import shutil

    from raytrain.validate import preflight

    monkeypatch.chdir(tmp_path)

    def report(**over):
        out = preflight.check(str(tools_job(assets, tmp_path, **over)))
        return [(p.field, p.severity, p.message) for p in out.problems]

    fine = report(training={"grpo": {"nondeterministic_tools": ["calculator"]}})
    assert not [p for p in fine if p[1] == "error"], fine
    assert any(f == "training.grpo.tools" and "conformance" in m for f, _, m in fine)
    assert any(f == "training.grpo.nondeterministic_tools" and "not promised" in m for f, _, m in fine)

    broken = tmp_path / "rewriting-tokenizer"  # a template whose earlier assistant turns change
    shutil.copytree(assets / "model-tools", broken)
    (broken / "chat_template.jinja").write_text(rewrites_old_turns(tok))
    [(field, _, message)] = [p for p in report(model={"tokenizer": str(broken)}) if p[1] == "error"]
    assert field == "training.grpo.tools" and "appending turn 3 (tool) changes how turn 2 (assistant)" in message

    (tmp_path / "my_tools.py").write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    errors = [
        p
        for p in report(training={"grpo": {"tools": ["no_such_module:f", "my_tools:sub", "my_tools:add"]}})
        if p[1] == "error"
    ]
    assert [(f, m.split(":")[0].split(" here")[0]) for f, _, m in errors] == [
        ("training.grpo.tools[0]", "no module 'no_such_module'"),
        ("training.grpo.tools[1]", "my_tools defines no function 'sub'"),
        ("training.grpo.tools[2]", "add has no docstring"),
    ], errors

    sft = report(training={"objective": "sft"}, data={"format": "chat", "path": str(assets / "tool-sft.jsonl")})
    assert [(f, m.split(":")[0]) for f, s, m in sft if s == "error"] == [
        (
            "training.grpo.tools",
            "tools and environments run in GRPO's rollouts (episodes of several turns), and training.objective is sft",
        )
    ], sft


def test_environment_actors_outlive_a_timeout_and_every_rank_finds_its_episodes_again(ray_address, tmp_path):
    """Two workers' pools (ranks) over one actor: a call that overruns kills the actor; Ray starts it
    again; each rank, seeing a new incarnation, replays its own episodes there before its next call."""
    import ray

    from raytrain.job.agents import ACTOR_NAMESPACE, actor_prefix
    from raytrain.rl.env_actors import ActorPool
    from raytrain.rl.tool_host import Lost

    env = {None: "raytrain.demo_agents:GuessingGame"}
    rank0, rank1 = (ActorPool(str(tmp_path), 1, [], env, 60.0) for _ in range(2))
    try:
        assert rank0.pids() == rank1.pids()  # one actor, found by name
        mine, theirs = Episode("0/0/0/1/0", 8, "", [], []), Episode("0/0/0/2/0", 9, "", [], [])
        rank0.ask({"op": "reset", "episode": mine.id, "env": "", "row": {"secret": 7}, "key": 8}, key=8)
        rank1.ask({"op": "reset", "episode": theirs.id, "env": "", "row": {"secret": 2}, "key": 9}, key=9)

        def guess(pool, e, n):
            request = {"op": "call", "episode": e.id, "name": "guess", "arguments": {"number": n}, "key": e.key}
            return pool.ask(request, key=e.key)["content"]

        assert guess(rank0, mine, 5) == "higher" and guess(rank1, theirs, 5) == "lower"
        before = rank0.pids()
        rank0.timeout_s = 1e-4
        with pytest.raises(Lost, match="tool_timeout_s"):
            guess(rank0, mine, 6)
        rank0.timeout_s = 60.0
        assert rank0.pids() != before and rank0.restarts == 1  # a fresh actor, under the same name
        assert guess(rank0, mine, 7) == "correct" and guess(rank1, theirs, 2) == "correct"
        rewards = [
            p.ask({"op": "rewards", "episodes": [e.id]}, key=e.key)["rewards"][0]
            for p, e in ((rank0, mine), (rank1, theirs))
        ]
        assert rewards == [0.75, 0.75]  # second tries each: the lost guess undone, the earlier one replayed
    finally:
        for i in range(1):
            ray.kill(ray.get_actor(f"{actor_prefix(str(tmp_path))}{i}", namespace=ACTOR_NAMESPACE))


def test_rows_are_routed_to_their_environment_and_render_its_tools(assets, tmp_path, tok, monkeypatch):
    from raytrain.errors import JobError
    from raytrain.objectives.grpo_agents import Agents

    (tmp_path / "agent_tools.py").write_text(USER_TOOLS)
    monkeypatch.chdir(tmp_path)
    grpo = objective(
        assets,
        tmp_path,
        tok,
        tools=[],
        environment={"game": "raytrain.demo_agents:GuessingGame", "count": "agent_tools:Counter"},
        rewards=[],
    )
    agents = Agents(grpo.spec, tok)
    try:
        assert agents.env_rewards == ["Counter", "GuessingGame"]  # TRL: one reward column a rewarding class
        user = [{"role": "user", "content": "play"}]
        columns = [
            {"prompt": user, "environment": "game", "secret": 3},
            {"prompt": user, "environment": "count", "start": 4},
        ]
        asks = [([[1], [1]], columns, [(0, 0, 0), (0, 0, 1)], None, [10, 11, 12, 13])]
        (made,) = agents.episodes(0, asks)
        assert [e.env for e in made] == ["game", "game", "count", "count"] and [e.key for e in made] == [10, 11, 12, 13]
        assert [s["function"]["name"] for s in made[0].tools] == ["guess"]
        assert [s["function"]["name"] for s in made[2].tools] == ["add"]
        game = tok.decode(made[0].prompt)
        assert "tools: guess(number)" in game and "play (from 1 to 9)" in game  # reset's observation appended
        assert "tools: add(k)" in tok.decode(made[2].prompt) and "play from 4" in tok.decode(made[2].prompt)
        scores = agents.env_scores(made)
        assert [math.isnan(x) for s in scores for x in s] == [True, False, True, False, False, True, False, True]
        assert scores[2][0] == 4 + 12  # Counter's reward: its count plus its episode's key
        with pytest.raises(JobError, match="'elsewhere', not one of"):
            agents.episodes(0, [([[1]], [{"prompt": user, "environment": "elsewhere"}], [(0, 0, 2)], None, [1, 2])])
    finally:
        agents.close()
