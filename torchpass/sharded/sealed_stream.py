"""Authenticated, encrypted records over one TCP connection between two processes of a job (AES-256-GCM).

Why: the peer-copy stream (:mod:`torchpass.sharded.peer_wire`) carries a rank's parameters and optimizer state between
hosts on plain TCP, beside the job's other sockets, which are CURVE. Here every record is sealed with an AEAD
(``cryptography``'s AES-GCM: OpenSSL, ~10 GB/s a core with AES-NI, and ``encrypt_into``/``decrypt_into`` so a
tensor's bytes are sealed from and opened into its own memory, without a copy in Python), so a record changed,
replayed, dropped or reordered in flight is refused, and nobody without the job's key reads or writes one.

The handshake, per connection: the accepting side sends a 32-byte nonce; the connecting side answers with an
HMAC-SHA256 of it under the job's secret (so a stranger is refused after 32 bytes, before anything is allocated
for it) and its own nonce; both derive the connection's key from the job's secret and the two nonces
(HKDF-SHA256), so a record of one connection means nothing on another, in either direction.

A record on the wire: its plaintext length (4 bytes, big-endian) and the sealed bytes (plaintext + 16-byte tag),
the length bound in as associated data. The nonce is never sent: it is the direction (connecting or accepting
side) and a counter of that direction's records, which each end keeps, so the only record that opens is the next
one, sent once, in this direction.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from clockwork.contracts.errors import WireError

__all__ = ["NONCE_BYTES", "RecordRefused", "SealedStream", "StreamClosed", "recv_exact", "recv_into"]

NONCE_BYTES = 32
TAG_BYTES = 16
LENGTH = struct.Struct("!I")
_NONCE = struct.Struct("!IQ")  # direction, record counter: 12 bytes, AES-GCM's nonce
_CONNECTOR, _ACCEPTOR = 1, 2  # the directions (a record sealed by that side)
PROOF_BYTES = 32


class StreamClosed(WireError):
    """The other end closed the connection (or broke it off in the middle of a record)."""


class RecordRefused(WireError):
    """A record that does not open: changed in flight, replayed, reordered, or sealed without the job's key."""


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; StreamClosed when the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise StreamClosed("the peer closed the connection")
        got += n


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    recv_into(sock, memoryview(data))
    return bytes(data)


def _proof(secret: bytes, label: bytes, nonce: bytes) -> bytes:
    """The connecting side's answer to the accepting side's nonce: HMAC-SHA256 of it under the job's secret."""
    return hmac.new(secret, b"proof\0" + label + nonce, hashlib.sha256).digest()


def _key(secret: bytes, accept_nonce: bytes, connect_nonce: bytes, label: bytes) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=accept_nonce + connect_nonce, info=label)
    return AESGCM(hkdf.derive(secret))


class SealedStream:
    """One end of a connection whose every record is sealed (see the module doc). Not thread-safe: one thread
    sends and receives on it. ``max_record``: the longest plaintext either side sends; a longer one announced is
    refused before it is read."""

    def __init__(self, sock: socket.socket, aead: AESGCM, sends: int, max_record: int, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.max_record = max_record
        self._aead = aead
        self._send_dir, self._recv_dir = sends, _ACCEPTOR if sends == _CONNECTOR else _CONNECTOR
        self._sent = self._received = 0
        self._out = bytearray()  # grown to the largest record sent / received (a payload chunk, usually)
        self._in = bytearray()

    # ----- the handshake ---------------------------------------------------------------------------------------

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, label: bytes, max_record: int) -> SealedStream:
        """The accepting side's handshake; RecordRefused when the peer does not prove it holds ``secret``."""
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(nonce)
        peer = _name(sock)
        if not hmac.compare_digest(recv_exact(sock, PROOF_BYTES), _proof(secret, label, nonce)):
            raise RecordRefused(f"{peer} did not prove it holds the job's key")
        theirs = recv_exact(sock, NONCE_BYTES)
        return cls(sock, _key(secret, nonce, theirs, label), _ACCEPTOR, max_record, peer)

    @classmethod
    def connect(cls, sock: socket.socket, secret: bytes, label: bytes, max_record: int) -> SealedStream:
        """The connecting side's handshake."""
        theirs = recv_exact(sock, NONCE_BYTES)
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(_proof(secret, label, theirs) + nonce)
        return cls(sock, _key(secret, theirs, nonce, label), _CONNECTOR, max_record, _name(sock))

    # ----- records ---------------------------------------------------------------------------------------------

    def send(self, plaintext: bytes | memoryview) -> None:
        """Seal and send one record (at most ``max_record`` bytes)."""
        data = memoryview(plaintext).cast("B")
        if len(data) > self.max_record:
            raise ValueError(f"a record of {len(data)} bytes is over this stream's {self.max_record}")
        end = LENGTH.size + len(data) + TAG_BYTES
        if len(self._out) < end:
            self._out = bytearray(end)
        out = memoryview(self._out)
        LENGTH.pack_into(out, 0, len(data))
        nonce = _NONCE.pack(self._send_dir, self._sent)
        self._aead.encrypt_into(nonce, data, out[: LENGTH.size], out[LENGTH.size : end])
        self._sent += 1
        self.sock.sendall(out[:end])

    def recv_into(self, dest: memoryview) -> None:
        """Receive the next record into ``dest``, which it must fill exactly. RecordRefused when it does not open
        (or announces another length); nothing of a refused record may be trusted (``dest`` may hold garbage)."""
        prefix, length = self._announced()
        if length != len(dest):
            raise RecordRefused(
                f"record {self._received} from {self.peer} announces {length} bytes where {len(dest)} were due "
                "(changed in flight?)"
            )
        self._open(prefix, length, dest)

    def recv(self) -> bytes:
        """The next record, whatever its length (up to ``max_record``)."""
        prefix, length = self._announced()
        out = bytearray(length)
        self._open(prefix, length, memoryview(out))
        return bytes(out)

    def _announced(self) -> tuple[bytes, int]:
        prefix = recv_exact(self.sock, LENGTH.size)
        (length,) = LENGTH.unpack(prefix)
        if length > self.max_record:
            raise RecordRefused(
                f"record {self._received} from {self.peer} announces {length} bytes, over the {self.max_record} "
                "this stream allows (changed in flight?)"
            )
        return prefix, length

    def _open(self, prefix: bytes, length: int, dest: memoryview) -> None:
        if len(self._in) < length + TAG_BYTES:
            self._in = bytearray(length + TAG_BYTES)
        sealed = memoryview(self._in)[: length + TAG_BYTES]
        recv_into(self.sock, sealed)
        try:
            self._aead.decrypt_into(_NONCE.pack(self._recv_dir, self._received), sealed, prefix, dest)
        except InvalidTag:
            raise RecordRefused(
                f"record {self._received} from {self.peer} failed authentication: changed in flight, replayed, "
                "reordered or not sealed with the job's key"
            ) from None
        self._received += 1


def _name(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "a closed connection"
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name) or "a local socket"
