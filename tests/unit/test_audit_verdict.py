"""The audit's judgement: each fault is named on the right link, in the right direction, and nothing else is."""

from __future__ import annotations

from typing import Any

import pytest

from clockwork.audit.verdict import judge
from clockwork.contracts.config.audit import AuditConfig
from tests.unit.audit_raw import make_raw

CFG = AuditConfig()


def _named(report: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((f["target"], f["check"]) for f in report["findings"])


def test_healthy_fabric_passes_everything() -> None:
    report = judge(make_raw(), CFG)
    assert report["findings"] == []
    assert report["ok"] is True
    assert all(v["ok"] for v in report["nodes"].values())
    assert report["checks"]["loss"] == "pass" and report["checks"]["drill"] == "not run"
    assert report["matrices"]["gbps"]["nic0"]["node1"]["node2"] > 8


def test_lossy_port_is_named_in_both_directions_and_its_neighbours_are_cleared() -> None:
    report = judge(make_raw(loss={"node2/nic0": 5.0}), CFG)
    assert _named(report) == [("node2/nic0", "loss")]
    finding = report["findings"][0]
    assert set(finding["evidence"]["directions"]) == {"uplink", "downlink"}
    assert all(4.0 < v < 6.0 for v in finding["evidence"]["directions"].values())
    assert [n for n, v in report["nodes"].items() if not v["ok"]] == ["node2"]
    assert report["links"]["node2/nic0"]["ok"] is False and report["links"]["node2/nic1"]["ok"] is True


def test_a_link_slow_to_cross_is_named_for_delay_and_nothing_else() -> None:
    report = judge(make_raw(delay_us={"node2/nic1": 1000.0}), CFG)
    assert _named(report) == [("node2/nic1", "delay")]
    assert "at least 1012 µs one-way" in report["findings"][0]["summary"]
    assert report["matrices"]["owd_us"]["nic1"]["node1"]["node2"] == 1020.0  # the matrix shows medians


def test_a_busy_receiver_does_not_make_its_healthy_links_slow() -> None:
    """Load delays some probes in the receiver's scheduler (median and tail up), never the fastest one."""
    report = judge(make_raw(busy=("node4",)), CFG)
    assert report["findings"] == [] and report["ok"] is True
    assert report["matrices"]["owd_us"]["nic1"]["node1"]["node4"] == 920.0  # it was seen, and judged healthy


def test_small_mtu_port_is_named_with_the_size_that_still_passes() -> None:
    report = judge(make_raw(small_mtu={"node3/nic1": 1000}), CFG)
    assert _named(report) == [("node3/nic1", "mtu")]
    assert "frames above 1000 bytes are dropped" in report["findings"][0]["summary"]
    assert "node3 nic1" in report["findings"][0]["summary"]


def test_dead_nic_is_named_once_without_collateral() -> None:
    report = judge(make_raw(dead=("node4/nic1",)), CFG)
    assert _named(report) == [("node4/nic1", "nic")]
    assert "link down" in report["findings"][0]["summary"]


def test_blackholed_port_with_carrier_is_named_as_passing_nothing() -> None:
    raw = make_raw(loss={"node1/nic0": 100.0})
    report = judge(raw, CFG)
    assert _named(report) == [("node1/nic0", "nic")]
    assert "carrier is up but no probe crosses it" in report["findings"][0]["summary"]


def test_rate_limited_link_is_named_against_the_rail() -> None:
    report = judge(make_raw(slow={"node1/nic1": 0.2}), CFG)
    assert _named(report) == [("node1/nic1", "bandwidth")]
    assert "0.20 Gbit/s" in report["findings"][0]["summary"]


def _fail_transfer(raw: dict[str, Any], src: str, dst: str, error: str = "timed out") -> None:
    (t,) = [t for t in raw["bandwidth"] if (t["src"], t["dst"]) == (src, dst)]
    for key in ("bytes", "elapsed_s", "gbps"):
        t.pop(key)
    t["error"] = error


@pytest.mark.parametrize("slow", [True, False])
def test_a_transfer_that_times_out_on_a_lossy_port_is_blamed_on_that_port_not_on_its_sender(slow: bool) -> None:
    """TCP through a port losing 5 % stalls now and then; the sender's link is healthy on its other paths."""
    raw = make_raw(loss={"node2/nic0": 5.0}, slow={"node2/nic0": 2.0} if slow else None)
    _fail_transfer(raw, "node3/nic0", "node2/nic0")
    report = judge(raw, CFG)
    assert {target for target, _ in _named(report)} == {"node2/nic0"}
    assert [n for n, v in report["nodes"].items() if not v["ok"]] == ["node2"]
    evidence = [f["evidence"].get("failed_transfers") for f in report["findings"]]
    assert ["node3/nic0 -> node2/nic0: timed out"] in evidence
    assert report["matrices"]["gbps"]["nic0"]["node3"]["node2"] == 0.0


def test_a_failed_transfer_no_bad_link_explains_is_a_finding_of_its_own() -> None:
    raw = make_raw()
    _fail_transfer(raw, "node1/nic1", "node4/nic1", "Connection refused")
    report = judge(raw, CFG)
    assert _named(report) == [("node1/nic1", "bandwidth")]
    assert report["findings"][0]["summary"] == "transfer node1/nic1 -> node4/nic1 failed: Connection refused"


def test_absolute_bandwidth_floor() -> None:
    cfg = AuditConfig(min_bandwidth_gbps=50.0)
    report = judge(make_raw(), cfg)
    assert {c for _, c in _named(report)} == {"bandwidth"}
    assert len(report["findings"]) == 8  # every link of both rails


def test_two_node_rail_names_both_ends_as_ambiguous() -> None:
    report = judge(make_raw(nodes=2, nics=("nic0",), loss={"node1/nic0": 5.0}), CFG)
    assert _named(report) == [("node1/nic0", "loss"), ("node2/nic0", "loss")]
    assert all(f["evidence"]["ambiguous"] for f in report["findings"])


def test_node_level_checks() -> None:
    raw = make_raw()
    raw["node_reports"]["node1"]["kernel"]["actual"]["net.ipv4.conf.all.rp_filter"] = "1"
    raw["node_reports"]["node2"]["daemon"] = {"answered": False, "error": "no clockworkd on node2"}
    raw["node_reports"]["node3"]["daemon"]["lens"] = {"enabled": False, "state": "disabled by configuration"}
    raw["node_reports"]["node4"]["kernel"]["actual"]["net.ipv4.conf.all.arp_ignore"] = "0"
    report = judge(raw, CFG)
    summaries = {f["target"]: f["summary"] for f in report["findings"]}
    assert "rp_filter=1" in summaries["node1"]
    assert "clockworkd does not answer" in summaries["node2"]
    assert "Fleet Lens is not running" in summaries["node3"]
    assert "arp_ignore is 0, LinkPass needs 1" in summaries["node4"]


def test_missing_worker_fails_its_node() -> None:
    raw = make_raw()
    del raw["node_reports"]["node3"]
    raw["srun_output"] = "srun: error: node3: Communication connection failure"
    report = judge(raw, CFG)
    assert ("node3", "worker") in _named(report)
    assert report["nodes"]["node3"]["ok"] is False


@pytest.mark.parametrize(
    ("drill", "failed"),
    [
        ({"failover_ms": 12.0, "homed_here": True, "failback_ms": 30.0, "reachable_after": True}, False),
        ({"failover_ms": 12.0, "homed_here": True, "failback_ms": None, "linkpass_path": "holddown"}, False),
        ({"failover_ms": 12.0, "homed_here": True, "failback_ms": None, "linkpass_path": "alive"}, True),
        ({"failover_ms": 12.0, "homed_here": True, "failback_ms": None, "linkpass_path": "dead: nic0 down"}, True),
        ({"failover_ms": None}, True),
        ({"failover_ms": 4000.0}, True),
        ({"skipped": "this NIC is down already"}, False),
        ({"error": "the peer did not answer"}, True),
    ],
)
def test_drills(drill: dict[str, Any], failed: bool) -> None:
    raw = make_raw(drills=[{"node": "node2", "nic": "nic0", "peer": "node1", **drill}])
    report = judge(raw, CFG)
    assert (("node2/nic0", "drill") in _named(report)) is failed
    assert report["checks"]["drill"] == ("fail" if failed else "pass")


def test_a_drill_whose_traffic_never_came_home_names_linkpass_state() -> None:
    drill = {"failover_ms": 12.0, "homed_here": True, "failback_ms": None, "linkpass_path": "dead: nic0 down"}
    report = judge(make_raw(drills=[{"node": "node2", "nic": "nic0", "peer": "node1", **drill}]), CFG)
    summaries = [f["summary"] for f in report["findings"] if f["check"] == "drill"]
    assert summaries == ["traffic did not move back to nic0 (LinkPass's path: dead: nic0 down)"]


def test_gpu_checks() -> None:
    raw = make_raw()
    raw["node_reports"]["node1"]["gpu"] = {
        "available": True,
        "gpus": [
            {"index": 0, "temperature_c": 60, "slowdown_c": 90, "ecc_uncorrected": 0},
            {"index": 1, "temperature_c": 93, "slowdown_c": 90, "ecc_uncorrected": 0},
            {"index": 2, "temperature_c": 50, "slowdown_c": 90, "ecc_uncorrected": 3},
        ],
    }
    report = judge(raw, CFG)
    assert _named(report) == [("node1/gpu1", "gpu"), ("node1/gpu2", "gpu")]


def test_linkpass_not_running_is_a_drill_finding_per_node_saying_how_to_start_it() -> None:
    raw = make_raw()
    raw["drill_requested"] = True
    raw["linkpass_down"] = {"node2": "clockworkd does not answer on node2 (no socket)"}
    raw["drills"] = [{"node": "node2", "nic": "nic0", "skipped": "LinkPass is not running on node2"}]
    report = judge(raw, CFG)
    assert _named(report) == [("node2", "drill")]
    assert report["checks"]["drill"] == "fail" and report["ok"] is False
    summary = report["findings"][0]["summary"]
    assert "LinkPass is not running" in summary and "no socket" in summary and "setsid clockworkd" in summary
