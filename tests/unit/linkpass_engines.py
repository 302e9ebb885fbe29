"""Real LinkPass engines of a few nodes on loopback addresses (one rail each, named ``lo``), started for a test and
closed after it: what test_linkpass_loopback and test_daemon_watchdog run their heartbeat threads on."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from linkpass.engine import LinkPass
from linkpass.fabric import FabricMap
from linkpass.settings import LinkPassConfig


def free_udp_port(addr: str) -> int:
    """A UDP port free on ``addr`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


@contextmanager
def loopback_engines(ips: Mapping[str, str], key: bytes) -> Iterator[dict[str, LinkPass]]:
    """One started engine per node of ``ips`` (name -> loopback address), all under ``key``; closed on exit."""
    fab = FabricMap.parse({"nodes": {n: {"addr": ip, "nics": {"lo": ip}} for n, ip in ips.items()}})
    cfg = LinkPassConfig(heartbeat_port=free_udp_port(next(iter(ips.values()))), apply_sysctls=False)
    out = {n: LinkPass(cfg, n, fab, key, lambda kind, fields: None) for n in ips}
    try:
        for engine in out.values():
            engine.start()
        yield out
    finally:
        for engine in out.values():
            engine.close()
