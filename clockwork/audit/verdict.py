"""From the audit's raw figures to pass/fail per node and per link, each failure named with its evidence.

Localization works per *link direction*: a probe or transfer from A's NIC to B's crosses A's uplink (NIC to
switch port) and B's downlink (switch port to NIC). A direction is judged by the median over all the paths
that cross it, so one bad port shows in every path through it while each healthy port sees it in only one
of its paths: the median names the bad port and clears its neighbours (with three or more nodes on the
rail; with two, the pair is named). Loss is split into its two directions by the echo server's counts.

Pure functions of the raw figures (and the thresholds): a report can be re-judged from its JSON.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any

from clockwork.contracts import lens_view
from clockwork.contracts.config.audit import AuditConfig

UP, DOWN = "uplink", "downlink"
CHECKS = (
    "worker",
    "daemon",
    "kernel",
    "nic",
    "reachability",
    "loss",
    "mtu",
    "bandwidth",
    "delay",
    "clock",
    "drill",
    "gpu",
)


def _node_of(nic_id: str) -> str:
    return nic_id.split("/", 1)[0]


def _nic_of(nic_id: str) -> str:
    return nic_id.split("/", 1)[1]


class _Findings:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, check: str, target: str, summary: str, **evidence: Any) -> None:
        node, _, nic = target.partition("/")
        self.items.append(
            {
                "check": check,
                "target": target,
                "node": node,
                "nic": nic or None,
                "summary": summary,
                "evidence": evidence,
            }
        )


def _medians(per_direction: dict[tuple[str, str], list[float]]) -> dict[tuple[str, str], float]:
    return {k: median(v) for k, v in per_direction.items() if v}


def _rails(raw: dict[str, Any]) -> dict[str, list[str]]:
    rails: dict[str, list[str]] = {}
    for node in raw["nodes"]:
        for nic in (raw["node_reports"].get(node) or {}).get("nics") or {}:
            rails.setdefault(nic, []).append(node)
    return rails


def _dead_links(raw: dict[str, Any], probes: list[dict[str, Any]]) -> dict[str, str]:
    """NIC ids that carry nothing: down by the kernel's word, or silent both ways on every path."""
    dead = {}
    for node, rep in raw["node_reports"].items():
        for nic, facts in (rep.get("nics") or {}).items():
            if not facts.get("exists", True):
                dead[f"{node}/{nic}"] = "the NIC does not exist"
            elif facts.get("operstate") != "up" or not facts.get("carrier"):
                dead[f"{node}/{nic}"] = (
                    f"link down (operstate {facts.get('operstate')}, carrier {'on' if facts.get('carrier') else 'off'})"
                )
    through: dict[str, list[bool]] = defaultdict(list)
    for p in probes:
        lost_all = p.get("replies", 0) == 0
        through[p["src"]].append(lost_all)
        through[p["dst"]].append(lost_all)
    for nic_id, lost in through.items():
        if nic_id not in dead and len(lost) >= 2 and all(lost):
            dead[nic_id] = "carrier is up but no probe crosses it either way (a blackholed port or a dead cable)"
    return dead


def judge(raw: dict[str, Any], cfg: AuditConfig) -> dict[str, Any]:
    """The audit report: findings, per-node and per-link verdicts, and the matrices the pictures show."""
    f = _Findings()
    reports: dict[str, dict[str, Any]] = raw["node_reports"]
    rails = _rails(raw)

    # ----- per node, on its own --------------------------------------------------------
    for node in raw["nodes"]:
        rep = reports.get(node)
        if rep is None:
            f.add("worker", node, "the audit worker did not start on this node", srun=raw.get("srun_output", "")[-500:])
            continue
        d = rep.get("daemon") or {}
        if not d.get("answered"):
            f.add("daemon", node, f"clockworkd does not answer: {d.get('error', 'no answer')}")
        else:
            for comp, name in (("linkpass", "LinkPass"), ("lens", "Fleet Lens")):
                if not (d.get(comp) or {}).get("enabled"):
                    f.add("daemon", node, f"{name} is not running in clockworkd: {(d.get(comp) or {}).get('state')}")
        k = rep.get("kernel") or {}
        actual = k.get("actual") or {}
        for key, want in (k.get("wanted") or {}).items():
            have = actual.get(key)
            if key.endswith(".rp_filter"):
                nic_values = [
                    v for kk, v in actual.items() if kk.endswith(".rp_filter") and kk != key and v is not None
                ]
                effective = max([int(have or 0), *(int(v) for v in nic_values)])
                if effective == 1 and want != "1":
                    f.add(
                        "kernel",
                        node,
                        "strict reverse-path filtering (rp_filter=1) drops replies that come back on another rail; "
                        f"want {want}",
                        actual={kk: v for kk, v in actual.items() if kk.endswith("rp_filter")},
                    )
            elif have != want:
                f.add(
                    "kernel", node, f"sysctl {key} is {have if have is not None else 'missing'}, LinkPass needs {want}"
                )
        g = rep.get("gpu") or {}
        for gpu in g.get("gpus") or ():
            target = f"{node}/gpu{gpu.get('index')}"
            if gpu.get("error"):
                f.add("gpu", target, f"NVML cannot read the GPU: {gpu['error']}")
            elif gpu.get("slowdown_c") and (gpu.get("temperature_c") or 0) >= gpu["slowdown_c"]:
                f.add(
                    "gpu",
                    target,
                    f"{gpu['temperature_c']} °C, at or above its slowdown threshold {gpu['slowdown_c']} °C",
                    **gpu,
                )
            elif (gpu.get("ecc_uncorrected") or 0) > 0:
                f.add("gpu", target, f"{gpu['ecc_uncorrected']} uncorrected ECC errors since the driver loaded", **gpu)

    # ----- links: dead ones first, they explain everything that crosses them ----------
    probes = raw.get("probes") or []
    received = {(r["local"], r["sender"]): r["received"] for r in raw.get("echo_received") or ()}
    ip_of = {
        f"{node}/{nic}": facts["ip"] for node, rep in reports.items() for nic, facts in (rep.get("nics") or {}).items()
    }
    fwd_loss: dict[tuple[str, str], float] = {}
    rev_loss: dict[tuple[str, str], float] = {}
    for p in probes:
        attempted = p.get("attempted") or p.get("sent") or 0
        got = received.get((ip_of.get(p["dst"]), ip_of.get(p["src"])), 0)
        if attempted:
            fwd_loss[(p["src"], p["dst"])] = 100.0 * max(0, attempted - got) / attempted
        if got:
            rev_loss[(p["src"], p["dst"])] = 100.0 * max(0, got - p.get("replies", 0)) / got
    dead = _dead_links(raw, probes)
    for nic_id, why in sorted(dead.items()):
        f.add("nic", nic_id, why, **((reports.get(_node_of(nic_id)) or {}).get("nics", {}).get(_nic_of(nic_id)) or {}))

    def crossing(pairs: dict[tuple[str, str], float], reverse: bool = False) -> dict[tuple[str, str], list[float]]:
        """Link direction -> values of the paths that cross it (paths touching a dead link left out)."""
        out: dict[tuple[str, str], list[float]] = defaultdict(list)
        for (src, dst), value in pairs.items():
            if src in dead or dst in dead:
                continue
            a, b = (dst, src) if reverse else (src, dst)
            out[(a, UP)].append(value)
            out[(b, DOWN)].append(value)
        return out

    def localize(check: str, per_dir: dict[tuple[str, str], list[float]], bad: Any, describe: Any) -> None:
        """Name each link direction whose median is bad. With one path through it (two nodes on the rail)
        both ends of that path are named, marked ``ambiguous``: end-to-end figures cannot tell them apart."""
        scores = _medians(per_dir)
        by_link: dict[str, dict[str, float]] = defaultdict(dict)
        for (nic_id, direction), score in scores.items():
            if bad(nic_id, score):
                by_link[nic_id][direction] = score
        for nic_id, dirs in sorted(by_link.items()):
            paths = {d: per_dir[(nic_id, d)] for d in dirs}
            ambiguous = len(rails.get(_nic_of(nic_id), ())) < 3
            f.add(check, nic_id, describe(nic_id, dirs), directions=dirs, paths=paths, ambiguous=ambiguous)

    # loss: both directions of every path, each crossing two link directions
    loss_dirs = crossing(fwd_loss)
    for k, v in crossing(rev_loss, reverse=True).items():
        loss_dirs[k].extend(v)
    localize(
        "loss",
        loss_dirs,
        lambda _n, s: s > cfg.max_loss_pct,
        lambda n, d: (
            f"{_node_of(n)} {_nic_of(n)} link loses packets: "
            + ", ".join(
                f"{v:.1f} % {k} ({'NIC to switch' if k == UP else 'switch to NIC'})" for k, v in sorted(d.items())
            )
        ),
    )
    # unreachable pairs between live links (a routing or switch problem no single link explains)
    for p in probes:
        if p["src"] not in dead and p["dst"] not in dead and p.get("replies", 0) == 0:
            f.add("reachability", p["src"], f"no probe from {p['src']} to {p['dst']} came back", error=p.get("error"))

    # MTU: full-size frames fail where small ones pass, on every path through one port
    mtu_fail: dict[tuple[str, str], float] = {}
    largest: dict[str, list[int]] = defaultdict(list)
    rail_mtu: dict[str, int] = {}
    for m in raw.get("mtu") or ():
        rail_mtu[_nic_of(m["src"])] = m["mtu"]
        if m["src"] in dead or m["dst"] in dead or not m.get("small_ok"):
            continue
        mtu_fail[(m["src"], m["dst"])] = 0.0 if m.get("full_ok") else 1.0
        if not m.get("full_ok") and m.get("largest_ok"):
            largest[m["src"]].append(m["largest_ok"])
            largest[m["dst"]].append(m["largest_ok"])
    mtu_dirs = crossing(mtu_fail)
    both: dict[tuple[str, str], list[float]] = {}
    for (nic_id, _), values in list(mtu_dirs.items()):
        both.setdefault((nic_id, "path"), []).extend(values)
    localize(
        "mtu",
        both,
        lambda _n, s: s >= 0.99,
        lambda n, _d: (
            f"frames above {max(largest[n]) if largest[n] else '?'} bytes are dropped on every path through "
            f"the switch port of {_node_of(n)} {_nic_of(n)} "
            f"(the rail carries {rail_mtu.get(_nic_of(n), '?')}-byte frames)"
        ),
    )
    for node, rep in reports.items():
        for nic, facts in (rep.get("nics") or {}).items():
            want = rail_mtu.get(nic)
            if want and facts.get("mtu") and facts["mtu"] != want:
                f.add("mtu", f"{node}/{nic}", f"NIC MTU {facts['mtu']}, the rail's is {want}")

    # bandwidth: each link direction against the rail's typical direction
    # A failed transfer counts as 0 Gbit/s on its path, so the median blames the link it crossed that fails
    # the others too (a lossy port stalls TCP now and then) rather than the end that happened to send.
    gbps: dict[tuple[str, str], float] = {}
    failed: dict[tuple[str, str], str] = {}
    for t in raw.get("bandwidth") or ():
        if t["src"] in dead or t["dst"] in dead or t.get("skipped"):
            continue
        if t.get("error") or not t.get("gbps"):
            failed[(t["src"], t["dst"])] = t.get("error") or "no bytes"
        gbps[(t["src"], t["dst"])] = float(t.get("gbps") or 0.0)
    bw_dirs = crossing(gbps)
    bw_scores = _medians(bw_dirs)
    rail_ref = {
        rail: median(s for (n, _), s in bw_scores.items() if _nic_of(n) == rail)
        for rail in rails
        if any(_nic_of(n) == rail for (n, _) in bw_scores)
    }
    localize(
        "bandwidth",
        bw_dirs,
        lambda n, s: s < cfg.min_bandwidth_fraction * rail_ref.get(_nic_of(n), 0) or s < cfg.min_bandwidth_gbps,
        lambda n, d: (
            f"{_node_of(n)} {_nic_of(n)} link is slow: "
            + ", ".join(f"{v:.2f} Gbit/s {k}" for k, v in sorted(d.items()))
            + f" against the rail's typical {rail_ref.get(_nic_of(n), 0):.2f} Gbit/s"
        ),
    )
    explained = {item["target"]: item for item in f.items if item["check"] in ("bandwidth", "loss")}
    for (src, dst), error in sorted(failed.items()):
        culprit = explained.get(dst) or explained.get(src)
        if culprit is None:  # no bad link explains it: a fault of its own
            f.add("bandwidth", src, f"transfer {src} -> {dst} failed: {error}")
        else:
            culprit["evidence"].setdefault("failed_transfers", []).append(f"{src} -> {dst}: {error}")

    # one-way delay (Fleet Lens, synchronized clocks) and clock quality
    # A link that is slow to cross delays every frame, so it raises the floor of each window (its fastest
    # probe); a busy receiver delays some probes in its own scheduler, which moves the median but seldom the
    # floor. Delay is judged on the floor (the median where a daemon reports no floor); the matrix shows medians.
    merged = lens_view.merge((rep.get("daemon") or {}).get("lens_snapshot") for rep in reports.values())
    owd: dict[tuple[str, str], float] = {}
    owd_floor: dict[tuple[str, str], float] = {}
    for (src, dst), path in merged.paths.items():
        p50, floor = path.get("owd_p50_us"), path.get("owd_min_us")
        if isinstance(p50, int | float) and _nic_of(src) == _nic_of(dst):
            owd[(src, dst)] = float(p50)
            owd_floor[(src, dst)] = float(floor) if isinstance(floor, int | float) else float(p50)
    owd_dirs = crossing(owd_floor)
    owd_scores = _medians(owd_dirs)
    owd_ref = {
        rail: median(s for (n, _), s in owd_scores.items() if _nic_of(n) == rail)
        for rail in rails
        if any(_nic_of(n) == rail for (n, _) in owd_scores)
    }
    localize(
        "delay",
        owd_dirs,
        lambda n, s: owd_ref.get(_nic_of(n), 0) > 0 and s > 10 * owd_ref[_nic_of(n)] and s > 100,
        lambda n, d: (
            f"{_node_of(n)} {_nic_of(n)} link is slow to cross: "
            + ", ".join(f"at least {v:.0f} µs one-way {k}" for k, v in sorted(d.items()))
            + f" against the rail's typical {owd_ref.get(_nic_of(n), 0):.0f} µs"
        ),
    )
    for node, est in merged.clock.items():
        unc = est.get("uncertainty_us")
        if isinstance(unc, int | float) and abs(unc) > cfg.max_clock_uncertainty_us:
            f.add(
                "clock",
                node,
                f"clock offset known only to ± {abs(unc):.0f} µs (limit {cfg.max_clock_uncertainty_us:.0f} µs)",
                **est,
            )

    # LinkPass drills
    for node, why in sorted((raw.get("linkpass_down") or {}).items()):
        f.add(
            "drill",
            node,
            f"LinkPass is not running, so no drill ran and a dead NIC would cut the node off: {why}. Start "
            "clockworkd on the node (the Prolog starts it for --clockwork-ft jobs; `setsid clockworkd` for a "
            "permanent one; `clockwork sandbox daemons up` on the sandbox)",
        )
    for d in raw.get("drills") or ():
        target = f"{d['node']}/{d['nic']}"
        if d.get("skipped"):
            continue
        if d.get("error"):
            f.add("drill", target, f"LinkPass drill could not run: {d['error']}", **d)
        elif d.get("failover_ms") is None:
            f.add(
                "drill",
                target,
                f"traffic did not move off {d['nic']} within {cfg.drill_timeout_s:g} s of the NIC going down",
                **d,
            )
        elif d["failover_ms"] > cfg.max_failover_ms:
            f.add(
                "drill",
                target,
                f"traffic took {d['failover_ms']:.0f} ms to move (limit {cfg.max_failover_ms:.0f} ms)",
                **d,
            )
        elif d.get("homed_here") and d.get("failback_ms") is None and d.get("linkpass_path") != "holddown":
            state = d.get("linkpass_path") or "unknown"
            f.add("drill", target, f"traffic did not move back to {d['nic']} (LinkPass's path: {state})", **d)
        elif not d.get("reachable_after", True):
            f.add("drill", target, "the peer was unreachable after the NIC came back", **d)

    # ----- verdicts ---------------------------------------------------------------------
    nodes: dict[str, dict[str, Any]] = {n: {"ok": True, "reasons": []} for n in raw["nodes"]}
    links: dict[str, dict[str, Any]] = {
        f"{n}/{nic}": {"ok": True, "reasons": []} for nic, ns in rails.items() for n in ns
    }
    for item in f.items:
        node = nodes.setdefault(item["node"], {"ok": True, "reasons": []})
        node["ok"] = False
        node["reasons"].append(f"{item['check']}: {item['summary']}")
        if item["target"] in links:
            links[item["target"]]["ok"] = False
            links[item["target"]]["reasons"].append(f"{item['check']}: {item['summary']}")
    checks = {c: "pass" for c in CHECKS}
    for item in f.items:
        checks[item["check"]] = "fail"
    if not raw.get("drill_requested"):
        checks["drill"] = "not run"
    if not any((rep.get("gpu") or {}).get("available") for rep in reports.values()):
        checks["gpu"] = "no GPUs (NVML not available)"
    if not merged.clock:
        checks["clock"] = (
            "not measured (Fleet Lens has no clock estimates)" if checks["clock"] == "pass" else checks["clock"]
        )

    def matrix(values: dict[tuple[str, str], float]) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (src, dst), v in values.items():
            out.setdefault(_nic_of(src), {}).setdefault(_node_of(src), {})[_node_of(dst)] = round(v, 3)
        return out

    rtt = {(p["src"], p["dst"]): p["rtt_p50_us"] for p in probes if p.get("rtt_p50_us") is not None}
    total_loss = {
        (p["src"], p["dst"]): 100.0 * (1 - p.get("replies", 0) / (p.get("attempted") or p.get("sent") or 1))
        for p in probes
    }
    return {
        "ok": not f.items,
        "nodes": nodes,
        "links": links,
        "findings": f.items,
        "checks": checks,
        "rails": {nic: {"nodes": ns, "mtu": rail_mtu.get(nic)} for nic, ns in rails.items()},
        "matrices": {
            "loss_pct": matrix(total_loss),
            "rtt_us": matrix(rtt),
            "owd_us": matrix(owd),
            "gbps": matrix({(s, d): v for (s, d), v in gbps.items()}),
        },
        "clock": {"reference": merged.reference, "nodes": merged.clock},
        "drills": raw.get("drills") or [],
        "timings": raw.get("timings") or {},
        "started_at": raw.get("started_at"),
        "ended_at": raw.get("ended_at"),
    }
