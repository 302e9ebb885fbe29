"""The peer-copy stream refuses what was changed in flight: a man in the middle on loopback (a TCP proxy between a
real sender and a real receiver) flips one byte of a frame, and the receiver refuses the frame with a clear reason,
keeps its last complete copy, and closes the connection; the sender's copy fails like one to a dead neighbour, and
the next round goes through on a new connection. Records replayed or reordered do not open either, and the
state's description travels as msgpack: bytes that are not one (a pickle included) are refused, never run."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey
from torchpass.config import TorchPassConfig
from torchpass.rank.state import StateParts, TensorRef, describe
from torchpass.rank.state_codec import MetaCodecError, decode_meta, encode_meta
from torchpass.sharded.peer_copy import PeerCopies
from torchpass.sharded.peer_wire import CHUNK, CopyLink, CopyListener, FrameRefused, ReceivedCopies, WireError
from torchpass.sharded.sealed_stream import LENGTH, NONCE_BYTES, PROOF_BYTES, TAG_BYTES, RecordRefused, SealedStream

SECRET = os.urandom(32)
LOG = logging.LoggerAdapter(logging.getLogger("test.peer_wire_tamper"), {})


def _exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class TamperProxy:
    """A loopback TCP proxy in front of ``target`` that flips one byte in the sealed body of the sender's records
    whose numbers (0 = the first after the handshake) are in ``tamper``; everything else passes as it is."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.tamper: set[int] = set()
        self.flipped = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = ("127.0.0.1", int(self._server.getsockname()[1]))
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            threading.Thread(target=self._records, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pass, args=(upstream, client), daemon=True).start()

    def _records(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            dst.sendall(_exact(src, PROOF_BYTES + NONCE_BYTES))  # the sender's half of the handshake
            number = 0
            while True:
                prefix = _exact(src, LENGTH.size)
                body = bytearray(_exact(src, LENGTH.unpack(prefix)[0] + TAG_BYTES))
                if number in self.tamper:
                    body[len(body) // 2] ^= 0x01
                    self.flipped += 1
                dst.sendall(prefix + body)
                number += 1
        except OSError:
            pass
        finally:
            _close(src, dst)

    @staticmethod
    def _pass(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def close(self) -> None:
        self._server.close()
        _close(*self._sockets)


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


@pytest.fixture
def listener() -> Iterator[CopyListener]:
    receiver = CopyListener("127.0.0.1", ReceivedCopies(), SECRET, timeout_s=10.0)
    yield receiver
    receiver.close()


@pytest.fixture
def proxy(listener: CopyListener) -> Iterator[TamperProxy]:
    middle = TamperProxy(listener.address)
    yield middle
    middle.close()


def _payload(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("where", "record", "nbytes"),
    [
        ("the head", 2, 5000),  # frame 1 is records 0-1 (head, one chunk); frame 2 starts at record 2
        ("the last payload record", 3, 5000),
        ("the first of three payload records", 3, 2 * CHUNK + 12345),
    ],
)
def test_a_byte_flipped_in_flight_is_refused(
    listener: CopyListener, proxy: TamperProxy, caplog: pytest.LogCaptureFixture, where: str, record: int, nbytes: int
) -> None:
    link = CopyLink(proxy.address, SECRET, timeout_s=10.0)
    first = _payload(1, 5000)
    link.send(0, 7, b"meta-7", first)  # passes the proxy untouched
    proxy.tamper = {record}
    with caplog.at_level(logging.WARNING, "clockwork.torchpass.peer_wire"), pytest.raises(WireError) as info:
        link.send(0, 8, b"meta-8", _payload(2, nbytes))
    assert proxy.flipped == 1, where
    if where == "the last payload record":  # the sender had sent it all: the receiver's sealed answer says why
        assert isinstance(info.value, FrameRefused)
        assert "refused the copy of step 8: a frame did not open" in str(info.value)
    # The receiver: refused with the reason, kept nothing of the frame, and its last complete copy is intact.
    assert listener.refused == 1 and listener.received == 1
    assert "a peer-copy frame was refused and its connection closed" in listener.last_refusal
    assert "failed authentication: changed in flight, replayed, reordered" in listener.last_refusal
    assert listener.last_refusal in caplog.text
    assert listener.copies.steps(0) == [7]
    kept = listener.copies.get(0, 7)
    assert kept is not None and kept.blob == b"meta-7" and torch.equal(kept.data, first)
    link.close()


def _parts(seed: int) -> StateParts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return StateParts(model=model, optimizers=[optimizer])


def test_a_tampered_copy_fails_like_a_dead_neighbours_and_the_next_round_goes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks' PeerCopies with the proxy in front of slot 1's listener: the recovery path (what the agreement
    reports, the acknowledged step) sees the tampered round as a failed copy, nothing more."""
    monkeypatch.setenv(ENV_JOB_KEY, JobKey.new().hex)
    config = TorchPassConfig(peer_copies=1, peer_copy_every_steps=2, collective_timeout_s=10.0)
    a = PeerCopies(config, 0, 2, "127.0.0.1", LOG, None)
    b = PeerCopies(config, 1, 2, "127.0.0.1", LOG, None)
    middle = TamperProxy(b.address)
    try:
        a.set_peers({0: a.address, 1: middle.address})
        middle.tamper = {1}  # the first payload record of the first round
        parts = _parts(0)
        a.capture(parts, 1)
        assert a.wait_sent(10.0) == -2  # no round acknowledged
        assert a.failed == 1 and a.rounds == 0 and middle.flipped == 1
        assert b.received.steps(0) == [] and b.holdings(True, 1).steps == (None, 1)  # nothing to report
        assert b.listener.refused == 1 and "failed authentication" in b.listener.last_refusal
        assert a.copy_of(0, 1) is not None  # its own copy still serves a rollback
        a.capture(parts, 3)  # the failed link was dropped: a new connection, whose record 1 is tampered too
        assert a.wait_sent(10.0) == -2 and a.failed == 2 and b.listener.refused == 2
        middle.tamper = set()
        a.capture(parts, 5)
        assert a.wait_sent(10.0) == 5 and a.failed == 2 and b.received.steps(0) == [5]
        sent, mine = b.copy_of(0, 5), a.copy_of(0, 5)
        assert sent is not None and mine is not None and torch.equal(sent.data, mine.data)
    finally:
        middle.close()
        a.close()
        b.close()


# ----- the record layer: replays and reordering --------------------------------------------------------------


def _sealed_pair() -> tuple[SealedStream, SealedStream, socket.socket, socket.socket]:
    """A connecting stream writing into a socket the test reads raw, and an accepting stream reading from a socket
    the test writes: the test is the man in the middle, after an honest handshake."""
    sender_sock, mitm_in = socket.socketpair()
    mitm_out, receiver_sock = socket.socketpair()
    accepted: list[SealedStream] = []
    thread = threading.Thread(
        target=lambda: accepted.append(SealedStream.accept(receiver_sock, SECRET, b"test", 1 << 20)), daemon=True
    )
    thread.start()
    relay = threading.Thread(target=lambda: mitm_in.sendall(_exact(mitm_out, NONCE_BYTES)), daemon=True)
    relay.start()
    sender = SealedStream.connect(sender_sock, SECRET, b"test", 1 << 20)
    relay.join()
    mitm_out.sendall(_exact(mitm_in, PROOF_BYTES + NONCE_BYTES))
    thread.join(10.0)
    return sender, accepted[0], mitm_in, mitm_out


def _record(sock: socket.socket) -> bytes:
    prefix = _exact(sock, LENGTH.size)
    return prefix + _exact(sock, LENGTH.unpack(prefix)[0] + TAG_BYTES)


@pytest.mark.parametrize("attack", ["replayed", "reordered"])
def test_a_record_replayed_or_reordered_does_not_open(attack: str) -> None:
    sender, receiver, mitm_in, mitm_out = _sealed_pair()
    try:
        sender.send(b"first")
        sender.send(b"other")
        one, two = _record(mitm_in), _record(mitm_in)
        if attack == "replayed":
            mitm_out.sendall(one + one)
            assert receiver.recv() == b"first"
        else:
            mitm_out.sendall(two)
        with pytest.raises(RecordRefused, match="failed authentication"):
            receiver.recv()
    finally:
        for sock in (sender.sock, receiver.sock, mitm_in, mitm_out):
            sock.close()


def test_a_stranger_is_refused_after_its_first_32_bytes() -> None:
    mine, theirs = socket.socketpair()
    refused: list[BaseException] = []

    def accept() -> None:
        try:
            SealedStream.accept(mine, SECRET, b"test", 1 << 20)
        except RecordRefused as exc:
            refused.append(exc)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    _exact(theirs, NONCE_BYTES)
    theirs.sendall(os.urandom(PROOF_BYTES))
    thread.join(10.0)
    assert refused and "did not prove it holds the job's key" in str(refused[0])
    mine.close()
    theirs.close()


# ----- the state's description: msgpack, a closed set of types -----------------------------------------------


def test_a_state_description_round_trips_through_msgpack() -> None:
    scheduler_parts = _parts(3)
    scheduler_parts.extra["scheduler"] = torch.optim.lr_scheduler.StepLR(scheduler_parts.optimizers[0], 3)
    meta, _ = describe(scheduler_parts, 11)
    meta["user"] = OrderedDict(
        a=(1, 2.5, None, b"x", True), b={3: {1, 2}, (1, 2): np.float64(1.5)}, c=np.arange(6).reshape(2, 3)
    )
    back = decode_meta(encode_meta(meta))
    assert {k: back[k] == meta[k] for k in meta if k != "user"} == dict.fromkeys(meta.keys() - {"user"}, True)
    assert back["optim"][0]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple stays a tuple
    assert isinstance(back["user"], OrderedDict) and back["user"]["a"] == meta["user"]["a"]
    assert back["user"]["b"] == meta["user"]["b"] and type(back["user"]["b"][(1, 2)]) is np.float64
    assert np.array_equal(back["user"]["c"], meta["user"]["c"])
    assert all(isinstance(v, TensorRef) for v in back["optim"][0]["state"][0].values())


def test_what_cannot_travel_is_refused_at_capture_and_what_is_not_msgpack_is_never_run() -> None:
    class Opaque:
        pass

    with pytest.raises(MetaCodecError, match=r"it holds a .*Opaque"):
        encode_meta({"extra": {"thing": [Opaque()]}})
    ran: list[int] = []

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return (ran.append, (1,))

    for garbage in (pickle.dumps({"meta": Payload()}), b"\xc1", b"\x92\x01", os.urandom(64)):
        with pytest.raises(MetaCodecError):
            decode_meta(garbage)
    assert ran == []
