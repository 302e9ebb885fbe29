"""The peer-copy stream (torchpass.sharded.peer_wire) on real loopback sockets, without a job: a copy arrives bitwise
and is acknowledged, the last complete copy survives a newer one being written, a stranger without the job's key is
refused, and a frame arriving while the copies are frozen is dropped and its sender told so."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch

from torchpass.sharded.peer_wire import ACK, CopyLink, CopyListener, ReceivedCopies, WireError

SECRET = os.urandom(32)


@pytest.fixture
def listener() -> Iterator[CopyListener]:
    receiver = CopyListener("127.0.0.1", ReceivedCopies(), SECRET, timeout_s=10.0)
    yield receiver
    receiver.close()


def _payload(seed: int, nbytes: int = 100_003) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_copy_arrives_bitwise_and_the_last_complete_one_is_kept(listener: CopyListener) -> None:
    link = CopyLink(listener.address, SECRET, timeout_s=10.0)
    first, second, third = _payload(1), _payload(2), _payload(3, 5000)
    link.send(3, 7, b"meta-7", first)  # returns once the receiver acknowledged step 7
    assert listener.copies.steps(3) == [7]
    link.send(3, 8, b"meta-8", second)
    assert listener.copies.steps(3) == [8, 7]  # two buffers: both complete copies are served
    link.send(3, 9, b"meta-9", third)  # written over the older (7), never over the newest complete (8)
    assert listener.copies.steps(3) == [9, 8]
    kept = listener.copies.get(3, 8)
    assert kept is not None and kept.blob == b"meta-8" and torch.equal(kept.data, second)
    newest = listener.copies.get(3, 9)
    assert newest is not None and torch.equal(newest.data, third)  # a smaller copy in reused memory
    listener.copies.drop_after(8)
    assert listener.copies.steps(3) == [8]
    link.close()


def test_a_frame_arriving_while_frozen_is_dropped_and_the_sender_told(listener: CopyListener) -> None:
    link = CopyLink(listener.address, SECRET, timeout_s=10.0)
    link.send(0, 4, b"m", _payload(4))
    listener.copies.freeze()
    with pytest.raises(WireError, match="did not keep the copy of step 5"):
        link.send(0, 5, b"m", _payload(5))
    assert listener.copies.steps(0) == [4] and listener.dropped == 1
    listener.copies.thaw()
    link.send(0, 6, b"m", _payload(6))  # the same connection goes on
    assert listener.copies.steps(0) == [6, 4]
    link.close()


def test_a_stranger_without_the_job_key_is_refused(listener: CopyListener) -> None:
    with pytest.raises((WireError, OSError)):
        stranger = CopyLink(listener.address, os.urandom(32), timeout_s=10.0)
        stranger.send(1, 1, b"m", _payload(1))
    assert listener.copies.steps(1) == []
    raw = socket.create_connection(listener.address, timeout=10.0)  # a wrong answer to the nonce
    raw.recv(32)
    raw.sendall(b"\0" * 32)
    assert raw.recv(ACK.size) == b""  # closed at once
    raw.close()
    assert listener.copies.steps(1) == [] and listener.received == 0
