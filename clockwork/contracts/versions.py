"""Which Clockwork/TorchPass version each side of a wire runs, and the one check that refuses a mismatch.

TorchPass ships inside the user's image when a job runs in a container; the node daemon is the node's. The two
can differ (an image built months ago, a node upgraded since), and so can two images of one job (a borrowed node's
guest pulled a newer tag). Their wires are versioned by schema (the daemon's ``v``, the coordinator's ops), but a
release may change what a field means without changing its shape, so the package version itself travels: the
daemon's ``ping`` reply carries it (``version``), a rank's ``register`` request carries it (``version``), and each
side refuses a peer of another version at start, naming both, rather than misbehave mid-run. The check is exact:
one release on every part of a job.
"""

from __future__ import annotations

from typing import Any, Protocol

from clockwork import __version__
from clockwork.contracts.errors import DaemonError, DaemonUnavailableError, VersionSkewError

__all__ = ["VERSION", "VersionSkewError", "check_daemon", "require_same_version", "skew_message"]

#: This installation's version (the package's, ``clockwork.__version__``).
VERSION = __version__


def skew_message(here: str, there: str, theirs: str, *, mine: str | None = None, fix: str = "") -> str:
    """``here`` runs ``mine`` (default: this installation's), ``there`` runs ``theirs`` ('' = a peer too old to
    say): one line naming both."""
    mine = VERSION if mine is None else mine
    told = theirs or "a version older than 0.1.0 (it does not say which)"
    advice = fix or "run one Clockwork/TorchPass release on every part of a job"
    return f"version mismatch: {here} runs Clockwork/TorchPass {mine}, {there} runs {told}; {advice}"


def require_same_version(here: str, there: str, theirs: str, *, fix: str = "") -> None:
    """Raise :class:`VersionSkewError` unless the peer (``there``) runs this installation's version."""
    if theirs != VERSION:
        raise VersionSkewError(skew_message(here, there, theirs, fix=fix))


class _Pings(Protocol):
    def ping(self) -> dict[str, Any]: ...


def check_daemon(client: _Pings, here: str, there: str) -> bool:
    """Ask the node daemon its version (``ping``) and refuse another than ours (:class:`VersionSkewError`), a daemon
    of another wire schema included. True when it answered with ours; False when it did not answer (not running
    yet, or hung: the caller warns and goes on without it, as before this check)."""
    try:
        reply = client.ping()
    except DaemonUnavailableError:
        return False
    except DaemonError as exc:
        if exc.code in ("bad_version", "bad_reply"):  # another wire schema: another release for sure
            raise VersionSkewError(skew_message(here, there, f"another wire schema ({exc})")) from None
        raise
    require_same_version(here, there, str(reply.get("version", "")), fix=DAEMON_FIX)
    return True


#: What to do about a daemon of another version.
DAEMON_FIX = (
    "install the node's Clockwork version in the job's image (or ask the admins which one the nodes run: "
    "`clockwork --version` on a node)"
)
