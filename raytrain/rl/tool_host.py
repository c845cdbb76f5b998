"""The process apart where a training worker's tools and environments run (toolbox.py), and the
worker's side of it, over a pipe of JSON lines (as vllm_server.py's engine is driven).

Each call has `tool_timeout_s`. A call that overruns it, or takes its process down (a segfault,
os._exit, memory), costs that call alone: its result is `{"error": ...}` (a failure, as TRL counts
one), the process is killed and started again, and the episodes it held are rebuilt by replaying
their resets and calls, in order, on fresh instances (tools and environments are functions of their
calls and episode keys, so the replay restores what was there). The worker never runs the user's
code and never waits past a timeout. The process dies with its worker (PR_SET_PDEATHSIG), as the
vLLM engine does; its stderr, and whatever the tools print, go to a log beside it.

hosts.py's `Hosts` (the worker's handle) spreads episodes over one such process, or over the Ray actors
of env_actors.py, which answer the same requests."""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from raytrain.errors import JobError

START_S = 300  # importing the user's modules (and transformers, for the schemas) on a busy node


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Lost(Exception):
    """The tool process overran a call's time or died; the message says which."""


class Replaying:
    """Requests whose effects an episode's state depends on (its reset and calls), kept so that a
    host started again can be brought back to where the lost one was."""

    def __init__(self):
        self.history: dict[str, list[dict]] = {}

    def keep(self, request: dict) -> None:
        if request["op"] == "reset":
            self.history[request["episode"]] = [request]
        elif request["op"] == "call" and request["episode"] in self.history:
            self.history[request["episode"]].append(request)
        elif request["op"] == "end":
            for episode in request["episodes"]:
                self.history.pop(episode, None)

    def replay(self, ask, episodes=None) -> None:
        for episode, requests in self.history.items():
            if episodes is None or episode in episodes:
                for request in requests:
                    ask(request)


class ToolProcess(Replaying):
    """One tool process of a worker: `ask(request, timeout)` -> its answer, or Lost."""

    def __init__(self, tools: list[str], environments: dict, timeout_s: float):
        super().__init__()
        self.args = json.dumps({"tools": tools, "environments": {k or "": v for k, v in environments.items()}})
        self.timeout_s = timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix=f"raytrain-tools-{os.getpid()}-", suffix=".log", delete=False)
        self.restarts = 0
        self._start()
        self.catalog = self.ask({"op": "catalog"}, START_S)

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raytrain.rl.tool_host", self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            preexec_fn=_die_with_parent,
        )
        self.buffer = b""

    def _line(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Lost(f"the call took longer than training.grpo.tool_timeout_s={self.timeout_s:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                raise Lost(f"the tool process ended (exit code {code}) during the call")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def ask(self, request: dict, timeout: float | None = None, key: int = 0) -> dict:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise Lost(f"the tool process ended (exit code {self.proc.wait()}) before the call") from None
        answer = json.loads(self._line(timeout or self.timeout_s))
        if "fatal" in answer:  # the user's code cannot be loaded, or reset/get_reward raised
            raise JobError(answer["fatal"])
        self.keep(request)
        return answer

    def restart(self) -> None:
        """A fresh process, brought back to the episodes the lost one held."""
        self.proc.kill()
        self.proc.wait()
        self.restarts += 1
        self._start()
        self.ask({"op": "ping"}, START_S)  # loaded (the schemas, which import transformers, are not needed again)
        held, self.history = self.history, {}
        for requests in held.values():
            for request in requests:
                self.ask(request)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        os.unlink(self.log.name)


def serve(toolbox, request: dict) -> dict:
    """One request against a Toolbox (the tool process's loop and an environment actor both answer so)."""
    op = request["op"]
    if op == "ping":
        return {}
    if op == "catalog":
        return {"catalog": toolbox.catalog()}
    if op == "reset":
        try:
            observation = toolbox.reset(request["episode"], request["env"], request["row"], request["key"])
        except Exception as exc:  # noqa: BLE001 - the environment's own failure: the job stops with its words
            return {
                "fatal": f"training.grpo.environment: reset raised {type(exc).__name__}: {exc} (row {request['row']})"
            }
        return {"observation": observation if observation is None or isinstance(observation, str) else str(observation)}
    if op == "call":
        content, failed = toolbox.call(request["episode"], request["name"], request["arguments"], request["key"])
        return {"content": content, "failed": failed}
    if op == "rewards":
        try:
            return {"rewards": toolbox.rewards(request["episodes"])}
        except Exception as exc:  # noqa: BLE001
            return {"fatal": f"training.grpo.environment: get_reward raised {type(exc).__name__}: {exc}"}
    if op == "end":
        toolbox.end(request["episodes"])
        return {}
    return {"fatal": f"unknown request {op!r}"}


def main() -> None:
    args = json.loads(sys.argv[1])
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the tools' own prints go to the log, never into the protocol
    from raytrain.rl.toolbox import Toolbox, ToolError

    try:
        toolbox = Toolbox(args["tools"], {k or None: v for k, v in args["environments"].items()})
    except ToolError as exc:
        toolbox, failure = None, str(exc)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        try:
            out = serve(toolbox, request) if toolbox is not None else {"fatal": failure}
        except Exception as exc:  # noqa: BLE001 - never a traceback into the protocol
            out = {"fatal": f"the tool process failed on {request['op']}: {type(exc).__name__}: {exc}"}
        answer.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
