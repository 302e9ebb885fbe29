"""Three real LinkPass engines over loopback (127.0.0.31-33, each with one rail named ``lo``): their heartbeat
threads send and read real UDP (SO_BINDTODEVICE, root only) while the test's own thread, standing for the daemon's
loop, does nothing at all; then one engine stops and only its silence shows.

One rail each: with nothing to fail over to, the engines never program a route (the decisions run, the kernel's
routes stay as they are).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from linkpass.engine import LinkPass
from tests.conftest import unavailable, until
from tests.unit.linkpass_engines import loopback_engines

KEY = b"k" * 32
IPS = {"n1": "127.0.0.31", "n2": "127.0.0.32", "n3": "127.0.0.33"}


@pytest.fixture
def engines() -> Iterator[dict[str, LinkPass]]:
    if os.geteuid() != 0:
        unavailable("LinkPass binds its heartbeat sockets to a device (SO_BINDTODEVICE), which needs root")
    with loopback_engines(IPS, KEY) as out:
        yield out


def test_heartbeats_flow_on_their_own_thread_and_a_stopped_engine_falls_silent(engines: dict[str, LinkPass]) -> None:
    n1 = engines["n1"]

    def everyone_heard() -> bool:
        return all(len(e.last_heard()) == 2 for e in engines.values())

    until("every engine to hear the other two", everyone_heard, timeout_s=30, interval_s=0.05)
    # Nobody calls tick() (the daemon's loop is "hung"): the threads go on sending and stamping.
    first = n1.last_heard()
    until("n1 to keep hearing both peers", lambda: all(n1.last_heard()[p] > first[p] for p in first), timeout_s=30)
    with n1.lock:
        both_ways = all(path.last_out_ok > 0 for paths in n1.paths.values() for path in paths.values())
    assert both_ways, "n2 and n3 say they hear n1 (their heartbeats list n1 with its rails)"
    status = n1.status()
    assert status["heartbeat_thread"]["running"] and status["heartbeats"]["rejected"] == 0
    assert (
        status["heartbeat_peers"]["path"] == ["n2", "n3"]
        and status["heartbeat_peers"]["packet_bytes"] == 22 + 2 * 4 + 16
    )  # header, 2 path peers, tag
    n1.tick()  # a decision on this evidence: everything alive, nothing to move
    assert n1.status()["routes"] == {"n2": ["lo"], "n3": ["lo"]} and n1.counters["failovers"] == 0

    engines["n3"].close()  # its thread has stopped when this returns: nothing more is sent
    closed = time.monotonic()  # the engines' clock
    # Over loopback a datagram is in n1's socket when sendto returns: one read round of n1 begun after the close
    # (a packet of n2 stamped later) has read whatever n3 sent.
    until("n1 to read a round after n3 stopped", lambda: n1.last_heard()["n2"] > closed, timeout_s=30, interval_s=0.02)
    stopped = n1.last_heard()["n3"]
    later = n1.last_heard()["n2"]
    until("n1 to hear n2 for 100 ms more", lambda: n1.last_heard()["n2"] > later + 0.1, timeout_s=30, interval_s=0.02)
    assert n1.last_heard()["n3"] == stopped, "nothing arrives from the stopped engine"
