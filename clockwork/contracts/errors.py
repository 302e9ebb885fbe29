"""Exceptions that carry their own exit code: one definition of each for every Clockwork package.

Every user-facing failure in Clockwork is a :class:`ClockworkError`. The command lines have one top-level
handler (:mod:`clockwork.contracts.invoke`) that prints ``clockwork: <message>`` and exits with the error's code,
so code deep in the stack never calls ``sys.exit`` or prints to stderr itself (the click pattern).

Exit codes: 1 any other failure (:class:`ProtocolError` and :class:`WireError` among them), 2 configuration,
3 sandbox, 4 Slurm, 5 the node daemon refused, 6 no node daemon answered, 77 needs root.

Three of them are shared across the packages on purpose, each defined once here: :class:`ConfigError` (the node
side's configuration file and TorchPass's settings alike), :class:`ProtocolError` (a message that breaks its
protocol: the daemon's wire, the coordinator's wire, a rank's launch environment) and :class:`WireError` (bytes
from a socket that are refused or a stream that broke: Fleet Lens's packets and summaries, TorchPass's
peer-copy stream).
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


class ConfigError(ClockworkError, ValueError):
    """The configuration (file, environment or command line) holds an unknown key or a bad value; the message
    names the key and what is allowed. A ValueError too: TorchPass's settings readers raised one before."""

    exit_code = 2


class ProtocolError(ClockworkError, ValueError):
    """A message that arrived whole but breaks its protocol: not decodable, too large, an unknown op, a missing or
    unreadable field, a launch environment a rank cannot read.

    ``code`` is the machine-readable reason an error reply carries (the daemon's wire: ``bad_request``,
    ``too_large``, ``bad_version``, ``forbidden``, ...); the message says what was wrong and goes into the reply
    as it is (:attr:`message`).
    """

    def __init__(self, message: str, *, code: str = "bad_request", exit_code: int | None = None) -> None:
        super().__init__(message, exit_code=exit_code)
        self.code = code


class WireError(ClockworkError, ConnectionError):
    """Bytes on a socket that this end refuses, or a stream that broke off: a packet, summary or frame that does
    not authenticate or does not parse, a peer that closed mid-stream or did not keep what it was sent.

    Unlike a :class:`ProtocolError`, nothing answers it: the packet is dropped and counted, or the connection is
    closed. A ConnectionError (so an OSError), as the socket failures it stands beside.
    """


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


class VersionSkewError(ClockworkError):
    """Two parts of one job run different Clockwork/TorchPass versions (an image older or newer than the node's
    daemon, a guest from another image than the job's): refused at start, both versions named."""

    exit_code = 8
