"""The stream that puts a copy of each rank's shard into its ring neighbours' host memory, and what they keep.

Why plain TCP sockets and not the job's process group: the copies flow on a side thread while the training
loop's collectives run on the generation's group; a second user of that group from another thread would
interleave with FSDP's collectives, and a dead neighbour must cost a failed copy, never a broken step. A
socket per neighbour fails alone.

The wire, per connection (the sender connects to the receiver's :class:`CopyListener`), follows the job sockets'
discipline: every byte after the handshake is sealed (:mod:`torchpass.sharded.sealed_stream`: AES-256-GCM under a key
derived from the job's key and both ends' nonces, a counter per direction), so only processes of the job (which
hold ``TORCHPASS_JOB_KEY``) may place or read a copy, and a frame changed, replayed or reordered in flight is
refused: the receiver drops what it was writing (its last complete copy stays) and closes the connection, and
the sender's copy fails like one to a dead neighbour. Structured data is msgpack, never pickle.

1. the handshake: the receiver's nonce, the sender's proof that it holds the job's key (an HMAC of that nonce) and its
   own nonce;
2. frames: a head record (msgpack: source shard, step, payload length, and the state's description as opaque
   bytes, which :mod:`torchpass.rank.state_codec` encodes as msgpack), the payload (laid out as
   :func:`torchpass.rank.state.send_state` lays it out) in records of :data:`CHUNK` bytes, each opened straight into
   the buffer that keeps it, then the receiver's sealed ack (the step it stored, -1 when it did not keep the
   frame, -2 when it refused it).

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

import logging
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from clockwork.contracts.errors import WireError
from torchpass.sharded.sealed_stream import RecordRefused, SealedStream, StreamClosed

__all__ = ["CopyBuffer", "CopyLink", "CopyListener", "ReceivedCopies", "WireError"]

log = logging.getLogger("clockwork.torchpass.peer_wire")

LABEL = b"torchpass-peer-copy v2"  # the key derivation's label: a key of this stream means nothing elsewhere
CHUNK = 1 << 20  # payload bytes per sealed record
MAX_META = 1 << 28  # the longest state description a head record may carry
ACK = struct.Struct("!q")
KEPT_NOT, REFUSED = -1, -2  # acks other than the step: dropped (frozen), refused (failed authentication)


class FrameRefused(WireError):
    """A frame (or the handshake) that does not open with the job's key: changed in flight, replayed, reordered, or
    sent by a stranger. The receiver keeps nothing of it and closes the connection."""


@dataclass(frozen=True)
class FrameHead:
    """What a frame is, sent sealed ahead of its payload: the source shard, the step, the payload's length, and
    the state's description (msgpack bytes of :mod:`torchpass.rank.state_codec`, opaque here)."""

    shard: int
    step: int
    payload: int
    meta: bytes

    def encode(self) -> bytes:
        return msgpack.packb(
            {"shard": self.shard, "step": self.step, "payload": self.payload, "meta": self.meta}, use_bin_type=True
        )

    @classmethod
    def decode(cls, data: bytes) -> FrameHead:
        """The head of a sealed record (already authenticated; still checked, a sender may be wrong)."""
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises many types
            raise WireError(f"a peer-copy head is not msgpack: {type(exc).__name__}") from None
        if not isinstance(obj, dict) or set(obj) != {"shard", "step", "payload", "meta"}:
            raise WireError("a peer-copy head without exactly shard, step, payload, meta")
        shard, step, payload, meta = obj["shard"], obj["step"], obj["payload"], obj["meta"]
        if not all(type(v) is int for v in (shard, step, payload)) or shard < 0 or payload < 0:
            raise WireError("a peer-copy head's shard, step and payload must be integers (shard, payload >= 0)")
        if not isinstance(meta, bytes):
            raise WireError("a peer-copy head's meta must be bytes")
        return cls(shard, step, payload, meta)


@dataclass
class CopyBuffer:
    """One shard's state at ``step`` in host memory: its description (``blob``, msgpack of
    :mod:`torchpass.rank.state_codec`) and its payload. ``complete`` only once every byte is in: an incomplete buffer is
    never reported or served."""

    step: int = -1
    complete: bool = False
    blob: bytes = b""
    payload: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    meta: dict[str, Any] | None = None  # the description as captured (own copies; received ones decode ``blob``)
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
        self.refused = 0  # connections refused: a handshake without the job's key, or a frame that did not open
        self.last_refusal = ""  # why the last one was refused
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
                stream = SealedStream.accept(conn, self.secret, LABEL, max(CHUNK, MAX_META))
            except RecordRefused as exc:
                self._refuse(f"a peer-copy connection without the job's key was refused: {exc}")
                return
            except (OSError, ValueError):
                return
            try:
                conn.settimeout(None)  # frames come every K steps; a dead sender closes the socket
                while True:
                    self._frame(stream)
            except RecordRefused as exc:
                self._refuse(f"a peer-copy frame was refused and its connection closed: {exc}")
                try:
                    stream.send(ACK.pack(REFUSED))  # sealed: the sender learns why, and nobody can forge it
                except OSError:
                    pass
            except (OSError, WireError, ValueError):
                return  # the sender is gone (or broke the protocol): what it was sending is not kept

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refusal = why
        log.warning("%s", why)

    def _frame(self, stream: SealedStream) -> None:
        head = FrameHead.decode(stream.recv())
        stream.sock.settimeout(self.timeout_s)  # inside a frame, bytes keep coming
        buffer = self.copies.begin(head.shard)
        if buffer is None:
            self._drain(stream, head.payload)
            self.dropped += 1
            stream.send(ACK.pack(KEPT_NOT))
        else:
            view = buffer.ensure(head.payload).numpy().data  # the buffer stays incomplete until the end
            for start in range(0, head.payload, CHUNK):
                stream.recv_into(view[start : start + CHUNK])
            self.copies.finish(buffer, head.step, head.meta)
            self.received += 1
            stream.send(ACK.pack(head.step))
        stream.sock.settimeout(None)

    @staticmethod
    def _drain(stream: SealedStream, total: int) -> None:
        """Read (and authenticate) a frame's payload that is not kept."""
        scratch = memoryview(bytearray(min(total, CHUNK)))
        for start in range(0, total, CHUNK):
            stream.recv_into(scratch[: min(CHUNK, total - start)])

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
            self._stream = SealedStream.connect(self._sock, secret, LABEL, max(CHUNK, MAX_META))
        except BaseException:
            self._sock.close()
            raise

    def send(self, shard: int, step: int, blob: bytes, payload: torch.Tensor) -> None:
        """One copy of ``shard``'s state at ``step`` (``blob``: its description); WireError when the neighbour
        did not keep it (FrameRefused when it refused the frame as not opening)."""
        where = f"{self.address[0]}:{self.address[1]}"
        if len(blob) > MAX_META:
            raise WireError(f"a state description of {len(blob)} bytes is over the peer-copy wire's {MAX_META}")
        view = payload.numpy().data
        try:
            self._stream.send(FrameHead(shard, step, len(view), blob).encode())
            for start in range(0, len(view), CHUNK):
                self._stream.send(view[start : start + CHUNK])
            ack = bytearray(ACK.size)
            self._stream.recv_into(memoryview(ack))
        except RecordRefused as exc:
            raise FrameRefused(f"peer copy to {where}: its acknowledgement did not open: {exc}") from None
        except (OSError, StreamClosed) as exc:
            raise WireError(f"peer copy to {where} failed: {exc}") from None
        (kept,) = ACK.unpack(ack)
        if kept == REFUSED:
            raise FrameRefused(f"{where} refused the copy of step {step}: a frame did not open (changed in flight?)")
        if kept != step:
            raise WireError(f"{where} did not keep the copy of step {step}")

    def close(self) -> None:
        """Close the connection (the neighbour's listener ends its thread)."""
        self._sock.close()
