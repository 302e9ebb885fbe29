"""Programming the routes the engine decided on, and the events that say what moved and why.

Apart from the engine (:class:`linkpass.engine.LinkPass`, which decides under its lock and calls :func:`apply`
outside it, so the heartbeat thread never waits on netlink): one event per kind of move, not one per peer, and
the neighbour entries of the rails traffic left flushed only once no route goes through them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

from linkpass.fabric import FabricNode
from linkpass.routes import Kernel

__all__ = ["Mover", "Plan", "apply"]

log = logging.getLogger("clockwork.linkpass")

#: (peer, the rails it should use, event kind, reason), one per peer whose route changes.
Plan = list[tuple[str, tuple[str, ...], str, str]]


class Mover(Protocol):
    """What moving routes reads and updates of the engine."""

    kernel: Kernel | None
    me: FabricNode
    peers: dict[str, FabricNode]
    current: dict[str, tuple[str, ...]]
    ifindex: dict[str, int]
    flush_pending: set[str]
    counters: dict[str, int]
    emit: Callable[[str, dict[str, Any]], None]
    clock: Callable[[], float]

    def avoid_nics(self) -> list[str]: ...
    def avoid_hcas(self) -> dict[str, str]: ...


def apply(engine: Mover, plan: Plan) -> None:
    """Move each planned peer's route, then drop the neighbour entries the moved traffic left, then say so."""
    assert engine.kernel is not None
    # (kind, old rails, new rails, reason) -> [(peer, route_ms)]: one event per kind of move, not per peer
    moves: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], list[tuple[str, float]]] = defaultdict(list)
    for peer, want, kind, reason in plan:
        old = engine.current[peer]
        t0 = engine.clock()
        try:
            _program(engine, peer, want)
        except Exception as exc:
            log.error("%s: cannot route %s via %s: %s", engine.me.name, peer, ",".join(want), exc)
            continue
        moves[(kind, old, want, reason)].append((peer, (engine.clock() - t0) * 1000))
        engine.current[peer] = want
    if moves:
        engine.kernel.flush_route_cache()
    # Only now, with no route left through them, drop the neighbour entries the moved traffic used
    # on the rails it left: a segment queued on such an entry (waiting for an ARP answer that
    # cannot come) is held for seconds and TCP will not retransmit it while it is held. Flushing
    # before the routes moved would only create fresh entries for the packets still sent there.
    for (kind, old, _new, _reason), done in moves.items():
        if kind != "link.failover":
            continue  # a fail-back leaves a healthy rail: its entries are fine
        for rail in old:
            for peer, _ms in done:
                engine.kernel.delete_neighbour(engine.ifindex[rail], engine.peers[peer].nics[rail])
    for rail in sorted(engine.flush_pending):
        dropped = engine.kernel.flush_neighbours(engine.ifindex[rail])
        log.info("%s: flushed %d neighbour entries of %s", engine.me.name, dropped, rail)
    engine.flush_pending.clear()
    for (kind, old, new, reason), done in moves.items():
        engine.counters["failovers" if kind == "link.failover" else "failbacks"] += 1
        peers = sorted(peer for peer, _ in done)
        fields = {
            "nic": ",".join(old),
            "via": ",".join(new),
            "peers": peers,
            "reason": reason,
            "route_ms": round(max(ms for _, ms in done), 3),
            "avoid_nics": engine.avoid_nics(),
            "avoid_hcas": engine.avoid_hcas(),
        }
        log.warning(
            "%s: %s %s -> %s for %s (%s)",
            engine.me.name,
            kind,
            fields["nic"],
            fields["via"],
            ",".join(peers),
            reason,
        )
        engine.emit(kind, fields)


def _program(engine: Mover, peer: str, rails: tuple[str, ...]) -> None:
    assert engine.kernel is not None
    target = engine.peers[peer]
    hops = [(target.nics[r], engine.ifindex[r]) for r in rails]
    engine.kernel.set_route(target.addr, engine.me.addr, hops)
