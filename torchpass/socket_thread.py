"""The life cycle the coordinator, the agents' mesh and the rank proxy share: one ZeroMQ context served by one
background thread, which a pipe wakes when another thread hands it work or asks it to stop; and reading a
ROUTER socket's messages without letting a stranger's garbage stop the thread."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from clockwork.contracts.coordinator_wire import ProtocolError, decode

__all__ = ["SocketThread", "router_messages"]


class SocketThread:
    """Base class: ``_ctx`` and the serving thread are the subclass's to create in ``start``."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        """Make the serving thread's poll return (from any thread)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        """On the serving thread, after its poll saw the pipe readable."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def stop(self) -> None:
        """Stop the thread, then close the context's sockets and the pipe."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def router_messages(sock: zmq.Socket[bytes], log: logging.Logger) -> Iterator[tuple[bytes, bytes, dict[str, Any]]]:
    """(sender identity, raw payload, message) for every message a ROUTER socket holds now; malformed ones are
    logged and dropped, never raised (a stranger's garbage must not stop a coordinator or a proxy)."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) < 2:
            continue
        ident, payload = frames[0], frames[-1]
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            log.warning("dropping a malformed message from %r: %s", ident, exc)
            continue
        yield ident, payload, msg
