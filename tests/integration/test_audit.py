"""Fleet Audit on the sandbox: real srun-started workers in the node namespaces, real faults on the fabric.

A healthy fabric passes (LinkPass drills included); each injected fault (a switch port with a small MTU,
a lossy link, a dead NIC, a rate-limited link) is found and named on exactly its link, with no other node
failing; ``--drain`` drains the failing node with a ``clockwork:`` reason.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from tests.conftest import until
from tests.integration.conftest import CLOCKWORK, lens_baselines_learned, slurm_env

NODES = "node[1-4]"


@pytest.fixture
def daemons(sandbox: Sandbox) -> Iterator[NodeDaemons]:
    """A daemon (LinkPass and Fleet Lens at their defaults) on every node, with Lens past its baseline."""
    nd = NodeDaemons(sandbox)
    if not all((nd.request(n, "lens") or {}).get("paths") for n in nd.nodes):
        nd.start_all()
    until("Fleet Lens's baselines and clock estimates on every node", lambda: lens_baselines_learned(nd), 60)
    yield nd


def audit(box: Sandbox, *args: str) -> tuple[int, dict[str, Any], str]:
    env = dict(slurm_env(box), CLOCKWORK_CONFIG=str(box.paths.clockwork_toml))
    proc = subprocess.run(
        [CLOCKWORK, "audit", "--nodes", NODES, "--json", *args], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"no JSON report (exit {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
        ) from None
    return proc.returncode, report, proc.stderr


def test_without_linkpass_the_audit_says_so_and_skips_the_drills(sandbox: Sandbox) -> None:
    """No clockworkd on the nodes: the audit finds that at once, names it on every node with how to start it,
    skips the drills (nothing would move the traffic) and still runs every other round."""
    NodeDaemons(sandbox).stop_all()
    rc, report, err = audit(sandbox, "--drill")
    assert rc != 0, err[-2000:]
    assert report["checks"]["drill"] == "fail", report["checks"]
    findings = [f for f in report["findings"] if f["check"] == "drill"]
    assert sorted(f["node"] for f in findings) == ["node1", "node2", "node3", "node4"], findings
    assert all("LinkPass is not running" in f["summary"] and "clockworkd" in f["summary"] for f in findings)
    assert report["drills"] and all(d.get("skipped") for d in report["drills"]), report["drills"]
    assert report["checks"]["mtu"] == "pass" and report["checks"]["loss"] == "pass", report["checks"]


def test_a_healthy_fabric_passes_with_drills(sandbox: Sandbox, daemons: NodeDaemons, tmp_path: Path) -> None:
    html = tmp_path / "audit.html"
    rc, report, err = audit(sandbox, "--drill", "--html", str(html))
    assert rc == 0, ([(f["target"], f["summary"], f["evidence"]) for f in report["findings"]], err)
    assert report["ok"] and report["findings"] == []
    assert all(v["ok"] for v in report["nodes"].values()) and len(report["nodes"]) == 4
    assert report["checks"]["drill"] == "pass" and report["checks"]["clock"] == "pass"
    drills = [d for d in report["drills"] if not d.get("skipped")]
    assert len(drills) == 8  # two NICs on each of four nodes
    assert all(d["failover_ms"] is not None and d["reachable_after"] for d in drills)
    assert any(d["homed_here"] for d in drills)  # at least some drills moved traffic that had to come back
    for rail in ("nic0", "nic1"):
        gbps = report["matrices"]["gbps"][rail]
        assert sum(len(row) for row in gbps.values()) == 12  # every ordered pair on a 4-node rail
        assert len(report["matrices"]["loss_pct"][rail]) == 4
    assert html.read_text().count('<svg class="heatmap"') == 8  # loss, delay, round trip, bandwidth x 2 rails


@pytest.mark.parametrize(
    ("kind", "node", "nic", "value", "check"),
    [
        ("mtu", "node3", "nic1", "1000", "mtu"),
        ("loss", "node2", "nic0", "5", "loss"),
        ("link", "node4", "nic1", "down", "nic"),
        ("rate", "node1", "nic1", "200mbit", "bandwidth"),
    ],
)
def test_each_fault_is_named_on_its_link(
    sandbox: Sandbox, daemons: NodeDaemons, kind: str, node: str, nic: str, value: str, check: str
) -> None:
    sandbox.fault(kind, node, nic, value)
    try:
        rc, report, err = audit(sandbox, "--no-drill")
    finally:
        sandbox.clear_faults()
    assert rc == 1, err
    assert "audit failed on " + node in err
    targets = {f["target"] for f in report["findings"]}
    assert targets == {f"{node}/{nic}"}, report["findings"]
    assert check in {f["check"] for f in report["findings"]}
    assert [n for n, v in report["nodes"].items() if not v["ok"]] == [node]
    assert [link for link, v in report["links"].items() if not v["ok"]] == [f"{node}/{nic}"]


def test_drain_marks_the_failing_node_with_a_clockwork_reason(sandbox: Sandbox, daemons: NodeDaemons) -> None:
    slurm = sandbox.slurm()
    sandbox.fault("link", "node2", "nic0", "down")
    try:
        rc, report, err = audit(sandbox, "--no-drill", "--drain")
    finally:
        sandbox.clear_faults()
    try:
        assert rc == 1 and report["nodes"]["node2"]["ok"] is False
        assert "drained node2: clockwork: audit: nic: link down" in err
        states = {n.name: n for n in slurm.nodes()}
        assert "DRAIN" in states["node2"].state
        assert states["node2"].reason.startswith("clockwork: audit: nic: link down")
        assert all("DRAIN" not in states[n].state for n in ("node1", "node3", "node4"))
    finally:
        slurm.resume("node2")
