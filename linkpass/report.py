"""What ``clockwork node status`` shows of LinkPass: NICs, routes, paths, the NICs and HCAs new communicators avoid,
heartbeat counters (forged ones refused among them), heartbeat peers and the heartbeat thread; and which NICs and
HCAs those are (:func:`avoid_nics`, :func:`avoid_hcas`).

Apart from the engine to keep it to its decisions; read under the engine's lock (:meth:`LinkPass.status`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from linkpass import sysctls
from linkpass.fabric import FabricNode
from linkpass.hbio import HeartbeatThread
from linkpass.settings import LinkPassConfig

__all__ = ["Reported", "avoid_hcas", "avoid_nics", "avoid_reasons", "status"]


class Reported(Protocol):
    """What the report reads of the engine (:class:`linkpass.engine.LinkPass`, which imports this module)."""

    cfg: LinkPassConfig
    me: FabricNode
    note: str
    rails: list[str]
    nic_up: dict[str, bool]
    nic_down_reason: dict[str, str]
    current: dict[str, tuple[str, ...]]
    paths: dict[str, Any]
    gray: dict[tuple[str, str], str]
    counters: dict[str, int]
    path_peers: frozenset[str]
    watch_peers: frozenset[str]
    rcvbuf: dict[str, int]
    io: HeartbeatThread | None
    sysctl_problems: dict[str, str]
    hca_of: Callable[[str], str | None]
    heard_from: set[str]

    @property
    def packet_bytes(self) -> int: ...

    def eligible(self, path: Any, now: float) -> bool: ...
    def avoid_nics(self) -> list[str]: ...
    def avoid_hcas(self) -> dict[str, str]: ...


def avoid_nics(engine: Reported) -> list[str]:
    """Local NICs a new communicator should not use (NCCL: NCCL_IB_HCA=^...): down, or no live path."""
    out = []
    for rail in engine.rails:
        paths = [p[rail] for name, p in engine.paths.items() if rail in p and name in engine.heard_from]
        if not engine.nic_up.get(rail, False) or (paths and not any(p.alive for p in paths)):
            out.append(rail)
    return out


def avoid_reasons(engine: Reported) -> dict[str, str]:
    """:func:`avoid_nics`, each with why: down (carrier, admin), or every managed path dead (heartbeats, a Lens
    suspect marking the path gray, a peer's down notice)."""
    out = {}
    for rail in avoid_nics(engine):
        if not engine.nic_up.get(rail, False):
            out[rail] = engine.nic_down_reason.get(rail) or f"{rail} down"
            continue
        reasons = sorted({p[rail].reason for p in engine.paths.values() if rail in p and p[rail].reason})
        out[rail] = f"no live path on {rail}" + (f" ({'; '.join(reasons)})" if reasons else "")
    return out


def avoid_hcas(engine: Reported) -> dict[str, str]:
    """HCA -> why, for the :func:`avoid_nics` that have an RDMA device behind them (``mlx5_3`` for ``ib3``)."""
    out = {}
    for rail, reason in avoid_reasons(engine).items():
        hca = engine.hca_of(rail)
        if hca is not None:
            out[hca] = f"{rail}: {reason}"
    return out


def status(engine: Reported, now: float) -> dict[str, Any]:
    """The engine's state for the node's status (``now``: the engine's clock)."""
    return {
        "enabled": True,
        "node": engine.me.name,
        "note": engine.note,
        "nics": {
            r: {"up": engine.nic_up.get(r, False), "reason": engine.nic_down_reason.get(r, "")} for r in engine.rails
        },
        "routes": {peer: list(rails) for peer, rails in sorted(engine.current.items())},
        "paths": {
            peer: {
                r: "alive" if engine.eligible(p, now) else ("holddown" if p.alive else f"dead: {p.reason}")
                for r, p in sorted(paths.items())
            }
            for peer, paths in sorted(engine.paths.items())
        },
        "avoid_nics": engine.avoid_nics(),
        "avoid_hcas": engine.avoid_hcas(),
        "hcas": {r: engine.hca_of(r) or "" for r in engine.rails},
        "gray": {f"{peer}/{rail}": reason for (peer, rail), reason in sorted(engine.gray.items())},
        "failovers": engine.counters["failovers"],
        "failbacks": engine.counters["failbacks"],
        "heartbeats": {
            k: engine.counters[k]
            for k in ("sent", "received", "rejected", "refused", "send_errors", "receive_errors", "notices_sent")
        },
        "heartbeat_peers": {
            "path": sorted(engine.path_peers),
            "watch": sorted(engine.watch_peers - engine.path_peers),
            "packet_bytes": engine.packet_bytes,
            "rcvbuf_bytes": dict(engine.rcvbuf),
        },
        "heartbeat_thread": _thread(engine, now),
        "sysctls": sysctls.read(list(sysctls.parse(engine.cfg.sysctls))),
        "sysctl_problems": engine.sysctl_problems,
    }


def _thread(engine: Reported, now: float) -> dict[str, Any]:
    """Whether the heartbeat thread runs and when it last went round (a stuck one stops going round)."""
    if engine.io is None:
        return {"running": False}
    return {
        "running": engine.io.alive(),
        "last_round_ms": round(1000 * (now - engine.io.last_round), 1),
        "errors": engine.io.errors,
    }
