"""Fresh weights from a trainer to RL rollout workers: versioned, complete, and never a stall for the trainer.

The trainer (usually slot 0: every data-parallel replica holds the same parameters) owns a
:class:`Publisher`; each rollout worker (a separate process or job) owns a :class:`Subscriber`::

    pub = torchpass.rollout.Publisher("tcp://0.0.0.0:5555")     # trainer
    pub.attach(ctx, model, every_steps=50)                       # or pub.publish(model) when you like

    sub = torchpass.rollout.Subscriber("tcp://trainer:5555")     # rollout worker (same job key)
    if sub.poll(timeout_s=0.0):                                  # a newer version arrived, complete
        sub.load_into(policy)                                    # or use sub.tensors() directly

How it stays complete and cheap:

* **Double buffering, atomic switch.** ``publish`` copies the parameters into the publisher's *back* buffer
  (a memory copy, or non-blocking GPU->host copies into page-locked memory) and returns. The publisher's
  thread makes it the *front* (the version served) once the copies are done: one pointer swap. A subscriber
  fills its own back buffer and swaps only when every chunk of one version arrived with a matching CRC, so
  what a worker sees is always one whole version, never a mix.
* **Chunked streaming, pulled.** A subscriber asks for the newest version's layout, then for its chunks
  (``chunk_mb`` each, a few requests in flight). The publisher answers from its front buffer; a chunk of a
  version it no longer holds is answered "gone", and the subscriber starts over with the newest. A slow
  subscriber therefore skips versions instead of holding the trainer back: nothing ever waits for it.
* **The trainer never waits.** When the previous publish is still being copied, the new one is skipped.
  Serving runs on a background thread whose work per chunk is one copy into ZeroMQ.

Every socket is CURVE-authenticated with the job key (:mod:`torchpass.auth`, ``TORCHPASS_JOB_KEY``): a
worker without it completes no handshake and receives nothing. Tensors are moved as raw bytes with their
dtype and shape, bitwise.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import zmq
from torch import nn

from clockwork.contracts.coordinator_wire import ProtocolError, decode, encode
from torchpass.auth import connect_as_client, serve
from torchpass.socket_thread import SocketThread, router_messages

__all__ = ["Publisher", "Subscriber"]

log = logging.getLogger("clockwork.torchpass.rollout")
ALIGN = 64
_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass
class _Version:
    """One complete model in a host buffer: its number, layout (name, dtype, shape, offset, nbytes) and CRC."""

    number: int
    buffer: torch.Tensor  # uint8, host
    layout: list[tuple[str, str, list[int], int, int]]
    total: int
    crc: int = 0
    events: list[Any] | None = None


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, str, list[int], int, int]], int]:
    out, offset = [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        out.append((name, str(tensor.dtype), [int(v) for v in tensor.shape], offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return out, offset


def _state(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    items = model.state_dict() if isinstance(model, nn.Module) else model
    return {name: t.detach() for name, t in items.items() if isinstance(t, torch.Tensor)}


class Publisher(SocketThread):
    """Serves the newest published version of a model to subscribers (see the module docstring)."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, chunk_mb: float = 4.0) -> None:
        super().__init__()
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self.version = 0  # the newest version the subscribers can get (0: none yet)
        self.published = 0
        self.skipped = 0
        self._front: _Version | None = None
        self._back: _Version | None = None
        self._staged: _Version | None = None  # filled, waiting for its GPU copies before the swap
        self._lock = threading.Lock()
        self._waiting: list[tuple[bytes, int, int]] = []  # (ident, request id, have): long polls
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.setsockopt(zmq.SNDHWM, 64)
        serve(sock)
        if bind.endswith(":0"):
            port = sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.endpoint = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(bind)
            self.endpoint = bind
        self._sock = sock
        self._start_thread(self._serve, "torchpass-rollout")

    # ----- the trainer's side ------------------------------------------------------------------

    def publish(self, model: nn.Module | Mapping[str, torch.Tensor]) -> int | None:
        """Stage ``model``'s current tensors as the next version; returns its number, or None when the
        previous one is still being copied (skipped: the trainer does not wait)."""
        tensors = _state(model)
        layout, total = _layout(tensors)
        with self._lock:
            if self._staged is not None:
                self.skipped += 1
                return None
            back = self._back
            if back is None or back.buffer.numel() < total:
                pin = any(t.is_cuda for t in tensors.values())
                back = _Version(0, torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin), [], 0)
            self._back = None
        number = self.published + 1
        events: list[Any] = []
        with torch.no_grad():
            cuda = [t for t in tensors.values() if t.is_cuda]
            stream = torch.cuda.Stream() if cuda else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            for (_, _, _, offset, nbytes), tensor in zip(layout, tensors.values(), strict=True):
                flat = tensor.contiguous().reshape(-1).view(torch.uint8)
                target = back.buffer[offset : offset + nbytes]
                if tensor.is_cuda and stream is not None:
                    with torch.cuda.stream(stream):
                        target.copy_(flat, non_blocking=True)
                else:
                    target.copy_(flat)
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                events.append(done)
        back.number, back.layout, back.total, back.events = number, layout, total, events
        with self._lock:
            self._staged = back
        self.published = number
        self._wake()
        return number

    def attach(self, ctx: Any, model: nn.Module, every_steps: int) -> None:
        """Publish ``model`` after every ``every_steps``-th committed step of a TorchPass job (slot 0 only)."""
        if every_steps < 1:
            raise ValueError("every_steps must be >= 1")

        def on_commit(step: int) -> None:
            if ctx.slot == 0 and (step + 1) % every_steps == 0:
                self.publish(model)

        ctx.on_commit(on_commit)

    # ----- the serving thread ------------------------------------------------------------------

    def _promote(self) -> None:
        """Make a staged version the front once its copies are done (the atomic switch)."""
        with self._lock:
            staged = self._staged
        if staged is None or not all(e.query() for e in staged.events or ()):
            return
        staged.crc = zlib.crc32(cast(Any, staged.buffer.numpy()[: staged.total])) if staged.total else 0
        with self._lock:
            self._back, self._front, self._staged = self._front, staged, None
            self.version = staged.number
        waiting, self._waiting = self._waiting, []
        for ident, req_id, _ in waiting:
            self._answer_latest(ident, req_id)

    def _answer_latest(self, ident: bytes, req_id: int) -> None:
        front = self._front
        assert front is not None
        self._sock.send_multipart(
            [
                ident,
                encode(
                    "version",
                    id=req_id,
                    version=front.number,
                    layout=[list(e) for e in front.layout],
                    total=front.total,
                    crc=front.crc,
                    chunk=self.chunk_bytes,
                ),
            ]
        )

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stopping.is_set():
            busy = self._staged is not None
            ready = dict(poller.poll(2 if busy else 200))
            if self._stopping.is_set():
                return
            if ready.get(self._wake_r):
                self._drain_wake()
            self._promote()
            if ready.get(self._sock):
                try:
                    for ident, _, msg in router_messages(self._sock, log):
                        self._handle(ident, msg)
                except zmq.ZMQError as exc:
                    log.warning("rollout publisher: %s", exc)

    def _handle(self, ident: bytes, msg: dict[str, Any]) -> None:
        op, req_id = msg.get("op"), int(msg.get("id", 0))
        front = self._front
        if op == "latest":
            have = int(msg.get("have", 0))
            if front is not None and front.number > have:
                self._answer_latest(ident, req_id)
            else:
                self._waiting = [w for w in self._waiting if w[0] != ident] + [(ident, req_id, have)]
        elif op == "chunk":
            version, index = int(msg.get("version", -1)), int(msg.get("index", -1))
            if front is None or front.number != version:
                latest = front.number if front is not None else 0
                self._sock.send_multipart([ident, encode("gone", id=req_id, version=version, latest=latest)])
                return
            lo = index * self.chunk_bytes
            hi = min(front.total, lo + self.chunk_bytes)
            if not 0 <= lo < max(hi, 1):
                self._sock.send_multipart([ident, encode("error", id=req_id, error=f"no chunk {index}")])
                return
            data = front.buffer.numpy()[lo:hi].tobytes()  # a copy: the buffer may be refilled after a swap
            header = encode("chunk", id=req_id, version=version, index=index, crc=zlib.crc32(data))
            self._sock.send_multipart([ident, header, data])

    def close(self) -> None:
        """Stop serving."""
        self.stop()


class Subscriber:
    """A rollout worker's view of the trainer's newest complete version (see the module docstring)."""

    def __init__(self, endpoint: str, *, window: int = 4, request_timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.window = max(1, window)
        self.request_timeout_s = request_timeout_s
        self.version = 0  # the version held now (0: none yet)
        self.skipped_versions = 0  # versions abandoned because a newer one replaced them mid-download
        self._front: _Version | None = None
        self._back: torch.Tensor | None = None
        self._ids = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        connect_as_client(self._sock)
        self._sock.connect(endpoint)
        self._asked_latest: int | None = None

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)
        self._ctx.term()

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _recv(self, deadline: float) -> tuple[dict[str, Any], list[bytes]] | None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart()
        try:
            return decode(frames[0]), frames[1:]
        except ProtocolError:
            return {"op": "garbage"}, []

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Fetch the newest version if there is one newer than held (waiting up to ``timeout_s`` for it to be
        published); True when a new version is now held. Tensors from :meth:`tensors` stay valid until the
        next ``poll``."""
        deadline = time.monotonic() + timeout_s
        if self._asked_latest is None:
            self._asked_latest = self._next_id()
            self._sock.send(encode("latest", id=self._asked_latest, have=self.version))
        while True:
            got = self._recv(deadline)
            if got is None:
                return False
            msg, _ = got
            if msg.get("op") == "version" and msg.get("id") == self._asked_latest:
                self._asked_latest = None
                if self._download(msg):
                    return True
                self._asked_latest = self._next_id()  # it was replaced mid-download: ask for the newest
                self._sock.send(encode("latest", id=self._asked_latest, have=self.version))
                deadline = max(deadline, time.monotonic() + self.request_timeout_s)

    def _download(self, head: dict[str, Any]) -> bool:
        total, chunk, version = int(head["total"]), int(head["chunk"]), int(head["version"])
        if self._back is None or self._back.numel() < total:
            self._back = torch.empty(max(total, 1), dtype=torch.uint8)
        buffer = self._back.numpy()
        count = (total + chunk - 1) // chunk
        pending: dict[int, int] = {}  # request id -> chunk index
        next_index, received = 0, 0
        deadline = time.monotonic() + self.request_timeout_s
        while received < count:
            while next_index < count and len(pending) < self.window:
                req_id = self._next_id()
                pending[req_id] = next_index
                self._sock.send(encode("chunk", id=req_id, version=version, index=next_index))
                next_index += 1
            got = self._recv(deadline)
            if got is None:
                raise TimeoutError(f"rollout publisher {self.endpoint} stopped answering (version {version})")
            msg, frames = got
            answered = msg.get("id")
            if not isinstance(answered, int) or answered not in pending:
                continue
            index = pending.pop(answered)
            if msg.get("op") == "gone":
                self.skipped_versions += 1
                self._drain(pending)
                return False
            if msg.get("op") != "chunk" or not frames or zlib.crc32(frames[0]) != msg.get("crc"):
                raise ConnectionError(f"bad chunk {index} of version {version} from {self.endpoint}")
            lo = index * chunk
            buffer[lo : lo + len(frames[0])] = memoryview(frames[0])
            received += 1
            deadline = time.monotonic() + self.request_timeout_s
        if total and zlib.crc32(cast(Any, buffer[:total])) != int(head["crc"]):
            return False  # not one consistent version (cannot happen with per-chunk checks; never exposed)
        layout = [(str(n), str(d), [int(v) for v in s], int(o), int(b)) for n, d, s, o, b in head["layout"]]
        old = self._front
        self._front = _Version(version, self._back, layout, total, int(head["crc"]))
        self._back = old.buffer if old is not None else None
        self.version = version
        return True

    def _drain(self, pending: dict[int, int]) -> None:
        """Read the answers to chunk requests already sent (so they are not mistaken for later ones)."""
        deadline = time.monotonic() + self.request_timeout_s
        while pending:
            got = self._recv(deadline)
            if got is None:
                return
            pending.pop(got[0].get("id"), None)  # type: ignore[arg-type]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held version's tensors (views of the subscriber's front buffer, valid until the next poll)."""
        front = self._front
        if front is None:
            return {}
        out = {}
        for name, dtype, shape, offset, nbytes in front.layout:
            raw = front.buffer[offset : offset + nbytes]
            out[name] = (
                raw.view(_DTYPES.get(dtype, torch.uint8)).reshape(shape)
                if nbytes
                else torch.empty(shape, dtype=_DTYPES.get(dtype, torch.uint8))
            )
        return out

    def load_into(self, model: nn.Module) -> None:
        """Copy the held version into ``model`` (its state_dict names and shapes must match)."""
        with torch.no_grad():
            model.load_state_dict(self.tensors())
