"""A LinkPass drill on one NIC: take it down, time until traffic flows again, bring it back, time the fail-back.

This is the one intrusive audit step, and why the audit runs on nodes it holds (no training job there): it
does to a NIC what a driver reset does, and checks that the node daemon's LinkPass moves the node's traffic
to its other NICs in time and moves it home once the NIC is back. The NIC is brought back up whatever happens.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from clockwork.audit.measure import _HEADER, _MAGIC

log = logging.getLogger("clockwork.audit")
HOLDDOWN_WAIT_MAX_S = 30.0  # LinkPass's default hold-down cap (linkpass.settings: holddown_max_s)
ROUTE_GRACE_S = 2.0  # LinkPass moves the route at its next evaluation, which a busy daemon can delay


def route_device(dst: str, src: str) -> str | None:
    """The device the kernel would send ``src`` -> ``dst`` traffic through now (None: no route)."""
    proc = subprocess.run(
        ["ip", "-j", "route", "get", dst, "from", src], capture_output=True, text=True, timeout=5, check=False
    )
    if proc.returncode != 0:
        return None
    try:
        routes = json.loads(proc.stdout)
    except ValueError:
        return None
    return routes[0].get("dev") if routes else None


def _set_link(nic: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", nic, state], check=True, capture_output=True, timeout=10)


def _first_reply(src: str, dst: str, port: int, run: int, timeout_s: float, every_s: float = 0.002) -> float | None:
    """Probe ``dst`` from ``src`` (routed, no device binding) until one probe is echoed; seconds it took."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((src, 0))
    sock.setblocking(False)
    start = time.monotonic()
    seq = 0
    try:
        while time.monotonic() - start < timeout_s:
            try:
                sock.sendto(_HEADER.pack(_MAGIC, run, seq, time.monotonic_ns()), (dst, port))
            except OSError:
                pass  # no route yet: LinkPass has not moved the traffic
            seq += 1
            ready, _, _ = select.select([sock], [], [], every_s)
            if ready:
                try:
                    data = sock.recv(2048)
                except OSError:
                    continue
                if data[:4] == _MAGIC and _HEADER.unpack_from(data)[1] == run:
                    return time.monotonic() - start
        return None
    finally:
        sock.close()


def _failback(
    dst: str, node_ip: str, nic: str, timeout_s: float, path_state: Callable[[], str | None]
) -> tuple[float | None, str | None]:
    """Seconds until traffic to ``dst`` is routed through ``nic`` again (None: it was not), and LinkPass's
    state of that path when the wait ended.

    Past ``timeout_s`` the wait goes on, up to ``HOLDDOWN_WAIT_MAX_S`` more, while LinkPass has not yet called
    the path alive: it holds the path down (flap damping: the drills themselves flap each path, and its
    hold-down doubles each time), or has not yet heard the peer on it again, or its state cannot be read (a
    busy daemon). Once LinkPass calls the path alive, the route must move within ``ROUTE_GRACE_S`` (at its
    next evaluation). A path still dead at the end is reported as such by the verdict."""
    start = time.monotonic()
    alive_at: float | None = None
    while True:
        now = time.monotonic()
        if route_device(dst, node_ip) == nic:
            return now - start, None
        if now - start >= timeout_s:
            state = path_state()
            if state == "alive":
                alive_at = now if alive_at is None else alive_at
                if now - alive_at >= ROUTE_GRACE_S:
                    return None, state
            elif now - start >= timeout_s + HOLDDOWN_WAIT_MAX_S:
                return None, state
        time.sleep(0.02)


def run_drill(
    nic: str,
    node_ip: str,
    peers: list[tuple[str, str, int]],
    run: int,
    timeout_s: float,
    linkpass_paths: Callable[[], dict[str, dict[str, str]]],
) -> dict[str, Any]:
    """Drill ``nic``: traffic from ``node_ip`` to a peer must survive the NIC going down.

    The peer is the first of ``peers`` (name, node address, echo port) whose traffic is homed on ``nic``:
    routed through it while LinkPass calls every path to that peer alive (``linkpass_paths()``: peer ->
    rail -> alive, holddown or dead), so the route is its home and the drill moves real traffic that must come
    back. Where there is none, the first peer: the drill then shows the node stays reachable. A fail-back
    LinkPass is still holding down is flap damping at work (each drill is a flap), not a fault.
    """

    paths = linkpass_paths()  # read once: the driver starts each drill on a settled fabric

    def steady(peer: tuple[str, str, int]) -> bool:
        states = paths.get(peer[0], {})
        return bool(states) and all(v == "alive" for v in states.values())

    def homed(peer: tuple[str, str, int]) -> bool:
        return steady(peer) and route_device(peer[1], node_ip) == nic

    chosen = next((p for p in peers if homed(p)), None) or next((p for p in peers if steady(p)), peers[0])
    name, dst, port = chosen
    result: dict[str, Any] = {"nic": nic, "peer": name}
    if _first_reply(node_ip, dst, port, run, 2.0) is None:
        result["error"] = f"the peer {dst} did not answer before the drill (nothing to measure)"
        return result
    home = route_device(dst, node_ip)
    result["homed_here"] = home == nic and steady(chosen)
    try:
        _set_link(nic, "down")
        moved = _first_reply(node_ip, dst, port, run, timeout_s)
        result["failover_ms"] = None if moved is None else moved * 1000
        result["moved_to"] = route_device(dst, node_ip)
    finally:
        _set_link(nic, "up")
    if home == nic:
        back, state = _failback(dst, node_ip, nic, timeout_s, lambda: linkpass_paths().get(name, {}).get(nic))
        result["failback_ms"] = None if back is None else back * 1000
        if back is None:
            result["linkpass_path"] = state
    # Whatever the routes did, the peer must be reachable once the NIC is up again.
    result["reachable_after"] = _first_reply(node_ip, dst, port, run, 2.0) is not None
    return result
