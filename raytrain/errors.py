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


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
