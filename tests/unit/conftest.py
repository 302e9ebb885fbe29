"""Fixtures shared by the unit tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def tx_socket() -> Iterator[socket.socket]:
    """A non-blocking UDP socket on 127.0.0.1 to send test datagrams from."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()
