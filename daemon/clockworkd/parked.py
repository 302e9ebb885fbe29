"""Requests the daemon answers later: a long poll on the control socket (a TorchPass agent waiting for a verdict).

An op handler that has nothing to say yet returns a :class:`Park`: a function that builds the answer once there
is one, and how long the caller is willing to wait. The daemon's loop keeps the request's envelope here and,
after each turn, asks every parked request again; at its deadline it must answer (usually: nothing new). So an
agent hears of a verdict within one loop turn of it, without polling, and the loop never blocks on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from clockwork.contracts.daemon_wire import encode_ok

__all__ = ["MAX_PARKED", "Park", "ParkedRequests"]

#: Parked requests at most (all callers together); past it a request is answered at once, as at its deadline.
MAX_PARKED = 1024


@dataclass(frozen=True)
class Park:
    """An answer not ready yet: ``answer(final)`` returns the reply's fields once there are some (with ``final``
    true, at the deadline, it must return them), None to go on waiting; ``wait_s`` is the longest wait."""

    answer: Callable[[bool], dict[str, Any] | None]
    wait_s: float


@dataclass
class _Parked:
    sock: zmq.Socket[bytes]
    envelope: list[bytes]
    park: Park
    deadline: float


Send = Callable[[zmq.Socket[bytes], list[bytes]], None]


class ParkedRequests:
    """The daemon's parked requests."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []

    def __len__(self) -> int:
        return len(self._parked)

    def add(self, sock: zmq.Socket[bytes], envelope: list[bytes], park: Park, now: float, send: Send) -> None:
        if len(self._parked) >= MAX_PARKED:
            send(sock, [*envelope, encode_ok(**(park.answer(True) or {}))])
            return
        self._parked.append(_Parked(sock, envelope, park, now + park.wait_s))

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._parked), default=None)

    def answer_ready(self, now: float, send: Send) -> None:
        """Answer every parked request whose answer is ready or whose deadline passed."""
        if not self._parked:
            return
        waiting = []
        for parked in self._parked:
            final = now >= parked.deadline
            fields = parked.park.answer(final)
            if fields is None and final:
                fields = {}
            if fields is None:
                waiting.append(parked)
            else:
                send(parked.sock, [*parked.envelope, encode_ok(**fields)])
        self._parked = waiting

    def clear(self) -> None:
        self._parked.clear()
