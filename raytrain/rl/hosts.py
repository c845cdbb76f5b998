"""A training worker's handle on its tools and environments, wherever they run: its tool process
(tool_host.py) or the run's environment actors (env_actors.py), which answer the same requests."""

from __future__ import annotations

from raytrain.errors import JobError
from raytrain.rl.env_actors import ActorPool
from raytrain.rl.tool_host import Lost, ToolProcess


class Hosts:
    """A worker's tools and environments, wherever they run (its tool process, or the run's
    environment actors): the requests an episode makes, each call's failure mended (a Lost call is
    an `{"error": ...}` result and a fresh host), and the seconds they took."""

    def __init__(self, spec):
        g = spec.training.grpo
        if g.environment_workers:
            self.host = ActorPool(spec.run_dir, g.environment_workers, g.tools, g.environments, g.tool_timeout_s)
        else:
            self.host = ToolProcess(g.tools, g.environments, g.tool_timeout_s)
        catalog = self.host.catalog["catalog"]
        self.tools, self.environments = catalog["tools"], catalog["environments"]

    def schemas(self, env: str | None) -> list[dict]:
        """The schemas an episode's prompt renders: the tools, then its environment's methods."""
        own = self.environments[env]["tools"] if env is not None else {}
        return list(self.tools.values()) + [s for name, s in own.items() if name not in self.tools]

    def _needed(self, request: dict, key: int, what: str) -> dict:
        """A request an episode cannot do without (its reset, its reward): Lost stops the job."""
        try:
            return self.host.ask(request, key=key)
        except Lost as why:
            raise JobError(f"training.grpo.environment: {what}: {why}; raise tool_timeout_s, or fix the environment")

    def reset(self, e, row: dict):
        request = {"op": "reset", "episode": e.id, "env": e.env, "row": row, "key": e.key}
        return self._needed(request, e.key, "reset")["observation"]

    def call(self, e, name: str, arguments) -> tuple[str, bool]:
        request = {"op": "call", "episode": e.id, "name": name, "arguments": arguments, "key": e.key}
        try:
            answer = self.host.ask(request, key=e.key)
        except Lost as why:
            self.host.restart()
            return str({"error": str(why)}), True
        return answer["content"], answer["failed"]

    def reward(self, e) -> float | None:
        return self._needed({"op": "rewards", "episodes": [e.id]}, e.key, "get_reward")["rewards"][0]

    def end(self, episodes: list) -> None:
        self.host.ask({"op": "end", "episodes": [e.id for e in episodes]})

    @property
    def restarts(self) -> int:
        return self.host.restarts

    def close(self) -> None:
        self.host.close()
