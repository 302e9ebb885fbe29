"""The stream that puts a copy of each rank's shard into its ring neighbours' host memory, and what they keep.

Why plain TCP sockets and not the job's process group: the copies flow on a side thread while the training
loop's collectives run on the generation's group; a second user of that group from another thread would
interleave with FSDP's collectives, and a dead neighbour must cost a failed copy, never a broken step. A
socket per neighbour fails alone.

The wire, per connection (the sender connects to the receiver's :class:`CopyListener`):

1. the receiver sends a 32-byte nonce; the sender answers HMAC-SHA256(job key, tag + nonce): only processes of
   the job (which hold ``TORCHPASS_JOB_KEY``) may place a copy, whose metadata is unpickled later;
2. frames: a header (magic, source shard, step, metadata length, payload length), the pickled metadata, the
   payload (laid out as :func:`torchpass.state.send_state` lays it out), then the receiver's ack (the step it
   stored, or -1 when it did not keep the frame).

What the receiver keeps (:class:`ReceivedCopies`): per source shard two buffers, double-buffered: a frame
is written into the older one, so the last complete copy is never the one being overwritten, and both are
served once complete. While a generation forms the copies are *frozen* (what a member reported holding must
not change under the transfers): a frame arriving then is read and dropped, and its sender told so.

Frames name the sender's *shard* (the part it holds), not its slot: under pure FSDP the two are the same, and
under HSDP a rank receives from ring predecessors of its own replica only, so the shard names the sender too,
and it is what the agreement reports copies by.

This module imports torch only for the buffers' memory (host tensors, so a GPU copy can be pinned).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CopyBuffer", "CopyLink", "CopyListener", "ReceivedCopies", "WireError"]

log = logging.getLogger("clockwork.torchpass.peer_wire")

MAGIC = b"TPC1"
TAG = b"torchpass-peer-copy"
HEADER = struct.Struct("!4sqqQQ")  # magic, source shard, step, metadata bytes, payload bytes
ACK = struct.Struct("!q")
MAX_META = 1 << 30
DRAIN_CHUNK = 1 << 20


class WireError(ConnectionError):
    """A copy could not be sent or was not kept (the peer is gone, refused us, or dropped the frame)."""


@dataclass
class CopyBuffer:
    """One shard's state at ``step`` in host memory: its pickled metadata and its payload. ``complete`` only
    once every byte is in: an incomplete buffer is never reported or served."""

    step: int = -1
    complete: bool = False
    blob: bytes = b""
    payload: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    meta: dict[str, Any] | None = None  # the unpickled metadata (own copies: kept from the capture)
    size: int = 0  # payload bytes of this copy (the memory may be larger: it is reused)

    def ensure(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """The first ``nbytes`` of this buffer's memory, grown when too small (pinned for GPU copies)."""
        if self.payload.numel() < nbytes:
            self.payload = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.size = nbytes
        return self.payload[:nbytes]

    @property
    def data(self) -> torch.Tensor:
        """The copy's payload."""
        return self.payload[: self.size]


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, TAG + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WireError("the peer closed the connection")
        got += n


class ReceivedCopies:
    """The copies of neighbours' shards this rank keeps: two buffers per source shard (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, list[CopyBuffer]] = {}
        self._frozen = False

    def freeze(self) -> None:
        """From now until :meth:`thaw`, nothing kept changes: incoming frames are dropped."""
        with self._lock:
            self._frozen = True

    def thaw(self) -> None:
        """Keep incoming frames again."""
        with self._lock:
            self._frozen = False

    def begin(self, shard: int) -> CopyBuffer | None:
        """The buffer a frame of ``shard`` goes into (the older one, marked incomplete), or None when frozen."""
        with self._lock:
            if self._frozen:
                return None
            pair = self._buffers.setdefault(shard, [CopyBuffer(), CopyBuffer()])
            target = min(pair, key=lambda b: (b.complete, b.step))
            target.complete, target.step, target.meta = False, -1, None
            return target

    def finish(self, buffer: CopyBuffer, step: int, blob: bytes) -> None:
        """``buffer`` now holds its shard's state at ``step``, every byte."""
        with self._lock:
            buffer.step, buffer.blob, buffer.complete = step, blob, True

    def drop_after(self, step: int) -> None:
        """Forget complete copies of steps after ``step`` (a rollback made them a future computed again)."""
        with self._lock:
            for pair in self._buffers.values():
                for buffer in pair:
                    if buffer.complete and buffer.step > step:
                        buffer.complete, buffer.step = False, -1

    def steps(self, shard: int) -> list[int]:
        """The steps of ``shard``'s complete copies, newest first."""
        with self._lock:
            return sorted((b.step for b in self._buffers.get(shard, ()) if b.complete), reverse=True)

    def get(self, shard: int, step: int) -> CopyBuffer | None:
        """``shard``'s complete copy of ``step``, if kept."""
        with self._lock:
            return next((b for b in self._buffers.get(shard, ()) if b.complete and b.step == step), None)

    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        with self._lock:
            return sum(int(b.payload.numel()) for pair in self._buffers.values() for b in pair)


class CopyListener:
    """Accepts neighbours' connections and stores their frames in ``copies`` (a thread per connection)."""

    def __init__(self, host: str, copies: ReceivedCopies, secret: bytes, timeout_s: float) -> None:
        self.copies = copies
        self.secret = secret
        self.timeout_s = timeout_s
        self.received = 0  # frames kept
        self.dropped = 0  # frames read and dropped (frozen)
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, int(self._sock.getsockname()[1]))
        self._closed = False
        threading.Thread(target=self._accept, name="torchpass-peer-listen", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="torchpass-peer-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                nonce = os.urandom(32)
                conn.sendall(nonce)
                if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self.secret, nonce)):
                    log.warning("a peer-copy connection without the job's key was refused")
                    return
                conn.settimeout(None)  # frames come every K steps; a dead sender closes the socket
                while True:
                    self._frame(conn)
            except (OSError, WireError, ValueError):
                return  # the sender is gone (or broke the protocol): what it was sending is not kept

    def _frame(self, conn: socket.socket) -> None:
        magic, shard, step, meta_len, total = HEADER.unpack(_recv_exact(conn, HEADER.size))
        if magic != MAGIC or meta_len > MAX_META:
            raise ValueError("not a peer-copy frame")
        conn.settimeout(self.timeout_s)  # inside a frame, bytes keep coming
        blob = _recv_exact(conn, meta_len)
        buffer = self.copies.begin(shard)
        if buffer is None:
            self._drain(conn, total)
            self.dropped += 1
            conn.sendall(ACK.pack(-1))
        else:
            _recv_into(conn, buffer.ensure(total).numpy().data)
            self.copies.finish(buffer, step, blob)
            self.received += 1
            conn.sendall(ACK.pack(step))
        conn.settimeout(None)

    @staticmethod
    def _drain(conn: socket.socket, total: int) -> None:
        scratch = memoryview(bytearray(min(total, DRAIN_CHUNK) or 1))
        left = total
        while left:
            _recv_into(conn, scratch[: min(left, len(scratch))])
            left -= min(left, len(scratch))

    def close(self) -> None:
        """Stop accepting (connections being served end with their sender)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class CopyLink:
    """One rank's connection to one neighbour's listener: sends whole frames and waits for their ack."""

    def __init__(self, address: tuple[str, int], secret: bytes, timeout_s: float) -> None:
        self.address = address
        self._sock = socket.create_connection(address, timeout=timeout_s)
        try:
            self._sock.sendall(_mac(secret, _recv_exact(self._sock, 32)))
        except BaseException:
            self._sock.close()
            raise

    def send(self, shard: int, step: int, blob: bytes, payload: torch.Tensor) -> None:
        """One copy of ``shard``'s state at ``step``; WireError when the neighbour did not keep it."""
        view = payload.numpy().data
        try:
            self._sock.sendall(HEADER.pack(MAGIC, shard, step, len(blob), len(view)))
            self._sock.sendall(blob)
            self._sock.sendall(view)
            (kept,) = ACK.unpack(_recv_exact(self._sock, ACK.size))
        except OSError as exc:
            raise WireError(f"peer copy to {self.address[0]}:{self.address[1]} failed: {exc}") from None
        if kept != step:
            raise WireError(f"{self.address[0]}:{self.address[1]} did not keep the copy of step {step}")

    def close(self) -> None:
        """Close the connection (the neighbour's listener ends its thread)."""
        self._sock.close()
