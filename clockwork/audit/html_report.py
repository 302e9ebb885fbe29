"""The audit report as one self-contained HTML file: verdicts, findings, and heatmaps drawn as inline SVG.

No scripts, no fonts or styles from elsewhere: the file opens the same on an air-gapped admin laptop, in a
ticket attachment, and in a headless browser (which is how the tests check that it really draws). Each
heatmap is one rail: rows are senders, columns receivers, so a bad NIC shows as a red row (its uplink) or
column (its downlink), the same picture `clockwork lens plot` draws.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from clockwork.contracts.lens_view import natural_key

GREEN, YELLOW, RED, GREY = (44, 160, 44), (255, 191, 0), (214, 39, 40), (224, 224, 224)
CELL_W, CELL_H, LABEL_W, HEAD_H = 58, 30, 70, 46

#: metric -> (title, unit format, "low is good"?)
METRICS: dict[str, tuple[str, str, bool]] = {
    "loss_pct": ("Loss, both ways (%)", "{:.1f}", True),
    "owd_us": ("One-way delay p50 (µs, Fleet Lens)", "{:.0f}", True),
    "rtt_us": ("Round trip p50 (µs)", "{:.0f}", True),
    "gbps": ("Bandwidth (Gbit/s)", "{:.2f}", False),
}


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    return (round(a[0] + (b[0] - a[0]) * t), round(a[1] + (b[1] - a[1]) * t), round(a[2] + (b[2] - a[2]) * t))


def badness(metric: str, value: float, values: list[float]) -> float:
    """0 (healthy) .. 1 (plainly bad) for one cell, against the rail's own cells where that is the yardstick."""
    if metric == "loss_pct":
        return min(1.0, value / 5.0)  # 5 % loss is as bad as it gets for collective traffic
    if metric == "gbps":
        best = max(values) if values else 0.0
        return 0.0 if best <= 0 else min(1.0, max(0.0, (0.9 - value / best) / 0.65))  # <= 25 % of the best: red
    floor = min(values) if values else 0.0
    return 0.0 if floor <= 0 else min(1.0, max(0.0, (value / floor - 1.5) / 8.5))  # 10x the quickest: red


def colour(t: float) -> str:
    return _hex(_mix(GREEN, YELLOW, t * 2) if t <= 0.5 else _mix(YELLOW, RED, (t - 0.5) * 2))


def heatmap(metric: str, rail: str, cells: dict[str, dict[str, float]], nodes: list[str]) -> str:
    """One rail's matrix for one metric as an SVG element."""
    title, fmt, _ = METRICS[metric]
    values = [v for row in cells.values() for v in row.values()]
    width = LABEL_W + CELL_W * len(nodes) + 4
    height = HEAD_H + CELL_H * len(nodes) + 4
    parts = [
        f'<svg class="heatmap" data-metric="{metric}" data-rail="{escape(rail)}" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11">',
        f'<text x="2" y="13" font-weight="bold">{escape(rail)}: {escape(title)}</text>',
    ]
    for j, dst in enumerate(nodes):
        parts.append(
            f'<text x="{LABEL_W + CELL_W * j + CELL_W / 2}" y="{HEAD_H - 6}" text-anchor="middle">{escape(dst)}</text>'
        )
    for i, src in enumerate(nodes):
        y = HEAD_H + CELL_H * i
        parts.append(f'<text x="{LABEL_W - 6}" y="{y + CELL_H / 2 + 4}" text-anchor="end">{escape(src)}</text>')
        for j, dst in enumerate(nodes):
            x = LABEL_W + CELL_W * j
            value = (cells.get(src) or {}).get(dst)
            if value is None:
                fill, text, kind = _hex(GREY), "", "none"
            else:
                t = badness(metric, value, values)
                fill, text = colour(t), fmt.format(value)
                kind = "bad" if t >= 1.0 else "warn" if t > 0.2 else "good"
            parts.append(
                f'<rect class="cell cell-{kind}" x="{x}" y="{y}" width="{CELL_W - 2}" height="{CELL_H - 2}" '
                f'fill="{fill}"><title>{escape(src)} → {escape(dst)}: {text or "no data"}</title></rect>'
            )
            if text:
                parts.append(
                    f'<text x="{x + CELL_W / 2 - 1}" y="{y + CELL_H / 2 + 3}" text-anchor="middle">{text}</text>'
                )
    parts.append("</svg>")
    return "".join(parts)


def _badge(ok: bool) -> str:
    return '<span class="pass">PASS</span>' if ok else '<span class="fail">FAIL</span>'


def _table(headers: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render(report: dict[str, Any]) -> str:
    """The whole report page."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.get("started_at") or time.time()))
    nodes_sorted = sorted(report["nodes"], key=natural_key)
    checks = _table(
        ["check", "result"],
        [[escape(c), _badge(r == "pass") if r in ("pass", "fail") else escape(r)] for c, r in report["checks"].items()],
        "checks",
    )
    findings = _table(
        ["target", "check", "what was found"],
        [[escape(f["target"]), escape(f["check"]), escape(f["summary"])] for f in report["findings"]]
        or [["—", "—", "nothing: every check passed"]],
        "findings",
    )
    nodes = _table(
        ["node", "verdict", "reasons"],
        [
            [escape(n), _badge(report["nodes"][n]["ok"]), escape("; ".join(report["nodes"][n]["reasons"]))]
            for n in nodes_sorted
        ],
        "nodes",
    )
    links = _table(
        ["link", "verdict", "reasons"],
        [
            [escape(link), _badge(v["ok"]), escape("; ".join(v["reasons"]))]
            for link, v in sorted(report["links"].items(), key=lambda kv: natural_key(kv[0]))
        ],
        "links",
    )
    maps = []
    for rail, info in sorted(report["rails"].items(), key=lambda kv: natural_key(kv[0])):
        rail_nodes = sorted(info["nodes"], key=natural_key)
        row = [
            heatmap(metric, rail, (report["matrices"].get(metric) or {}).get(rail) or {}, rail_nodes)
            for metric in METRICS
            if (report["matrices"].get(metric) or {}).get(rail)
        ]
        maps.append(f'<div class="rail">{"".join(row)}</div>')
    drills = _table(
        ["node", "NIC", "failover", "fail-back", "note"],
        [
            [
                escape(d.get("node", "")),
                escape(d.get("nic", "")),
                "" if d.get("failover_ms") is None else f"{d['failover_ms']:.0f} ms",
                "" if d.get("failback_ms") is None else f"{d['failback_ms']:.0f} ms",
                escape(d.get("skipped") or d.get("error") or ""),
            ]
            for d in report.get("drills") or []
        ]
        or [["—", "—", "", "", "no drills run"]],
        "drills",
    )
    clock_rows = [
        [escape(n), f"{e.get('offset_us', 0):.1f} µs", f"± {abs(e.get('uncertainty_us') or 0):.1f} µs"]
        for n, e in sorted((report.get("clock") or {}).get("nodes", {}).items(), key=lambda kv: natural_key(kv[0]))
    ]
    clock = _table(["node", "offset", "uncertainty"], clock_rows or [["—", "no estimates", ""]], "clock")
    verdict = "PASS" if report["ok"] else "FAIL"
    failed = sum(1 for v in report["nodes"].values() if not v["ok"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Clockwork Fleet Audit: {verdict}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
h1 span {{ padding: 2px 10px; border-radius: 4px; color: white; }}
.pass {{ color: {_hex(GREEN)}; font-weight: bold; }} .fail {{ color: {_hex(RED)}; font-weight: bold; }}
h1 .pass {{ background: {_hex(GREEN)}; color: white; }} h1 .fail {{ background: {_hex(RED)}; color: white; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }}
.rail {{ display: flex; flex-wrap: wrap; gap: 16px; margin-bottom: 12px; }}
</style></head><body>
<h1>Clockwork Fleet Audit {_badge(report["ok"])}</h1>
<p>{len(report["nodes"])} nodes audited at {escape(when)}; {failed} failing, {len(report["findings"])} findings.</p>
<h2>Checks</h2>{checks}
<h2>Findings</h2>{findings}
<h2>Heatmaps</h2>{"".join(maps) or "<p>no measurements</p>"}
<h2>Nodes</h2>{nodes}
<h2>Links</h2>{links}
<h2>LinkPass drills</h2>{drills}
<h2>Clock sync</h2>{clock}
</body></html>
"""
