"""The audit's measurement primitives on real sockets (loopback): echo counts, probes, path MTU, transfers."""

from __future__ import annotations

import os

import pytest

from clockwork.audit import measure
from tests.conftest import in_ci


@pytest.fixture
def as_root() -> None:
    if os.geteuid() != 0:  # SO_BINDTODEVICE needs CAP_NET_RAW
        if in_ci():
            pytest.fail("the audit's socket tests need root (CI must run everything)")
        pytest.skip("needs root (skipped on a developer machine only)")


def _target(port: int, dst: str = "127.0.0.2") -> measure.Target:
    return measure.Target("a/lo", "b/lo", "lo", "127.0.0.1", dst, port)


def test_probe_counts_both_directions(as_root: None) -> None:
    echo = measure.EchoServer([("127.0.0.2", "lo")])
    try:
        port = echo.ports()["127.0.0.2"]
        [result] = measure.probe([_target(port)], run=7, count=50, interval_s=0.001)
        assert result["sent"] == 50 and result["replies"] == 50 and result["error"] is None
        assert 0 < result["rtt_p50_us"] <= result["rtt_p99_us"]
        assert echo.received(7) == [{"local": "127.0.0.2", "sender": "127.0.0.1", "received": 50}]
        assert echo.received(8) == []
    finally:
        echo.close()


def test_probe_to_a_closed_port_gets_no_replies(as_root: None) -> None:
    echo = measure.EchoServer([("127.0.0.2", "lo")])
    port = echo.ports()["127.0.0.2"]
    echo.close()
    [result] = measure.probe([_target(port)], run=1, count=5, interval_s=0.001)
    assert result["replies"] == 0 and result["rtt_p50_us"] is None


def test_echo_ignores_foreign_datagrams(as_root: None) -> None:
    import socket

    echo = measure.EchoServer([("127.0.0.2", "lo")])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.3)
            sock.sendto(b"not an audit probe", ("127.0.0.2", echo.ports()["127.0.0.2"]))
            with pytest.raises(TimeoutError):
                sock.recv(100)
        assert echo.received(0) == []
    finally:
        echo.close()


def test_mtu_check_passes_full_size_frames(as_root: None) -> None:
    echo = measure.EchoServer([("127.0.0.2", "lo")])
    try:
        [result] = measure.mtu_check([_target(echo.ports()["127.0.0.2"])], mtu=1500, tries=2, run=3)
        assert result["small_ok"] and result["full_ok"] and result["largest_ok"] == 1500
    finally:
        echo.close()


def test_mtu_check_reports_a_frame_larger_than_the_nic(as_root: None) -> None:
    echo = measure.EchoServer([("127.0.0.2", "lo")])
    try:
        lo_mtu = measure.nic_facts("lo")["mtu"]
        [result] = measure.mtu_check([_target(echo.ports()["127.0.0.2"])], mtu=lo_mtu + 100, tries=1, run=3)
        assert not result["full_ok"] and result["error"] == "EMSGSIZE"
    finally:
        echo.close()


def test_transfer_counts_what_the_receiver_got(as_root: None) -> None:
    sink = measure.Sink([("127.0.0.2", "lo")])
    try:
        result = measure.transfer(_target(sink.ports()["127.0.0.2"]), seconds=0.1)
        assert "error" not in result
        assert result["bytes"] > 0 and result["elapsed_s"] > 0 and result["gbps"] > 0
    finally:
        sink.close()


def test_transfer_to_nobody_is_an_error_not_a_crash(as_root: None) -> None:
    sink = measure.Sink([("127.0.0.2", "lo")])
    port = sink.ports()["127.0.0.2"]
    sink.close()
    result = measure.transfer(_target(port), seconds=0.1)
    assert "refused" in result["error"].lower()


def test_nic_facts() -> None:
    facts = measure.nic_facts("lo")
    assert facts["exists"] and facts["mtu"] > 0
    assert measure.nic_facts("no-such-nic0") == {"exists": False}
