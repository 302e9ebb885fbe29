"""An agent's silence needs a second opinion before its node is given up: real agent meshes and coordinator
replicas, one per simulated node on 127.0.0.x (as in tests/unit/test_torchpass_slurm.py), no ranks.

* A link that only the leader lost: agent 2's mesh is replaced by one whose heartbeats no longer reach the
  leader (its leader's address leads nowhere) while agents 1 and 3 still hear it. The leader does not count it
  lost at ``agent_timeout_s`` (0.3 s), tells why (``torchpass.agent_unconfirmed``, heard by 1 and 3), and does
  only after ``agent_stall_timeout_s``.
* A stalled agent on a live node: agent 2's mesh stops (every agent agrees it is silent) while its node's
  daemon still hears the node on the fabric (``fabric_alive``): held (``torchpass.agent_stalled``) and lost only
  after ``agent_stall_timeout_s``; the same silence with the fabric not hearing the node is lost at the timeout,
  every other agent agreeing (with a stall timeout of 10 minutes, nothing else could count it lost in time).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import until
from tests.unit.test_torchpass_coordinator import Events
from tests.unit.test_torchpass_slurm import Node, _free_port_pair
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator
from torchpass.launch.mesh import AgentMesh
from torchpass.launch.proxy import CoordinatorProxy
from torchpass.launch.slurm_layout import SlurmLayout

pytestmark = pytest.mark.usefixtures("job_key")

ADDRESSES = tuple(f"127.0.0.{k + 1}" for k in range(4))
WAIT_S = 30.0
TIMEOUT_S, STALL_S = 0.3, 1.5


def _config(stall_s: float) -> TorchPassConfig:
    return TorchPassConfig(
        agent_heartbeat_interval_s=0.02,
        agent_timeout_s=TIMEOUT_S,
        agent_stall_timeout_s=stall_s,
        agent_startup_timeout_s=5.0,
        heartbeat_timeout_s=60.0,
    )


def _node(k: int, port: int, stall_s: float, addresses: tuple[str, ...] = ADDRESSES) -> Node:
    config = _config(stall_s)
    layout = SlurmLayout(4242, k, 3, 1, ADDRESSES, addresses, port)
    events = Events()
    coord = Coordinator(3, config, event_sink=events, bind_host=ADDRESSES[k], port=port + 1, active=k == 0)
    mesh = AgentMesh(layout, config, coord, event_sink=events)
    coord.replicate = mesh.publish
    coord.leader_hint = mesh.leader_endpoint()
    proxy = CoordinatorProxy(ADDRESSES[k], mesh.leader_endpoint)
    return Node(layout, coord, mesh, proxy, events)


def _start(node: Node) -> Node:
    node.coordinator.start()
    node.mesh.start()
    node.proxy.start()
    return node


@pytest.fixture
def nodes(request: pytest.FixtureRequest) -> Iterator[list[Node]]:
    """Four agents that hear each other; ``agent_stall_timeout_s`` STALL_S unless a test parametrizes it."""
    port = _free_port_pair(list(ADDRESSES))
    made = [_start(_node(k, port, getattr(request, "param", STALL_S))) for k in range(4)]
    until("every agent to hear every other", lambda: all(len(n.mesh.hears()) == 3 for n in made), WAIT_S, 0.01)
    yield made
    for node in made:
        if node.up:
            node.crash()


def _lost(node: Node, agent: int) -> list[dict[str, object]]:
    return [e for e in node.events.of("torchpass.agent_lost") if e["agent"] == agent]


def test_a_link_only_the_leader_lost_is_not_a_lost_node(nodes: list[Node]) -> None:
    leader = nodes[0]
    port = nodes[2].layout.port
    nodes[2].crash()  # agent 2 goes on with a mesh whose heartbeats no longer reach the leader
    cut = ("127.0.0.250", *ADDRESSES[1:])
    nodes[2] = _start(_node(2, port, STALL_S, cut))
    until(
        "the leader to hold agent 2, heard by agents 1 and 3",
        lambda: leader.events.of("torchpass.agent_unconfirmed"),
        WAIT_S,
        0.01,
    )
    (held,) = leader.events.of("torchpass.agent_unconfirmed")
    assert (held["agent"], held["heard_by"], held["lost_after_s"]) == (2, [1, 3], STALL_S), held
    assert held["silent_ms"] >= 1000 * TIMEOUT_S and not _lost(leader, 2) and 2 not in leader.mesh.dead
    until("the stall timeout to count agent 2 lost", lambda: _lost(leader, 2), WAIT_S, 0.01)
    assert _lost(leader, 2)[0]["silent_ms"] >= 1000 * STALL_S


def _stall_agent_2(leader: Node, nodes: list[Node], fabric: bool) -> list[int]:
    """Agent 2's mesh stops (its process stalls: no heartbeat to anybody, its node fine); the leader's node
    daemon answers ``fabric`` about agent 2's node. The agents the leader asked about."""
    asked: list[int] = []

    def alive(agent: int) -> bool:
        asked.append(agent)
        return fabric

    leader.mesh.fabric_alive = alive
    nodes[2].mesh.stop()
    return asked


def test_a_stalled_agent_on_a_node_the_fabric_hears_gets_the_stall_timeout(nodes: list[Node]) -> None:
    leader = nodes[0]
    asked = _stall_agent_2(leader, nodes, fabric=True)
    until(
        "the leader to hold agent 2 (its node is heard)",
        lambda: leader.events.of("torchpass.agent_stalled"),
        WAIT_S,
        0.01,
    )
    (stalled,) = leader.events.of("torchpass.agent_stalled")
    assert (stalled["agent"], stalled["heard_by"]) == (2, ["fabric"]) and not _lost(leader, 2), stalled
    until("the stall timeout to count agent 2 lost", lambda: _lost(leader, 2), WAIT_S, 0.01)
    assert _lost(leader, 2)[0]["silent_ms"] >= 1000 * STALL_S and set(asked) == {2}


@pytest.mark.parametrize("nodes", [600.0], indirect=True)  # only agreement can count it lost within the test
def test_a_silent_agent_every_agent_agrees_on_is_lost_at_the_timeout(nodes: list[Node]) -> None:
    leader = nodes[0]
    asked = _stall_agent_2(leader, nodes, fabric=False)
    until("the leader to count agent 2 lost", lambda: _lost(leader, 2), WAIT_S, 0.01)
    (lost,) = _lost(leader, 2)
    assert lost["silent_ms"] >= 1000 * TIMEOUT_S and not leader.events.of("torchpass.agent_stalled")
    assert set(asked) <= {2}
