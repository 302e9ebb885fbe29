"""Node-silent verdicts on the sandbox: no false loss under the faults that only look like a dead node, and a
crashed node judged dead by two observers.

One 3-node sandbox and one set of node daemons for the whole module (LinkPass, Fleet Lens and the node watch, as
a job's Prolog starts them), with one job registered on every daemon so that a verdict would reach it. Each case
injects its fault, waits until the daemons have seen it (LinkPass's paths, the node watch's suspects), lifts it,
waits until every path is heard again, and then asserts that no daemon judged any node dead and that no
``node.silent`` event reached the job:

* a node whose daemon and every other process are SIGSTOPped for 1 s (the fault itself is the one fixed wait):
  its kernel still answers the other daemons' ICMP echoes, which they must have probed (``kernel_answered``);
* a single dead NIC (link down on one node's nic0: LinkPass's job, the node still heard on nic1);
* a flapping link (nic0 of one node down and up again three times);
* a partition of one rail (rail 0's switch stops forwarding: every port blackholed, every node still heard on
  rail 1).

The last case is the positive control that makes the others mean something: a node crash (every process killed,
its links dark) is judged dead by both other daemons, each confirmed by the other, and the verdict reaches the
job's long poll on the control socket and its event log. Timings are bench/torchpass_recovery.py's business.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from clockwork.contracts.daemon_client import DaemonClient
from clockwork.sandbox import processes
from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from tests.conftest import until
from tests.integration.conftest import SandboxManager, daemon_paths

NODES = ("node1", "node2", "node3")
JOB_ID = 930001
STOP_S = 1.0  # the starved node's stop: the fault itself


@pytest.fixture(scope="module")
def box(sandbox_manager: SandboxManager) -> Iterator[Sandbox]:
    """The sandbox with a node daemon on every node, every node watch ready to judge, and a job registered."""
    sandbox = sandbox_manager.ensure_up(nodes=len(NODES), accounting=False)
    sandbox.clear_faults()
    daemons = NodeDaemons(sandbox)
    daemons.start_all()
    for node in NODES:
        with DaemonClient(daemon_paths(sandbox, node), timeout_s=5) as client:
            client.register_job(JOB_ID, 0, "root", list(NODES))
    until("every node watch to hear every peer, and every peer's kernel to answer an echo", lambda: _ready(sandbox), 30)
    yield sandbox
    sandbox.clear_faults()


def _watch(box: Sandbox, node: str) -> dict[str, Any]:
    return NodeDaemons(box).component(node, "nodewatch")


def _ready(box: Sandbox) -> bool:
    for node in NODES:
        watch = _watch(box, node)
        if watch.get("enabled") is not True or watch.get("local_fault") or watch.get("suspects"):
            return False
        if sorted(watch.get("echo_answered", [])) != [n for n in NODES if n != node]:
            return False
    return True


def _paths(box: Sandbox, node: str) -> dict[str, dict[str, str]]:
    lp = NodeDaemons(box).component(node, "linkpass")
    paths = lp.get("paths", {})
    return paths if isinstance(paths, dict) else {}


def _all_paths_heard(box: Sandbox) -> bool:
    """Every node hears every peer on every rail again (alive, or in its fail-back hold-down)."""
    return all(
        not state.startswith("dead")
        for node in NODES
        for rails in _paths(box, node).values()
        for state in rails.values()
    ) and _ready(box)


def _counters(box: Sandbox) -> dict[str, dict[str, int]]:
    keys = ("suspected", "kernel_answered", "asked", "verdicts")
    return {node: {k: int(_watch(box, node).get(k, 0)) for k in keys} for node in NODES}


def _silent_events(box: Sandbox, node: str) -> list[dict[str, Any]]:
    with DaemonClient(daemon_paths(box, node), timeout_s=5) as client:
        return [e for e in client.job_events(JOB_ID) if e["kind"] == "node.silent"]


def _assert_no_loss(box: Sandbox, before: dict[str, dict[str, int]], what: str) -> dict[str, dict[str, int]]:
    until(f"every path heard again after {what}", lambda: _all_paths_heard(box), 30)
    after = _counters(box)
    judged = {n: after[n]["verdicts"] - before[n]["verdicts"] for n in NODES}
    assert not any(judged.values()), f"{what}: verdicts per observer {judged}; node watches: " + str(
        {n: _watch(box, n) for n in NODES}
    )
    for node in NODES:
        assert not _silent_events(box, node), f"{what}: node.silent reached job {JOB_ID} on {node}"
    return after


def test_a_stopped_node_is_not_lost(box: Sandbox) -> None:
    """Daemon and every process of node3 SIGSTOPped for 1 s: silent daemons, but a kernel that answers."""
    before = _counters(box)
    pids = processes.netns_pids([box.layout().node("node3").netns])
    assert pids, "nothing runs on node3"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    after = _assert_no_loss(box, before, f"SIGSTOP of node3's {len(pids)} processes for {STOP_S:g} s")
    for observer in ("node1", "node2"):
        probed = after[observer]["kernel_answered"] - before[observer]["kernel_answered"]
        assert probed >= 1, f"{observer} never probed node3's kernel: {before[observer]} -> {after[observer]}"


def test_a_single_dead_nic_is_not_a_lost_node(box: Sandbox) -> None:
    before = _counters(box)
    box.fault("link", "node2", "nic0", "down")
    try:
        until(
            "node1 to see node2's nic0 path dead",
            lambda: _paths(box, "node1")["node2"]["nic0"].startswith("dead"),
            10,
            0.02,
        )
    finally:
        box.fault("link", "node2", "nic0", "up")
    _assert_no_loss(box, before, "nic0 of node2 down")


def test_a_flapping_link_is_not_a_lost_node(box: Sandbox) -> None:
    before = _counters(box)
    try:
        for _ in range(3):
            box.fault("link", "node1", "nic0", "down")
            until(
                "node2 to see node1's nic0 dead",
                lambda: _paths(box, "node2")["node1"]["nic0"].startswith("dead"),
                10,
                0.02,
            )
            box.fault("link", "node1", "nic0", "up")
            until(
                "node2 to hear node1 on nic0 again",
                lambda: not _paths(box, "node2")["node1"]["nic0"].startswith("dead"),
                10,
                0.02,
            )
    finally:
        box.fault("link", "node1", "nic0", "up")
    _assert_no_loss(box, before, "nic0 of node1 flapping three times")


def test_a_partitioned_rail_is_not_a_lost_node(box: Sandbox) -> None:
    before = _counters(box)

    def rail0_dead_everywhere() -> bool:
        return all(rails["nic0"].startswith("dead") for node in NODES for rails in _paths(box, node).values())

    try:
        for node in NODES:
            box.fault("blackhole", node, "nic0", "on")
        until("every node to see every peer's rail-0 path dead", rail0_dead_everywhere, 10, 0.02)
    finally:
        for node in NODES:
            box.fault("blackhole", node, "nic0", "off")
    _assert_no_loss(box, before, "rail 0 partitioned (every port of its switch blackholed)")


def test_a_crashed_node_is_judged_dead_by_both_observers(box: Sandbox) -> None:
    """The positive control: the same daemons do judge a real crash, and tell the job."""
    with DaemonClient(daemon_paths(box, "node1"), timeout_s=5) as client:
        seq = client.node_verdicts(JOB_ID).seq
        box.crash_node("node3")  # the module's teardown (clear_faults) brings it back
        verdicts = client.node_verdicts(JOB_ID, seq, wait_s=10).verdicts  # the long poll an agent makes
    assert [v.node for v in verdicts] == ["node3"], verdicts
    assert verdicts[0].confirmed_by == ("node2",), verdicts[0]
    assert verdicts[0].silent_ms >= 100, verdicts[0]

    def judged_by_node2() -> list[dict[str, Any]]:
        return [v for v in _watch(box, "node2").get("in_force", []) if v["node"] == "node3"]

    found = until("node2 to judge node3 dead too", judged_by_node2, 10, 0.05)
    assert found[0]["confirmed_by"] == ["node1"], found
    for observer in ("node1", "node2"):
        events = until(
            f"node.silent in job {JOB_ID}'s log on {observer}", lambda o=observer: _silent_events(box, o), 10
        )
        assert events[0]["fields"]["node"] == "node3", events
