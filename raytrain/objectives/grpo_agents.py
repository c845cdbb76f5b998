"""GRPO's rollouts as episodes, where the job has tools or an environment (training.grpo.tools,
.environment): what objectives/grpo.py's `begin` calls instead of a single turn.

Each of a rank's (prompt, generation) pairs is an episode (rl/episodes.py) keyed as a completion
is: its environment (the row's `environment` column routes it where a mapping names several) is
reset with the row's columns, whatever reset returns is appended to the prompt's last message (as
TRL does), and the prompt is rendered with its tools' schemas by the chat template validate chose
(model/chat_templates.py: the job's own, or TRL's training template of its family). The episodes
then play out together, each turn's continuations in one batch: one engine request (engine: vllm),
or micro-batch-sized forwards of the policy that every rank runs alike (engine: hf, whose forwards
gather sharded layers collectively: a rank with less to do runs padding)."""

from __future__ import annotations

import math

import torch

from raytrain.errors import JobError
from raytrain.model.chat_templates import TemplateProblem, episode_template, render
from raytrain.rl.episodes import Episode, metrics, play
from raytrain.rl.hosts import Hosts
from raytrain.rl.sampling import rollout


class Agents:
    def __init__(self, spec, tokenizer):
        self.spec, self.g, self.tok = spec, spec.training.grpo, tokenizer
        try:
            self.template = episode_template(tokenizer)
        except TemplateProblem as exc:
            raise JobError(f"training.grpo.tools: {exc}") from None
        self.hosts = Hosts(spec)
        # TRL: an environment class with get_reward is a reward named after it, weight 1
        self.env_rewards = sorted({e["class"] for e in self.hosts.environments.values() if e["reward"]})
        self.restarts = 0  # the tool processes' restarts before this step

    def close(self) -> None:
        self.hosts.close()

    def _env_of(self, columns: dict, row) -> str | None:
        envs = self.g.environments
        if not envs:
            return None
        if None in envs:
            return ""
        name = columns.get("environment")
        if name not in envs:
            raise JobError(
                f"training.grpo.environment routes rows by their `environment` column, and row {row} (source, "
                f"epoch, row) has {name!r}, not one of {sorted(envs)}: fix the row, or add it to the mapping"
            )
        return name

    def episodes(self, step: int, asks) -> list[list[Episode]]:
        """Each micro-batch's episodes, reset and their prompts rendered."""
        g, out = self.g, []
        for prompts, columns, ids, _, keys in asks:
            made = []
            for j, (cols, row) in enumerate(zip(columns, ids)):
                if not isinstance(cols["prompt"], list):
                    raise JobError(
                        f"training.grpo.tools: row {row} (source, epoch, row) has a plain-text prompt; tools need "
                        "conversational prompts (a list of messages) that the chat template renders with them"
                    )
                for k in range(g.num_generations):
                    env = self._env_of(cols, row)
                    e = Episode(f"{step}/{'/'.join(map(str, row))}/{k}", keys[j * g.num_generations + k], env, [], [])
                    messages = [dict(m) for m in cols["prompt"]]
                    if env is not None:
                        observation = self.hosts.reset(e, {c: v for c, v in cols.items() if c != "prompt"})
                        if observation:  # TRL: appended to the last message's content
                            messages[-1]["content"] = messages[-1]["content"] + observation
                    e.tools = self.hosts.schemas(env)
                    e.prompt = render(self.tok, messages, self.template.chat_template, gen=True, tools=e.tools)
                    if len(e.prompt) + g.max_completion_length > self.spec.data.seq_len:
                        raise JobError(
                            f"row {row} (source, epoch, row): its prompt with the tools' schemas is "
                            f"{len(e.prompt)} tokens, and with max_completion_length={g.max_completion_length} it "
                            f"does not fit data.seq_len={self.spec.data.seq_len}: raise seq_len"
                        )
                    made.append(e)
            out.append(made)
        return out

    def rollout(self, strategy, step: int, asks, eos: set[int], engine) -> tuple[list[list[Episode]], dict]:
        """Every episode of the rank's step, played out; (episodes per micro-batch, seconds)."""
        per_mb = self.episodes(step, asks)
        flat = [e for mb in per_mb for e in mb]
        g, pad = self.g, self.tok.pad_token_id
        if engine is not None:
            generate = lambda p, k, b: engine.generate(p, k, eos, b)  # noqa: E731 - one turn's batch
            agree = len
        else:
            chunk = max(1, self.spec.training.micro_batch_size * g.num_generations)

            def generate(prompts, keys, budgets):
                out = []
                for i in range(
                    _agreed(math.ceil(len(prompts) / chunk), strategy.device)
                ):  # every rank runs as many forwards
                    part = slice(i * chunk, (i + 1) * chunk)
                    asked = prompts[part] or [[pad]]
                    args = (g.max_completion_length, g.temperature, g.top_p, eos, pad)
                    made = rollout(strategy, asked, keys[part] or [0], *args, budgets=budgets[part] or [0])
                    out += made if prompts[part] else []
                return out, None

            agree = lambda calling: _agreed(len(calling), strategy.device)  # noqa: E731
        seconds = play(flat, generate, self.hosts, self.tok, self.template, g, self.spec.data.seq_len, agree)
        return per_mb, seconds

    def env_scores(self, episodes: list[Episode]) -> list[list[float]]:
        """Per episode, each rewarding environment class's get_reward (NaN where the episode played another)."""
        out = []
        for e in episodes:
            cls = self.hosts.environments[e.env]["class"] if e.env is not None else None
            value = self.hosts.reward(e) if cls in self.env_rewards else None
            out.append([math.nan if cls != name or value is None else value for name in self.env_rewards])
        return out

    def finish(self, episodes: list[list[Episode]], everyone: list[tuple], tools_s: float) -> dict:
        """The step's tool metrics over the global batch (`everyone`: each episode's calls, failures,
        turns); its environments back to their pools."""
        if self.g.environments:
            self.hosts.end([e for mb in episodes for e in mb])
        restarts, self.restarts = self.hosts.restarts - self.restarts, self.hosts.restarts
        return {**metrics(everyone), "time/tools_s": tools_s, "tools/restarts": float(restarts)}  # host: a count


def _agreed(n: int, device) -> int:
    """The ranks' largest n (engine: hf: they run the same forwards)."""
    t = torch.tensor([n], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())  # host: the ranks' agreement on a count
