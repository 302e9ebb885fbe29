"""Exceptions that carry their own exit code.

Every user-facing failure in Clockwork is a :class:`ClockworkError`. The CLI has one top-level handler
that prints ``clockwork: <message>`` and exits with the error's code, so code deep in the stack never
calls ``sys.exit`` or prints to stderr itself (the click pattern).
"""

from __future__ import annotations


class ClockworkError(Exception):
    """Base class: a failure the user can act on, with a message that says what and how."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(ClockworkError):
    """The configuration (file, environment or command line) holds an unknown key or a bad value."""

    exit_code = 2


class NeedRootError(ClockworkError):
    """The operation needs privileges the caller does not have."""

    exit_code = 77


class SlurmError(ClockworkError):
    """A Slurm command failed or Slurm answered something we cannot use."""

    exit_code = 4


class SandboxError(ClockworkError):
    """The embedded sandbox cluster could not be built, reached or torn down."""

    exit_code = 3


class DaemonError(ClockworkError):
    """The node daemon refused a request (its error ``code`` and message), or cannot start.

    ``code`` is the daemon's machine-readable error code (``forbidden``, ``unknown_job``, ...), so
    callers such as the Prolog can branch on it without parsing the message.
    """

    exit_code = 5

    def __init__(self, message: str, *, code: str = "error", exit_code: int | None = None) -> None:
        super().__init__(message, exit_code=exit_code)
        self.code = code


class DaemonUnavailableError(DaemonError):
    """No daemon answered within the timeout (none runs, or it hangs): the caller may start or restart it."""

    exit_code = 6

    def __init__(self, message: str) -> None:
        super().__init__(message, code="unavailable")
