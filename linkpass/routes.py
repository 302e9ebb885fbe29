"""Programming the kernel: routes to peers' node addresses, neighbour flushes, link state, via netlink.

One pyroute2 socket for requests (a route replace takes about a millisecond) and one bound to link
events (carrier and admin state changes arrive as they happen: no polling loop).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute

log = logging.getLogger("clockwork.linkpass")

ROUTE_FLUSH = Path("/proc/sys/net/ipv4/route/flush")
NETLINK_ROUTE = 0
RTMGRP_LINK = 0x1
IFF_UP = 0x1
IFF_LOWER_UP = 0x10000


@dataclass(frozen=True)
class LinkState:
    name: str
    index: int
    admin_up: bool
    carrier: bool

    @property
    def usable(self) -> bool:
        return self.admin_up and self.carrier


def link_state(msg: object) -> LinkState | None:
    """A LinkState from an RTM_NEWLINK message (or a get_links() entry)."""
    get_attr = getattr(msg, "get_attr", None)
    if get_attr is None:
        return None
    name = get_attr("IFLA_IFNAME")
    if not name:
        return None
    flags = int(msg["flags"])  # type: ignore[index]
    return LinkState(name, int(msg["index"]), bool(flags & IFF_UP), bool(flags & IFF_LOWER_UP))  # type: ignore[index]


class Kernel:
    """The netlink side of LinkPass in the daemon's network namespace.

    Link events arrive on a plain netlink socket subscribed to RTMGRP_LINK: it only wakes the loop
    (level-triggered, nothing buffered out of sight); the authoritative state is then read with a
    request, so a burst of events (admin up, then carrier up) can never leave a stale picture.
    """

    def __init__(self) -> None:
        self.ipr = IPRoute()
        self.events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self.events.bind((0, RTMGRP_LINK))
        self.events.setblocking(False)

    def fileno(self) -> int:
        return self.events.fileno()

    def link_events(self) -> list[LinkState]:
        """Drain the pending notifications; the current state of every link."""
        while True:
            try:
                self.events.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # ENOBUFS: notifications were lost; the state read below covers them
                log.debug("netlink: %s", exc)
                break
        return list(self.links().values())

    def links(self) -> dict[str, LinkState]:
        out = {}
        for msg in self.ipr.get_links():
            state = link_state(msg)
            if state is not None:
                out[state.name] = state
        return out

    def route_oif(self, dst: str) -> int | None:
        """The interface the kernel uses today for ``dst`` (None if unroutable)."""
        try:
            routes = self.ipr.route("get", dst=dst)
        except Exception:
            return None
        return routes[0].get_attr("RTA_OIF") if routes else None

    def set_route(self, dst: str, src: str, hops: list[tuple[str, int]]) -> None:
        """Route ``dst``/32 via the (gateway, ifindex) hops, source ``src``; several hops = ECMP."""
        if len(hops) == 1:
            gateway, oif = hops[0]
            self.ipr.route("replace", dst=f"{dst}/32", gateway=gateway, oif=oif, prefsrc=src)
        else:
            self.ipr.route(
                "replace",
                dst=f"{dst}/32",
                prefsrc=src,
                multipath=[{"gateway": gw, "oif": oif, "hops": 0} for gw, oif in hops],
            )

    def flush_route_cache(self) -> None:
        """Make every socket look its route up again (bumps the namespace's IPv4 route generation).

        An established TCP socket caches its route. A replaced route does not always invalidate that
        cache (a NIC that lost carrier keeps its routes, flagged linkdown), and the kernel itself only
        re-routes a socket after about 1.4 s of failed retransmissions: a 2 s stall. Flushing after
        every move makes the next (re)transmission take the new route.
        """
        try:
            ROUTE_FLUSH.write_text("1")
        except OSError as exc:
            log.warning("cannot flush the route cache: %s", exc)

    def delete_neighbour(self, ifindex: int, ip: str) -> None:
        """Drop one neighbour entry (and the packets queued on it); absent is fine."""
        try:
            self.ipr.neigh("del", dst=ip, ifindex=ifindex)
        except Exception:
            pass

    def flush_neighbours(self, ifindex: int) -> int:
        """Drop the neighbour entries of a dead NIC (packets queued on its ARP entries would wait seconds)."""
        dropped = 0
        for entry in self.ipr.neigh("dump", ifindex=ifindex):
            dst = entry.get_attr("NDA_DST")
            if dst is None or ":" in dst:
                continue
            try:
                self.ipr.neigh("del", dst=dst, ifindex=ifindex)
                dropped += 1
            except Exception:  # raced with the kernel's own expiry
                continue
        return dropped

    def close(self) -> None:
        self.events.close()
        self.ipr.close()
