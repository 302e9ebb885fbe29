"""What the node daemon hosts in its one-thread loop (LinkPass, Lens, the node watch, the GPU health watch), and
what the ops a hosted component answers see of the daemon.

Apart from the daemon (:mod:`clockworkd.server`) so that the hosts (``*_host.py``) and the components' op modules
(:mod:`clockworkd.nodewatch.ops`, :mod:`clockworkd.borrow.ops`) can name these without importing the daemon, which
imports them: no import cycle. The loop polls a component's fds, calls ``tick`` at its deadline and shows its
``status``; nothing of it may block the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from clockworkd.registry import JobRecord

__all__ = ["Component", "OpsContext"]


class Component(Protocol):
    """Something the daemon hosts in its loop (LinkPass, Lens, GPU health): fds to poll, a tick deadline."""

    def fds(self) -> list[int]: ...
    def on_readable(self, fd: int) -> None: ...
    def next_deadline(self) -> float: ...
    def tick(self) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class OpsContext:
    """What a hosted component's ops see of the daemon: its node, its components by name (looked up on each
    request, so one started after the ops were made is found, and one that is off says why), and ``job_of``, which
    finds a registered job (UnknownJobError, answered ``unknown_job``, for one that is not)."""

    node: str
    components: Mapping[str, Component | str]
    job_of: Callable[[int], JobRecord]
