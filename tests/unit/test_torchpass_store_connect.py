"""A member joining a generation whose store host died gives up as soon as the generation is superseded.

The store of a generation is hosted by one of its members. When that member dies during the recovery that formed
the generation (two failures a moment apart), its port refuses connections, and TCPStore retries a refused connect
for its whole timeout, twice: a spare joining that generation waited about 50 s in a CI run, long after the
coordinator had announced the next one. ``Rejoiner._rendezvous`` connects in short tries and checks between them.
Real TCPStores on 127.0.0.1; the rejoiner's configuration and coordinator link are the two attributes it reads.
"""

from __future__ import annotations

import datetime
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from torchpass.rank.rejoin import GenerationBroken, Rejoiner


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rejoiner(latest_gen: int, timeout_s: float) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(collective_timeout_s=timeout_s), link=SimpleNamespace(latest_gen=latest_gen)
    )


def test_a_dead_stores_generation_is_left_once_superseded_and_otherwise_after_the_timeout() -> None:
    port = _closed_port()
    superseded = _rejoiner(latest_gen=5, timeout_s=600.0)  # a wait of 600 s would time the test out
    with pytest.raises(GenerationBroken, match="superseded by generation 5"):
        Rejoiner._rendezvous(superseded, "127.0.0.1", port, "g4", 4)  # type: ignore[arg-type]
    current = _rejoiner(latest_gen=4, timeout_s=2.0)
    with pytest.raises(GenerationBroken, match=f"store 127.0.0.1:{port} unreachable"):
        Rejoiner._rendezvous(current, "127.0.0.1", port, "g4", 4)  # type: ignore[arg-type]


def test_a_live_store_is_joined_with_the_collective_timeout() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    store = Rejoiner._rendezvous(_rejoiner(4, 7.0), "127.0.0.1", server.port, "g4", 4)  # type: ignore[arg-type]
    store.set("arrive/0", "w0")
    assert server.get("g4/arrive/0") == b"w0"
    assert store.timeout == datetime.timedelta(seconds=7)
