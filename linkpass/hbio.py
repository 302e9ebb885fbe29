"""LinkPass's heartbeat I/O on a thread of its own: read every rail's socket, send what is due, on time.

Why a thread: the daemon's loop also serves requests, writes event logs and hosts the GPU health watch, whose
NVML calls can hang for seconds. Were heartbeats sent and read there, one slow part would silence this node
(its peers would judge every path to it dead, and their node watches would suspect it) and blind it (the
heartbeats that arrived meanwhile would be read late, all at once). Here they are sent on time and stamped as
they arrive whatever the loop does; the loop only reads the evidence (under the engine's lock) and decides.

Once an interval the thread runs :meth:`Engine.receive` on the rails' sockets (which reads, checks and files what
they hold, in C: :mod:`linkpass.fastpath`), then :meth:`Engine.send_due`; both take the engine's lock briefly.
The thread survives an error in either (logged, counted) and reports when it last went round, so the daemon's
status tells a stuck thread from a slow one.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("clockwork.linkpass")

SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
#: What the kernel charges a receive buffer per datagram beyond its payload (sk_buff and slab overhead).
SKB_OVERHEAD = 768
RECV_BYTES = 65536  # a read of one datagram whole (tests, benchmarks)


class Engine(Protocol):
    """What the thread drives (:class:`linkpass.engine.LinkPass`)."""

    def receive(self, sockets: dict[str, socket.socket], now: float) -> None: ...
    def send_due(self, now: float) -> float: ...


def open_socket(addr: str, port: int, device: str, rcvbuf: int) -> tuple[socket.socket, int]:
    """A non-blocking UDP socket bound to ``addr:port`` on ``device`` whose receive buffer holds ``rcvbuf`` bytes
    of datagrams (SO_RCVBUFFORCE as root, past net.core.rmem_max; else what rmem_max allows). Returns it and the
    buffer the kernel granted (half of what getsockopt says: the kernel doubles the request for its overhead)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, device.encode())
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((addr, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2


def rcvbuf_for(datagrams: int, size: int) -> int:
    """Bytes of receive buffer for ``datagrams`` datagrams of ``size`` bytes, as the kernel accounts them."""
    return datagrams * (size + SKB_OVERHEAD)


class HeartbeatThread:
    """Reads ``sockets`` (rail -> socket) and calls ``engine.send_due`` when it says, until :meth:`stop`."""

    def __init__(
        self, engine: Engine, sockets: dict[str, socket.socket], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.sockets = dict(sockets)
        self.clock = clock
        self.errors = 0
        self.last_round = clock()
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="linkpass-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        try:
            self._stop_w.send(b"!")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._stop_r.close()
        self._stop_w.close()

    def _run(self) -> None:
        # One wake-up per interval: read everything every rail's socket holds, then send. Waking per arriving packet
        # costs a select() and a failed recvfrom per packet (most sockets hold one packet at a time), at the price
        # of at most one interval added to a silent path's verdict.
        next_send = self.clock()
        while True:
            ready, _w, _x = select.select([self._stop_r], [], [], max(0.0, next_send - self.clock()))
            if ready:
                return
            self._read()
            now = self.clock()
            self.last_round = now
            try:
                next_send = self.engine.send_due(now)
            except Exception:
                self.errors += 1
                log.exception("linkpass: sending heartbeats failed")
                next_send = now + 0.01

    def _read(self) -> None:
        try:
            self.engine.receive(self.sockets, self.clock())
        except Exception:
            self.errors += 1
            log.exception("linkpass: reading heartbeats failed")
