"""`training.grpo.environment_workers: N`: a pool of N Ray actors holding the run's environments
(and its tools), apart from the trainers, so that a heavy environment scales by itself and a
trainer's restart does not restart it. Each answers the tool process's requests (tool_host.serve).

The actors are named (job/agents.actor_prefix of the run directory, then their index) and detached:
the first worker to need one starts it, every later worker (a restarted group's included) finds it
by name, and the driver removes them when the run ends (driver/launcher.py). An episode lives on the
actor its key picks, so every rank finds it where it was.

A call that overruns tool_timeout_s kills its actor, which Ray starts again; a crash restarts it
too. Each worker keeps its own episodes' resets and calls (tool_host.Replaying) per actor and each
answer carries the actor's incarnation: a worker that sees a new one replays its episodes there
first, so that a restart one rank caused never leaves another rank's episodes behind."""

from __future__ import annotations

import os
import time

from raytrain.job.agents import ACTOR_NAMESPACE, actor_prefix
from raytrain.rl.tool_host import START_S, Lost, Replaying, serve


class EnvironmentActor:
    def __init__(self, tools: list[str], environments: dict):
        from raytrain.rl.toolbox import Toolbox, ToolError

        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        try:
            self.toolbox, self.failure = Toolbox(tools, {k or None: v for k, v in environments.items()}), None
        except ToolError as exc:
            self.toolbox, self.failure = None, str(exc)

    def ask(self, request: dict) -> dict:
        out = serve(self.toolbox, request) if self.toolbox is not None else {"fatal": self.failure}
        return {**out, "incarnation": self.incarnation}

    def pid(self) -> int:
        return os.getpid()


def actors(run_dir: str, n: int, tools: list[str], environments: dict) -> list:
    """The run's N environment actors, started where none runs yet."""
    import ray

    cls = ray.remote(EnvironmentActor)
    return [
        cls.options(
            name=f"{actor_prefix(run_dir)}{i}",
            namespace=ACTOR_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,  # a call is never run twice behind the worker's back: it replays itself
            num_cpus=0,
        ).remote(tools, {k or "": v for k, v in environments.items()})
        for i in range(n)
    ]


class ActorPool:
    """The worker's side of the pool: the same `ask` as a ToolProcess, routed by episode key."""

    def __init__(self, run_dir: str, n: int, tools: list[str], environments: dict, timeout_s: float):
        self.handles = actors(run_dir, n, tools, environments)
        self.timeout_s, self.restarts = timeout_s, 0
        self.kept = [Replaying() for _ in self.handles]
        self.seen: list[str | None] = [None] * n
        self.catalog = self._ask(0, {"op": "catalog"}, START_S)
        for i in range(1, n):
            self._ask(i, {"op": "ping"}, START_S)

    def route(self, key: int) -> int:
        return key % len(self.handles)

    def _ask(self, i: int, request: dict, timeout: float | None = None) -> dict:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from raytrain.errors import JobError

        try:
            answer = ray.get(self.handles[i].ask.remote(request), timeout=timeout or self.timeout_s)
        except GetTimeoutError:
            ray.kill(self.handles[i], no_restart=False)  # Ray starts it again; the next ask replays
            self._back(i)
            raise Lost(f"the call took longer than training.grpo.tool_timeout_s={self.timeout_s:g} s") from None
        except RayActorError as exc:
            self._back(i)
            raise Lost(f"the environment actor died during the call ({type(exc).__name__})") from None
        if "fatal" in answer:
            raise JobError(answer["fatal"])
        if self.seen[i] is not None and answer["incarnation"] != self.seen[i]:
            self.seen[i] = answer["incarnation"]  # a fresh actor: bring this rank's episodes back, then ask again
            held, self.kept[i].history = self.kept[i].history, {}
            for requests in held.values():
                for kept in requests:
                    self._ask(i, kept, START_S)
            return self._ask(i, request, timeout)
        self.seen[i] = answer["incarnation"]
        self.kept[i].keep(request)
        return answer

    def _back(self, i: int) -> None:
        """Wait for Ray to have started actor i again (a request sent meanwhile would fail)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        old, self.seen[i], self.restarts = self.seen[i], "restarted", self.restarts + 1
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:  # until a new incarnation answers: ray.kill is asynchronous, the old one may answer first
                if ray.get(self.handles[i].ask.remote({"op": "ping"}), timeout=30)["incarnation"] != old:
                    return
            except (RayActorError, GetTimeoutError):
                pass
            time.sleep(0.5)

    def ask(self, request: dict, timeout: float | None = None, key: int = 0) -> dict:
        if request["op"] == "end":  # an episode ends on the actor it lives on
            for i in range(len(self.handles)):
                mine = [e for e in request["episodes"] if e in self.kept[i].history]
                if mine:
                    self._ask(i, {"op": "end", "episodes": mine}, timeout)
            return {}
        return self._ask(self.route(key), request, timeout)

    def restart(self) -> None:
        """Nothing to do at once: the actor Ray restarts replays at the next ask (`_ask`)."""

    def pids(self) -> list[int]:
        import ray

        return ray.get([h.pid.remote() for h in self.handles])

    def close(self) -> None:
        """The actors outlive the worker: the driver removes them at the run's end."""
