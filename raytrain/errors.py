"""Errors meant for the user: their message is the whole story (what, where, the fix).

Workers raise them; the launcher finds them in Ray's wrapped failures and prints the
message alone, so a user never reads a traceback from deep inside a worker.
"""

MARKER = "raytrain-error:"


class JobError(Exception):
    """A problem with the job or its inputs, not a bug in raytrain."""

    def __str__(self) -> str:
        return f"{MARKER} {super().__str__()}"


class BadRowError(JobError):
    """A dataset row the job cannot train on, under `data.bad_rows: fail`."""


def user_message(exc: BaseException) -> str | None:
    """The first JobError message anywhere in an exception's text (Ray nests worker errors)."""
    text = str(exc)
    for cause in _chain(exc):
        text += "\n" + str(cause)
    for line in text.splitlines():
        if MARKER in line:
            return line.split(MARKER, 1)[1].strip()
    return None


# What a restart can mend, whatever the job: storage, the network, a collective (a peer lost mid-call).
TRANSIENT_TYPES = (
    "OSError",
    "ConnectionError",
    "TimeoutError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "RayActorError",
    "ActorDiedError",
    "NodeDiedError",
)
TRANSIENT_WORDS = (
    "AWS Error",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "Timed out",
    "gloo",
    "NCCL",
    "Socket",
    "unreachable",
)


def transient(exc: BaseException) -> bool:
    """An error of storage, the network or a collective: retried within failure.max_failures, never
    taken for one the job's own code or data makes (the same error twice ends such a job)."""
    for cause in _chain(exc):
        if any(t.__name__ in TRANSIENT_TYPES for t in type(cause).__mro__):
            return True
        if any(w in str(cause) for w in TRANSIENT_WORDS):
            return True
    return False


def _chain(exc: BaseException):
    """The exception, its causes, and the per-worker failures Ray Train keeps beside its own
    (truncated) message: the worker's error text is where a JobError's line survives."""
    seen, todo = set(), [exc]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "worker_failures", None) or {}
        todo += [exc.__cause__, exc.__context__, getattr(exc, "controller_failure", None), *failures.values()]


def forward_worker_stdout_only() -> None:
    """After ray.init: print workers' stdout (raytrain's progress lines) on the driver, and
    leave their stderr in the Ray logs. Ray Train and Ray Data log a failing task's whole
    stack on stderr before the driver sees the error; the driver says it in one line.
    RAYTRAIN_WORKER_STDERR=1 keeps Ray's forwarding of both streams (debugging)."""
    import os

    if os.environ.get("RAYTRAIN_WORKER_STDERR") == "1":
        return
    from raytrain.private_apis import stdstream_dispatcher

    dispatcher = stdstream_dispatcher()
    if dispatcher is None:  # another Ray layout: its default forwarding stays
        return
    for name, handler in list(dispatcher.handlers):
        if name == "ray_print_logs":
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, lambda data, show=handler: _show_stdout(data, show))


def _show_stdout(data: dict, show) -> None:
    """raytrain's own lines (rank 0's step lines, the start-up line) as the driver's own, without
    Ray's `(RayTrainWorker pid=...)` prefix and colour codes; any other stdout line as Ray shows it."""
    if data.get("is_err"):
        return
    lines = data.get("lines", [])
    ours = [line for line in lines if line.startswith("[raytrain] ")]
    for line in ours:
        print(line, flush=True)
    if len(ours) < len(lines):
        show({**data, "lines": [line for line in lines if not line.startswith("[raytrain] ")]})
