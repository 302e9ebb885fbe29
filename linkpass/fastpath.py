"""The daemon's heartbeat path: one call per rail per interval to tag and send, one to read and verify (C).

Why: in Python each heartbeat cost ~9 us to send (a ``sendto`` and an HMAC per packet) and ~9 us to receive
(``recvfrom``, decoding, the tag check), 7 % of a core at 1,024 nodes x 8 rails against a 3 % goal for the whole
control plane. :mod:`linkpass._hbfast` (linkpass/csrc/_hbfast.c) does that per-packet work without the GIL:
``send`` tags one rail's body for each peer under its pairwise key and sends them all with ``sendmmsg``;
``receive`` drains a rail's socket with ``recvmmsg``, finds the sender from the source address, checks the
tag against that peer's accepted keys, the header against this fabric, and returns per accepted packet only
what the engine files (node, seq, masks, flags, and the rails on which the sender hears this node). The engine
keeps every decision; :mod:`linkpass.heartbeat` is the reference the C code matches byte for byte (tests).

The tables the C code reads are built here once, and again when the keys change (:attr:`KeyRing.version`,
checked once an interval): per rail, each node's address (4 bytes per node index) and the sorted (address,
node) pairs of the senders; and the key table (Fleet Lens's layout, ``daemon/clockworkd/lens/csrc/tag.h``):
per node index ``KEY_SLOTS`` keys of ``KEY_BYTES``, slot 0 the key packets to it carry, any non-zero slot one
its packets may carry (two or more during a rotation). One key shared by every peer (:class:`SharedKey`) is
passed as it is (1 to 64 bytes).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping, Sequence

from linkpass import _hbfast, heartbeat
from linkpass.keyring import KeyRing, SharedKey

__all__ = ["Accepted", "FastPath", "Rejected"]

KEY_SLOTS = _hbfast.KEY_SLOTS
KEY_BYTES = _hbfast.KEY_BYTES
#: recvmmsg batches of 64 one read takes at most (the rest waits for the next round).
MAX_BATCHES = 64

if _hbfast.VERSION != heartbeat.VERSION or _hbfast.TAG_BYTES != heartbeat.TAG_BYTES:
    raise ImportError("linkpass._hbfast was built for another heartbeat format: rebuild it (make venv)")


#: (mask of the rails it arrived on, node, seq, down mask, up mask, flags, mask of the rails on which the sender hears
#: this node): one per sender and content (one interval's packets of a path peer, one per rail, are one)
Accepted = tuple[int, int, int, int, int, int, int]
#: (rail index, source address, its node index or -1, :class:`linkpass.inbox.Reject` code, node named, rail named
#: (-1: not read))
Rejected = tuple[int, str, int, int, int, int]


class FastPath:
    """The C heartbeat path of node ``me`` with ``peers`` (name -> rail -> address) under ``keys``."""

    def __init__(
        self, index: heartbeat.FabricIndex, keys: KeyRing, me: str, peers: Mapping[str, Mapping[str, str]]
    ) -> None:
        self.index = index
        self.keys = keys
        self.me = index.node_number(me)
        self.number = number = {name: i for i, name in enumerate(index.nodes)}
        self.peer_names = sorted(peers)
        self.addrs: dict[str, bytes] = {}
        self.senders: dict[str, bytes] = {}
        for rail in index.rails:
            table = bytearray(4 * len(index.nodes))
            pairs = []
            for name, nics in peers.items():
                ip = nics.get(rail)
                if ip is not None:
                    packed = socket.inet_aton(ip)
                    table[4 * number[name] : 4 * number[name] + 4] = packed
                    pairs.append((struct.unpack("!I", packed)[0], number[name]))
            self.addrs[rail] = bytes(table)
            self.senders[rail] = b"".join(struct.pack("=II", a, n) for a, n in sorted(pairs))
        self._version = -1
        self.key = b""
        self.refresh()

    def refresh(self) -> bool:
        """Rebuild the key table if the keys changed (at most a stat a second); True when it did."""
        self.keys.maybe_reload()
        if self.keys.version == self._version and self.key:
            return False
        self._version = self.keys.version
        self.key = self._table()
        return True

    def _table(self) -> bytes:
        if isinstance(self.keys, SharedKey):
            if not 1 <= len(self.keys.key) <= 64:
                raise ValueError("a heartbeat key is 1 to 64 bytes")
            return self.keys.key
        rows = [bytes(KEY_SLOTS * KEY_BYTES)] * len(self.index.nodes)
        for name in self.peer_names:
            send = self.keys.send_key(name)
            slots = list(dict.fromkeys([send, *self.keys.accept_keys(name)]))[:KEY_SLOTS]
            if any(len(k) != KEY_BYTES for k in slots):
                raise ValueError(f"pairwise heartbeat keys are {KEY_BYTES} bytes")
            rows[self.number[name]] = b"".join(slots) + bytes(KEY_BYTES * (KEY_SLOTS - len(slots)))
        return b"".join(rows)

    def send(self, port: int, batches: Sequence[tuple[socket.socket, str, bytes, Sequence[int]]]) -> tuple[int, int]:
        """One interval's packets, in one call: each batch (socket, rail, body, node numbers) tagged for each node
        and sent to its address on that rail. Returns (sent, failed)."""
        return _hbfast.send(
            port, self.key, [(sock.fileno(), body, nodes, self.addrs[rail]) for sock, rail, body, nodes in batches]
        )

    def receive(self, sockets: Mapping[str, socket.socket]) -> tuple[list[Accepted], list[Rejected], int]:
        """Everything every rail's socket (rail -> socket) holds, checked: the accepted packets, the rejected, and the
        number of sockets whose read failed (a failed read ends that socket's read only)."""
        index = self.index
        return _hbfast.receive(
            [(sock.fileno(), self.senders[rail], index.rail_number(rail)) for rail, sock in sockets.items()],
            self.key,
            self.me,
            index.fingerprint,
            len(index.nodes),
            len(index.rails),
            MAX_BATCHES,
        )
