"""Fleet Lens's packet keys, in the form its C code takes them: one key for every node, or a table of pairwise
keys by node index, so a node can tag probes and summaries only as itself.

The table holds, per node of the fabric map (sorted, as the wire's node indices), ``KEY_SLOTS`` keys of
``KEY_BYTES``: slot 0 is the key packets to that node carry; a packet from it may carry any of them (two or
more while a key changes: ``clockwork.contracts.pairwise_keys``). Unused slots, and this node's own row, are
zero. The pacer thread holds a copy; :meth:`LensKeys.refresh` says when the key files changed, and the prober
hands the pacer the new table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from clockworkd.lens import fastio

KEY_SLOTS = fastio.KEY_SLOTS  # = _probeio.KEY_SLOTS (fastio checks the build)
KEY_BYTES = 32  # = _probeio.KEY_BYTES


class PeerKeys(Protocol):
    """What the host gives: per-peer keys, with a version that changes when they are reloaded."""

    version: int

    def send_key(self, peer: str) -> bytes: ...

    def accept_keys(self, peer: str) -> Sequence[bytes]: ...

    def maybe_reload(self) -> None: ...


class LensKeys:
    """One key (bytes: every node shares it) or per-peer keys (:class:`PeerKeys`)."""

    def __init__(self, nodes: list[str], me: str, keys: bytes | PeerKeys) -> None:
        self.nodes = nodes
        self.me = me
        self.keys = keys
        self._version = -1
        self._arg = keys if isinstance(keys, bytes) else b""
        if not isinstance(keys, bytes):
            self.refresh()

    def refresh(self) -> bool:
        """Re-read changed key files (at most once a second); True when the table changed."""
        if isinstance(self.keys, bytes):
            return False
        self.keys.maybe_reload()
        if self.keys.version == self._version:
            return False
        self._version = self.keys.version
        rows = []
        for node in self.nodes:
            slots = [] if node == self.me else list(dict.fromkeys(self.keys.accept_keys(node)))[:KEY_SLOTS]
            if slots and slots[0] != self.keys.send_key(node):
                slots = [self.keys.send_key(node), *slots][:KEY_SLOTS]
            if any(len(k) != KEY_BYTES for k in slots):
                raise ValueError(f"Lens keys are {KEY_BYTES} bytes")
            rows.append(b"".join(slots) + bytes(KEY_BYTES * (KEY_SLOTS - len(slots))))
        self._arg = b"".join(rows)
        return True

    def arg(self) -> bytes:
        """What ``_probeio`` takes as its ``key``."""
        return self._arg

    def send_key(self, node: str) -> bytes:
        """The key of a packet to ``node`` (summaries, tagged in Python)."""
        return self.keys if isinstance(self.keys, bytes) else self.keys.send_key(node)
