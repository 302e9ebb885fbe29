"""Raw audit figures for a synthetic cluster, shaped exactly as the driver returns them.

The figures follow from the faults asked for the way the fabric would produce them: a lossy port drops
that share of what crosses it each way; a port with a small MTU drops full-size frames both ways; a slow
link caps every transfer through it; a dead NIC reports carrier off and nothing crosses it. Tests judge
these with :func:`clockwork.audit.verdict.judge` and check that the fault is named, and nothing else.
"""

from __future__ import annotations

from typing import Any


def make_raw(
    nodes: int = 4,
    nics: tuple[str, ...] = ("nic0", "nic1"),
    *,
    loss: dict[str, float] | None = None,
    small_mtu: dict[str, int] | None = None,
    slow: dict[str, float] | None = None,
    dead: tuple[str, ...] = (),
    delay_us: dict[str, float] | None = None,
    busy: tuple[str, ...] = (),
    drills: list[dict[str, Any]] | None = None,
    count: int = 300,
) -> dict[str, Any]:
    """``delay_us``: a link slow to cross adds that much to every frame through it (floor and median alike);
    ``busy``: nodes whose CPUs are loaded, so that the probes they receive wait in their scheduler now and
    then (median and tail up, floor unchanged). Both show in the nodes' Fleet Lens snapshots."""
    delay_us = delay_us or {}
    loss = loss or {}
    small_mtu = small_mtu or {}
    slow = slow or {}
    names = [f"node{i}" for i in range(1, nodes + 1)]
    ip = {f"{n}/{nic}": f"10.{r}.0.{i}" for r, nic in enumerate(nics) for i, n in enumerate(names, 1)}
    reports = {
        n: {
            "node": n,
            "node_addr": f"10.9.0.{i}",
            "nics": {
                nic: {
                    "ip": ip[f"{n}/{nic}"],
                    "exists": True,
                    "operstate": "down" if f"{n}/{nic}" in dead else "up",
                    "carrier": f"{n}/{nic}" not in dead,
                    "mtu": 1500,
                }
                for nic in nics
            },
            "kernel": {
                "wanted": {"net.ipv4.conf.all.rp_filter": "2", "net.ipv4.conf.all.arp_ignore": "1"},
                "actual": {"net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.all.arp_ignore": "1"},
            },
            "daemon": {"answered": True, "linkpass": {"enabled": True}, "lens": {"enabled": True}},
            "gpu": {"available": False, "reason": "NVML not available"},
            "echo_ports": {},
            "sink_ports": {},
        }
        for i, n in enumerate(names, 1)
    }
    lens_paths: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    probes, received, mtu, bandwidth = [], [], [], []
    for nic in nics:
        for a in names:
            for b in names:
                if a == b:
                    continue
                src, dst = f"{a}/{nic}", f"{b}/{nic}"
                if src in dead or dst in dead:
                    arrive, back = 0, 0
                else:
                    keep_fwd = (1 - loss.get(src, 0) / 100) * (1 - loss.get(dst, 0) / 100)
                    arrive = round(count * keep_fwd)
                    back = round(arrive * keep_fwd)
                probes.append(
                    {
                        "src": src,
                        "dst": dst,
                        "sent": count,
                        "attempted": count,
                        "replies": back,
                        "rtt_p50_us": 150.0 if back else None,
                        "rtt_p99_us": 400.0 if back else None,
                        "error": None,
                    }
                )
                if arrive:
                    received.append({"node": b, "local": ip[dst], "sender": ip[src], "received": arrive})
                    extra = delay_us.get(src, 0.0) + delay_us.get(dst, 0.0)
                    wait = 900.0 if b in busy else 0.0
                    lens_paths[b].append(
                        {
                            "src": src,
                            "dst": dst,
                            "owd_min_us": 12.0 + extra,
                            "owd_p50_us": 20.0 + extra + wait,
                            "owd_p99_us": 60.0 + extra + 3 * wait,
                        }
                    )
                limit = min(small_mtu.get(src, 1500), small_mtu.get(dst, 1500))
                alive = src not in dead and dst not in dead
                mtu.append(
                    {
                        "src": src,
                        "dst": dst,
                        "mtu": 1500,
                        "small_ok": alive,
                        "full_ok": alive and limit >= 1500,
                        "largest_ok": (1500 if limit >= 1500 else limit) if alive else None,
                        "error": None,
                    }
                )
                if not alive:
                    bandwidth.append({"src": src, "dst": dst, "skipped": "unreachable"})
                elif limit < 1500:
                    bandwidth.append({"src": src, "dst": dst, "skipped": "the path drops full-size frames"})
                else:
                    gbps = min(9.0 + (hash((src, dst)) % 7) / 2, slow.get(src, 99.0), slow.get(dst, 99.0))
                    bandwidth.append(
                        {"src": src, "dst": dst, "seconds": 0.5, "bytes": 1, "elapsed_s": 0.5, "gbps": gbps}
                    )
    for n in names:
        reports[n]["daemon"]["lens_snapshot"] = {"node": n, "enabled": True, "time": 1.0, "paths": lens_paths[n]}
    return {
        "started_at": 1_700_000_000.0,
        "ended_at": 1_700_000_030.0,
        "nodes": names,
        "node_reports": reports,
        "probes": probes,
        "echo_received": received,
        "mtu": mtu,
        "bandwidth": bandwidth,
        "drills": drills or [],
        "drill_requested": drills is not None,
        "timings": {"start_s": 1.0},
        "srun_output": "",
    }
