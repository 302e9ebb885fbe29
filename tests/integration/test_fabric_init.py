"""``clockwork fabric inventory`` and ``clockwork fabric init`` on the 4-node sandbox: the nodes' own reports give the
same fabric map the sandbox was built with (it plans its fabric with the same code), and ``--apply`` restores a
node's missing route, over which its node address reaches every peer's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, on_node


def _routes(box: Sandbox, node: str) -> dict[str, dict[str, str]]:
    netns = box.layout().node(node).netns
    shown = subprocess.run(["ip", "-n", netns, "-j", "route", "show"], capture_output=True, text=True, check=True)
    return {r["dst"]: r for r in json.loads(shown.stdout) if r.get("dst", "").count(".") == 3}


def test_fabric_init_builds_the_sandboxs_fabric_and_applies_a_nodes_routes(sandbox: Sandbox, short_tmp: Path) -> None:
    box = sandbox
    layout = box.layout()
    config = str(box.paths.clockwork_toml)
    inv = short_tmp / "inv"
    inv.mkdir()
    for node in layout.nodes:
        done = on_node(
            box,
            node.name,
            CLOCKWORK,
            "--config",
            config,
            "fabric",
            "inventory",
            "--nics",
            "nic*",
            "--node",
            node.name,
            "--out",
            str(inv / f"{node.name}.json"),
        )
        assert done.returncode == 0, done.stderr
    out, routes = short_tmp / "fabric.json", short_tmp / "routes.json"
    nodes = ",".join(n.name for n in layout.nodes)
    argv = [
        CLOCKWORK,
        "--config",
        config,
        "fabric",
        "init",
        "--nodes",
        nodes,
        "--inventory",
        str(inv),
        "--out",
        str(out),
    ]
    done = subprocess.run([*argv, "--routes", str(routes)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == json.loads(box.paths.fabric_map.read_text())
    assert len(json.loads(routes.read_text())["node2"]) == len(layout.nodes) - 1

    # node2 loses its route to node3's node address; --apply on node2 puts it back, over nic0, from node2's address
    node2, node3 = layout.node("node2"), layout.node("node3")
    subprocess.run(["ip", "-n", node2.netns, "route", "del", f"{node3.node_addr}/32"], check=True)
    assert node3.node_addr not in _routes(box, "node2")
    done = on_node(box, "node2", *argv, "--apply", "--node", "node2")
    assert done.returncode == 0, done.stderr
    route = _routes(box, "node2")[node3.node_addr]
    assert route["dev"] == "nic0" and route["prefsrc"] == node2.node_addr and route["gateway"] == node3.nics[0].ip
    for peer in layout.nodes:
        if peer is not node2:
            ping = on_node(box, "node2", "ping", "-c", "1", "-W", "2", "-I", node2.node_addr, peer.node_addr)
            assert ping.returncode == 0, f"node2 -> {peer.name}: {ping.stdout}{ping.stderr}"
