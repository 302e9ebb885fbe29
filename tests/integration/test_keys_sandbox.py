"""Per-node key pairs on the sandbox: LinkPass's heartbeats and Fleet Lens's probes are accepted between
nodes that each hold only their own secret, and a node that signs a heartbeat for another is refused and
logged.

The daemons run with ``[daemon] curve_secret_key = KEYS/{node}.key_secret`` (each node its own pair, every
node's public key in the folder), as the admin guide's per-node set-up says. The forger is node3's own root:
it holds node3's secret, signs with the key node3 shares with node1, and says it is node2 (with a down notice
for node2's nic0, which would move node1's traffic if it were believed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.config import load_config
from clockwork.contracts.curve_keys import generate
from clockwork.sandbox.cluster import REPO_ROOT, Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from tests.conftest import until

FORGE = """
import socket, sys
from pathlib import Path
from clockwork.contracts.pairwise_keys import PairwiseKeys
from linkpass import heartbeat
from linkpass.fabric import FabricMap
keys, src, dst, port, fabric = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
mine = PairwiseKeys(b"clockwork-linkpass", keys / "node3.key_secret", keys, ["node1", "node2", "node4"])
index = heartbeat.FabricIndex.of(FabricMap.load(fabric))
two, one, nic0 = index.node_number("node2"), index.node_number("node1"), index.rail_number("nic0")
heard = ((one, (1 << len(index.rails)) - 1),)
forged = heartbeat.Heartbeat(two, nic0, 10**9, heard, down=1 << nic0, flags=heartbeat.FLAG_NOTICE)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.bind((src, 0))
    for _ in range(5):
        s.sendto(heartbeat.encode(forged, index, mine.send_key("node1")), (dst, port))
"""


@pytest.fixture
def per_node_daemons(sandbox: Sandbox) -> Iterator[tuple[NodeDaemons, Path]]:
    keys = sandbox.paths.root / "per-node-keys"
    if keys.exists():
        for f in keys.iterdir():
            f.unlink()
    nd = NodeDaemons(sandbox)
    for node in nd.nodes:
        generate(keys, node)
    nd.start_all(
        {
            "daemon.curve_secret_key": str(keys / "{node}.key_secret"),
            "daemon.curve_public_key": str(keys / "{node}.key"),
        }
    )
    try:
        yield nd, keys
    finally:
        nd.stop_all()  # the next module's daemons start with the sandbox's shared pair


def linkpass(nd: NodeDaemons, node: str) -> dict[str, Any]:
    return nd.component(node, "linkpass")


def heartbeats_flow(nd: NodeDaemons) -> bool:
    """Every node's LinkPass hears every peer on every rail, and has refused nothing."""
    for node in nd.nodes:
        lp = linkpass(nd, node)
        beats = lp.get("heartbeats") or {}
        paths = lp.get("paths") or {}
        if beats.get("received", 0) < 20 * (len(nd.nodes) - 1) or beats.get("rejected", 1) != 0:
            return False
        if len(paths) != len(nd.nodes) - 1 or any(s != "alive" for p in paths.values() for s in p.values()):
            return False
    return True


def probes_flow(nd: NodeDaemons) -> bool:
    """Every node's Lens receives probes from every peer and has rejected nothing."""
    for node in nd.nodes:
        snap = nd.request(node, "lens") or {}
        paths = snap.get("paths") or []
        counters = snap.get("counters") or {}
        if len(paths) < len(nd.nodes) - 1 or not all(p.get("received", 0) > 0 for p in paths):
            return False
        if counters.get("rejected", 1) != 0 or counters.get("summaries_received", 0) == 0:
            return False
    return True


def test_per_node_keys_carry_heartbeats_and_probes_and_refuse_a_forger(
    sandbox: Sandbox, per_node_daemons: tuple[NodeDaemons, Path]
) -> None:
    nd, keys = per_node_daemons
    until("heartbeats between every pair of nodes under per-node keys", lambda: heartbeats_flow(nd), 60)
    until("Lens probes and summaries between every pair of nodes under per-node keys", lambda: probes_flow(nd), 60)

    layout = sandbox.layout()
    node1, node3 = layout.node("node1"), layout.node("node3")
    port = load_config(sandbox.paths.clockwork_toml, env={}).config.linkpass.heartbeat_port
    failovers = linkpass(nd, "node1").get("failovers", 0)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'daemon'}"}
    fabric = str(sandbox.paths.fabric_map)
    argv = [sys.executable, "-c", FORGE, str(keys), node3.nics[0].ip, node1.nics[0].ip, str(port), fabric]
    subprocess.run(sandbox.exec_argv("node3", argv), env=env, check=True, timeout=60)

    until(
        "node1 to refuse node3's heartbeats that claim to be node2's",
        lambda: (linkpass(nd, "node1").get("heartbeats") or {}).get("refused", 0) >= 5,
        30,
    )
    # The daemons log to the sandbox's one Clockwork log ([log] file), each line naming its node.
    log = (sandbox.paths.logs / "clockwork.log").read_text()
    assert "node1: heartbeat from" in log and "refused: signed by node3 but claims to be node2" in log
    lp = linkpass(nd, "node1")
    assert lp.get("failovers", 0) == failovers  # the forged down notice for node2's nic0 moved nothing
    assert all(state == "alive" for state in (lp.get("paths") or {}).get("node2", {}).values()), lp["paths"]
