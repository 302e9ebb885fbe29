"""``clockwork fabric init``: the fabric map and per-peer routes from the nodes' inventories, and the checks that
refuse a fabric LinkPass could not work on. The sandbox builds its own fabric with the same plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clockwork.cli.fabric_cmd import inventory_from_ip, route_batch
from clockwork.cli.main import run
from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import ClockworkError
from clockwork.sandbox.fabric import baseline_routes
from clockwork.sandbox.layout import build_layout
from clockwork.sandbox.slurm_files import fabric_map
from linkpass.fabric import FabricError, FabricMap
from linkpass.plan import Inventory, plan


def inventories(n: int = 4, rails: int = 2) -> dict[str, Inventory]:
    return {
        f"n{i}": Inventory(f"n{i}", f"10.0.0.{i}", {f"ib{r}": f"10.{r + 1}.0.{i}/24" for r in range(rails)})
        for i in range(1, n + 1)
    }


def test_a_good_fabric_gives_the_map_and_a_route_per_peer() -> None:
    invs = inventories()
    result = plan(list(invs), invs)
    fab = FabricMap.parse(result.fabric)
    assert fab.node("n2").nics == {"ib0": "10.1.0.2", "ib1": "10.2.0.2"} and fab.node("n2").addr == "10.0.0.2"
    routes = result.routes["n1"]
    assert routes[0].ip_batch() == "route replace 10.0.0.2/32 via 10.1.0.2 dev ib0 src 10.0.0.1"
    assert len(routes) == 3 and {r.dev for r in routes} == {"ib0"}
    spread = plan(list(invs), invs, home="spread").routes["n1"]
    assert {r.dev for r in spread} == {"ib0", "ib1"}
    assert all(r.via == fab.node(next(n for n in invs if invs[n].addr == r.dst)).nics[r.dev] for r in spread)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.pop("n3"), "no inventory from n3"),
        (lambda i: i.__setitem__("n2", Inventory("n2", "10.0.0.2", {"ib0": "10.1.0.2/24"})), "the rails differ"),
        (lambda i: i.__setitem__("n2", Inventory("n2", "10.0.0.1", i["n2"].nics)), "10.0.0.1 is n1's node address"),
        (
            lambda i: i.__setitem__("n2", Inventory("n2", "10.0.0.2", {"ib0": "10.9.0.2/24", "ib1": "10.2.0.2/24"})),
            "rail ib0 spans 2 subnets",
        ),
        (lambda i: i.__setitem__("n2", Inventory("n2", "10.1.0.77", i["n2"].nics)), "lies on rail ib0's subnet"),
    ],
)
def test_a_fabric_that_would_not_work_is_refused_naming_the_problem(change: object, message: str) -> None:
    invs = inventories()
    change(invs)  # type: ignore[operator]
    with pytest.raises(FabricError, match=message):
        plan(["n1", "n2", "n3", "n4"], invs)


def test_the_inventory_is_read_from_ip_json() -> None:
    shown: list[dict[str, Any]] = [
        {
            "ifname": "lo",
            "addr_info": [
                {"family": "inet", "local": "127.0.0.1", "prefixlen": 8},
                {"family": "inet", "local": "10.0.0.7", "prefixlen": 32},
            ],
        },
        {"ifname": "eno1", "addr_info": [{"family": "inet", "local": "192.168.1.7", "prefixlen": 24}]},
        {"ifname": "ib0", "addr_info": [{"family": "inet", "local": "10.1.0.7", "prefixlen": 24}]},
        {"ifname": "ib1", "addr_info": []},
    ]
    inv = inventory_from_ip("n7", shown, ["ib*"], None)
    assert inv == Inventory("n7", "10.0.0.7", {"ib0": "10.1.0.7/24"})
    with pytest.raises(ClockworkError, match="one node address"):
        inventory_from_ip("n7", shown[1:], ["ib*"], None)
    assert route_batch("10.0.0.7", []) == "addr replace 10.0.0.7/32 dev lo\n"


def test_fabric_init_writes_the_map_and_the_routes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv_dir = tmp_path / "inv"
    inv_dir.mkdir()
    for name, inv in inventories().items():
        (inv_dir / f"{name}.json").write_text(json.dumps(inv.to_doc()))
    out, routes = tmp_path / "fabric.json", tmp_path / "routes.json"
    argv = ["fabric", "init", "--nodes", "n[1-4]", "--inventory", str(inv_dir), "--out", str(out)]
    assert run([*argv, "--routes", str(routes)]) == 0
    assert FabricMap.load(out).node("n4").nics["ib1"] == "10.2.0.4"
    assert len(json.loads(routes.read_text())["n4"]) == 3
    (inv_dir / "n2.json").unlink()
    assert run(argv) != 0
    assert "no inventory from n2" in capsys.readouterr().err


def test_the_sandbox_builds_its_fabric_with_the_same_plan() -> None:
    layout = build_layout(SandboxConfig(nodes=4))
    node = layout.nodes[0]
    assert baseline_routes(layout, node)[0] == (
        f"route replace {layout.nodes[1].node_addr}/32 via {layout.nodes[1].nics[0].ip} dev nic0 src {node.node_addr}"
    )
    fab = FabricMap.parse(json.loads(fabric_map(layout)))
    assert sorted(fab.nodes) == [n.name for n in layout.nodes]
