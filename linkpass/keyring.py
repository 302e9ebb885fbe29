"""The MAC keys LinkPass signs and checks heartbeats with: one per peer, so a node can speak only for itself.

The host derives them (pairwise X25519 keys from each node's own CURVE key pair, with a rotation window: see
``clockwork.contracts.pairwise_keys``); linkpass imports nothing of Clockwork, so it takes any object with these
two methods. :class:`SharedKey` is one key for every peer (tests; a cluster-wide secret). The packets are
tagged with them by :func:`linkpass.heartbeat.seal` (:class:`linkpass.outbox.Outbox`: one body per rail, one
tag per peer) and checked by :func:`linkpass.heartbeat.decode` (:class:`linkpass.engine.LinkPass`); the daemon's
path does both in C (:mod:`linkpass.fastpath`) from a table of these keys by node index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KeyRing(Protocol):
    #: Changes whenever the keys do: the C fast path (:mod:`linkpass.fastpath`) rebuilds its key table then.
    version: int

    def maybe_reload(self) -> None:
        """Read the keys again if their files changed (cheap to call every interval)."""
        ...

    def send_key(self, peer: str) -> bytes:
        """The key of packets to ``peer``."""
        ...

    def accept_keys(self, peer: str) -> Sequence[bytes]:
        """Every key a packet from ``peer`` may carry now (two or more while a key changes)."""
        ...


class SharedKey:
    """One key for every peer."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.version = 0

    def maybe_reload(self) -> None:
        return None

    def send_key(self, peer: str) -> bytes:
        return self.key

    def accept_keys(self, peer: str) -> Sequence[bytes]:
        return (self.key,)
