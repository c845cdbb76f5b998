"""Errors meant for the user: their message is the whole story (what, where, the fix).

Workers raise them; the launcher finds them in Ray's wrapped failures and prints the
message alone, so a user never reads a traceback from deep inside a worker.
"""

import errno

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


class TransientError(Exception):
    """Storage or the network failed for now (a lease that stayed unreachable through its retries):
    not the job's own fault, so a restart within failure.max_failures may mend it (`transient`)."""


# What a restart can mend, whatever the job: storage, the network, a collective (a peer lost mid-call).
# By type: these never come from the job's own code or data.
TRANSIENT_TYPES = (
    "TransientError",
    "Unreadable",  # rundir/versioned.py: a record that could not be read or written now
    "ConnectionError",
    "TimeoutError",
    "DistNetworkError",
    "DistStoreError",
    "RayActorError",
    "ActorDiedError",
    "NodeDiedError",
)
# An OSError by its errno: the network or a network file system, not a missing file, a refused
# permission, a full or read-only disk (a restart meets those again: FileNotFoundError and
# PermissionError are OSErrors too, and used to count).
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EHOSTUNREACH",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "EPIPE",
        "ESTALE",
        "EIO",
        "EAGAIN",
    )
    if hasattr(errno, name)
)
# An OSError without an errno (pyarrow words an object store's answer so) by the answer it names:
# throttling, a 5xx, a connection lost. Not ACCESS_DENIED, NO_SUCH_KEY or NO_SUCH_BUCKET.
STORAGE_WORDS = (
    "SLOW_DOWN",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "NETWORK_CONNECTION",
    "REQUEST_TIMEOUT",
    "THROTTLING",
    "HTTP 500",
    "HTTP 502",
    "HTTP 503",
    "HTTP 504",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "Timed out",
)
# A collective's error (torch raises DistBackendError, or a RuntimeError from gloo) counts only when
# it says a peer or the link went: "NCCL" or "gloo" alone also names an invalid argument, a
# mismatched shape or an out-of-memory, which a restart repeats.
PEER_LOST_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "remote process exited",
    "unhandled system error",
    "communicator was aborted",
    "Socket Timeout",
    "Timed out waiting",
    "Watchdog caught collective operation timeout",
)


def transient(exc: BaseException) -> bool:
    """An error of storage, the network or a collective: retried within failure.max_failures, never
    taken for one the job's own code or data makes (the same error twice ends such a job)."""
    return any(_transient_one(cause) for cause in _chain(exc))


def _transient_one(exc: BaseException) -> bool:
    names = {t.__name__ for t in type(exc).__mro__}
    if names & set(TRANSIENT_TYPES):
        return True
    text = str(exc)
    if isinstance(exc, OSError):
        if exc.errno is not None:
            return exc.errno in TRANSIENT_ERRNOS
        return any(w in text for w in STORAGE_WORDS)
    if isinstance(exc, RuntimeError):  # DistBackendError is one; so is what gloo raises
        return any(w in text for w in PEER_LOST_WORDS)
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
