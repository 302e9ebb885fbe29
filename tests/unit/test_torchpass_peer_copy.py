"""A rank's peer copies (torchpass.sharded.peer_copy) without a job: two ranks' PeerCopies in one process on loopback.
A round captures the committed state while the parameters may still change only after ``before_update``; the
copy reaches the ring successor bitwise; a rank rolls its live state back to its own copy of an earlier step,
optimizer state included; and the agreement row says what each holds."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey
from torchpass.config import TorchPassConfig
from torchpass.rank.state import StateParts
from torchpass.sharded.peer_copy import PeerCopies, ring_holders

LOG = logging.LoggerAdapter(logging.getLogger("test.peer_copy"), {})


def _parts(seed: int) -> StateParts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return StateParts(model=model, optimizers=[torch.optim.AdamW(model.parameters(), lr=0.1)])


def _train(parts: StateParts) -> None:
    assert parts.model is not None
    parts.model(torch.randn(4, 8)).sum().backward()
    parts.optimizers[0].step()
    parts.optimizers[0].zero_grad()


def _snapshot(parts: StateParts) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    assert parts.model is not None
    model = {k: v.clone() for k, v in parts.model.state_dict().items()}
    moments = [t.clone() for s in parts.optimizers[0].state.values() for t in s.values()]
    return model, moments


@pytest.fixture
def ring(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PeerCopies, PeerCopies]]:
    monkeypatch.setenv(ENV_JOB_KEY, JobKey.new().hex)
    config = TorchPassConfig(peer_copies=1, peer_copy_every_steps=2, collective_timeout_s=10.0)
    a = PeerCopies(config, 0, 2, "127.0.0.1", LOG, None)
    b = PeerCopies(config, 1, 2, "127.0.0.1", LOG, None)
    for peers in (a, b):
        peers.set_peers({0: a.address, 1: b.address})
    yield a, b
    a.close()
    b.close()


def test_the_ring_successors_keep_each_shard() -> None:
    assert ring_holders(3, 4, 1) == [0] and ring_holders(1, 4, 2) == [2, 3] and ring_holders(0, 2, 2) == [1]


def test_a_round_reaches_the_successor_and_a_rank_rolls_back_to_its_own_copy(
    ring: tuple[PeerCopies, PeerCopies],
) -> None:
    a, b = ring
    parts = _parts(0)
    _train(parts)
    assert [a.due(s) for s in range(4)] == [False, True, False, True]  # K = 2: after steps 1, 3, ...
    a.capture(parts, 1)
    at_1 = _snapshot(parts)
    a.before_update()  # the next update waits for the round: copied and acknowledged by slot 1
    assert a.acknowledged == 1 and b.received.steps(0) == [1]
    _train(parts)
    a.capture(parts, 3)
    assert a.wait_sent(10.0) == 3 and b.received.steps(0) == [3, 1]
    sent = b.copy_of(0, 1)
    mine = a.copy_of(0, 1)
    assert sent is not None and mine is not None and torch.equal(sent.data, mine.data) and sent.blob == mine.blob
    _train(parts)  # the live state moves on to "step 4"
    assert a.holdings(True, 4).steps == (4, None) and a.holdings(True, 4).older == ((3, 1), ())
    assert b.holdings(True, 4).steps == (3, 4) and b.holdings(True, 4).older == ((1,), ())
    a.restore(parts, 1, torch.device("cpu"))
    model, moments = _snapshot(parts)
    assert all(torch.equal(model[k], at_1[0][k]) for k in model)
    assert all(torch.equal(x, y) for x, y in zip(moments, at_1[1], strict=True))
    a.thaw(1)  # resuming after step 1: the copies of step 3 are of a future computed again
    assert a.holdings(True, 1).older == ((1,), ()) and b.received.steps(0) == [3, 1]
    b.thaw(1)
    assert b.received.steps(0) == [1]


def test_a_dead_successor_fails_the_copy_not_the_step(ring: tuple[PeerCopies, PeerCopies]) -> None:
    a, b = ring
    b.listener.close()
    parts = _parts(1)
    a.capture(parts, 1)
    a.before_update()  # returns: the copy failed at once (connection refused)
    assert a.failed == 1 and a.acknowledged == -2
    assert a.copy_of(0, 1) is not None  # its own copy still serves a rollback


def test_under_hsdp_a_copy_stays_in_its_replica_and_is_reported_by_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 x 2: slot 3 (replica 1, shard 1) sends to slot 2 (replica 1, shard 0), its row's ring successor, not to
    slot 0 (its successor in a ring of all slots); slot 2 reports the copy as shard 1's, beside its live shard 0."""
    monkeypatch.setenv(ENV_JOB_KEY, JobKey.new().hex)
    config = TorchPassConfig(peer_copies=1, collective_timeout_s=10.0)
    two = PeerCopies(config, 2, 2, "127.0.0.1", LOG, None)
    three = PeerCopies(config, 3, 2, "127.0.0.1", LOG, None)
    elsewhere = PeerCopies(config, 0, 2, "127.0.0.1", LOG, None)  # replica 0's shard 0: must receive nothing
    try:
        addresses = {0: elsewhere.address, 1: elsewhere.address, 2: two.address, 3: three.address}
        for peers in (two, three):
            peers.set_peers(addresses)
        parts = _parts(3)
        three.capture(parts, 0)
        assert three.wait_sent(10.0) == 0 and three.failed == 0
        assert two.received.steps(1) == [0] and elsewhere.received.steps(1) == []
        assert two.holdings(True, 0).steps == (0, 0) and three.holdings(True, 0).steps == (None, 0)
        sent, mine = two.copy_of(1, 0), three.copy_of(1, 0)
        assert sent is not None and mine is not None and torch.equal(sent.data, mine.data)
    finally:
        for peers in (two, three, elsewhere):
            peers.close()
