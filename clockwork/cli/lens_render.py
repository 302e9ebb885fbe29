"""What a person looks at: the cluster's Fleet Lens snapshots merged, as terminal tables and a PNG.

The CLI gathers one snapshot per daemon and :func:`clockwork.contracts.lens_view.merge` turns them into one
cluster view. Everything here is a pure function of that view (no I/O except :func:`plot` writing its file), so
the CLI, tests and notebooks all draw the same pictures.

Matrices are laid out rail by rail (a rail is the NIC name after the ``/``: every node's ``nic1``
hangs on the same rail switch in a rail-optimised fabric), so a bad NIC shows up as a red row
(its uplink) or a red column (its downlink) inside one rail's block.

matplotlib is imported inside :func:`plot` only: the daemon and the CLI's table commands never pay
its import time, and hosts without a display get the Agg backend.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from statistics import median
from typing import Any, Literal

from rich.table import Table
from rich.text import Text

from clockwork.contracts.lens_model import NicId, split_nic
from clockwork.contracts.lens_view import Merged, natural_key, nic_sort_key, number, rail_of, verdict_of

Metric = Literal["p50", "min", "p99", "loss", "rtt"]

CROSS_RAIL = "cross-rail"
_METRIC_KEY: dict[str, str] = {
    "p50": "owd_p50_us",
    "min": "owd_min_us",
    "p99": "owd_p99_us",
    "loss": "loss",
    "rtt": "rtt_p50_us",
}
_METRIC_TITLE: dict[str, str] = {
    "p50": "One-way delay p50 (µs)",
    "min": "One-way delay min (µs)",
    "p99": "One-way delay p99 (µs)",
    "loss": "Loss (%)",
    "rtt": "Round trip p50 (µs, from echoes)",
}
# A delay this many times the rail's median delay is worth a look (yellow) / is plainly wrong (red),
# even before the path's own baseline flags it. Loss: any is worth a look, 1% is bad for RDMA.
_DELAY_WARN, _DELAY_BAD = 2.0, 10.0
_LOSS_BAD = 0.01
_SCORE_WARN = 0.25

GREEN, YELLOW, RED, GREY = "green", "yellow", "bold red", "grey50"


# ----- terminal tables ------------------------------------------------------------------------


def _fmt_us(value: float) -> str:
    return f"{value:.1f}" if abs(value) < 10_000 else f"{value:.0f}"


def _fmt_duration(us: float | None) -> str:
    """Microseconds in the unit a person reads fastest (12.5 µs, 12.503 ms, 1.204 s)."""
    if us is None:
        return "?"
    if abs(us) < 1_000:
        return f"{us:+.1f} µs"
    if abs(us) < 1_000_000:
        return f"{us / 1e3:+.3f} ms"
    return f"{us / 1e6:+.3f} s"


def _rail_medians(merged: Merged, key: str) -> dict[str, float]:
    """Median of one metric over each rail's paths: the yardstick for 'unusually slow' in that rail."""
    by_rail: dict[str, list[float]] = {}
    for (src, dst), path in merged.paths.items():
        if (v := number(path.get(key))) is not None and v > 0:
            by_rail.setdefault(_pair_rail(src, dst), []).append(v)
    return {rail: median(values) for rail, values in by_rail.items()}


def _pair_rail(src: NicId, dst: NicId) -> str:
    return rail_of(src) if rail_of(src) == rail_of(dst) else CROSS_RAIL


def _health(path: Mapping[str, Any], metric: str, value: float | None, rail_median: float | None) -> str:
    """green/yellow/red for one cell: the verdict first, then the value against its rail."""
    verdict = verdict_of(path)
    if verdict.get("bad") is True:
        return RED
    warn = (number(verdict.get("score")) or 0.0) >= _SCORE_WARN
    if value is not None:
        if metric == "loss":
            if value >= _LOSS_BAD:
                return RED
            warn = warn or value > 0
        elif rail_median:
            if value > _DELAY_BAD * rail_median:
                return RED
            warn = warn or value > _DELAY_WARN * rail_median
    return YELLOW if warn else GREEN


def _cell(merged: Merged, src: NicId, dst: NicId, metric: str, medians: dict[str, float]) -> Text:
    if src == dst:
        return Text("·", style=GREY)
    path = merged.paths.get((src, dst))
    if path is None:
        return Text("—", style=GREY)
    value = number(path.get(_METRIC_KEY[metric]))
    style = _health(path, metric, value, medians.get(_pair_rail(src, dst)))
    if value is None:
        return Text("dead", style=RED) if _is_dead(path) else Text("?", style=GREY if style == GREEN else style)
    text = f"{value * 100:.1f}%" if metric == "loss" else _fmt_us(value)
    return Text(text, style=style)


def matrix_table(merged: Merged, metric: Metric = "p50") -> Table:
    """Source NICs down, destination NICs across, rail by rail; each cell one path's ``metric``.

    Red is a bad verdict (or a value far outside its rail), yellow worth a look, green healthy, grey
    not measured. A row of red is a NIC that cannot send; a column, one that cannot receive.
    """
    if metric not in _METRIC_KEY:
        raise ValueError(f"metric must be one of {sorted(_METRIC_KEY)}, not {metric!r}")
    nics = merged.nics
    medians = _rail_medians(merged, _METRIC_KEY[metric])
    bad = len(merged.bad_paths())
    table = Table(
        title=f"{_METRIC_TITLE[metric]}: {len(merged.paths)} paths, {bad} bad",
        caption="rows send, columns receive · [green]healthy[/] [yellow]worth a look[/] [bold red]bad[/] "
        "[grey50]— not measured[/]",
        header_style="bold",
        show_lines=False,
    )
    table.add_column("src \\ dst", style="bold", no_wrap=True)
    rails = sorted({rail_of(n) for n in nics}, key=natural_key)
    palette = ("cyan", "magenta")
    for dst in nics:
        table.add_column(
            dst, justify="right", no_wrap=True, header_style=f"bold {palette[rails.index(rail_of(dst)) % 2]}"
        )
    if not nics:
        table.add_row(Text("no paths measured", style=GREY))
        return table
    previous_rail: str | None = None
    for src in nics:
        if previous_rail is not None and rail_of(src) != previous_rail:
            table.add_section()
        previous_rail = rail_of(src)
        row_style = f"bold {palette[rails.index(previous_rail) % 2]}"
        table.add_row(Text(src, style=row_style), *(_cell(merged, src, dst, metric, medians) for dst in nics))
    return table


def _evidence_text(evidence: Any) -> str:
    """A suspect's evidence dict in one short line (numbers as is, lists by their length)."""
    if not isinstance(evidence, Mapping):
        return ""
    parts = []
    for key, value in evidence.items():
        if isinstance(value, list | tuple):
            parts.append(f"{key}={len(value)}")
        elif isinstance(value, Mapping):
            parts.append(f"{key}={{{len(value)}}}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def suspects_table(merged: Merged) -> Table:
    """The links the bad paths point to, most certain first."""
    table = Table(title=f"Suspects ({len(merged.suspects)})", header_style="bold")
    for name, justify in (
        ("link", "left"),
        ("direction", "left"),
        ("kinds", "left"),
        ("confidence", "right"),
        ("switch port", "left"),
        ("evidence", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    if not merged.suspects:
        table.add_row(Text("none: no link explains a bad path", style=GREEN), "", "", "", "", "")
        return table
    for sus in merged.suspects:
        conf = number(sus.get("confidence"))
        style = RED if conf is not None and conf >= 0.7 else YELLOW
        conf_text = "?" if conf is None else f"{conf:.2f} " + "█" * round(conf * 10)
        port = f"{sus.get('switch', '')}:{sus.get('port', '')}" if sus.get("switch") else ""
        table.add_row(
            Text(str(sus.get("link", "")), style=style),
            str(sus.get("direction", "")),
            ", ".join(str(k) for k in sus.get("kinds") or ()),
            Text(conf_text, style=style),
            port,
            _evidence_text(sus.get("evidence")),
        )
    return table


def clock_table(merged: Merged) -> Table:
    """Each node's clock offset from the reference, with how sure the estimate is."""
    reference = merged.reference or "?"
    table = Table(title=f"Clock offsets from {reference}", header_style="bold")
    table.add_column("node", style="bold")
    table.add_column("offset", justify="right")
    table.add_column("uncertainty", justify="right")
    table.add_column("loop residual", justify="right")
    table.add_column("")
    nodes = sorted(merged.clock, key=lambda n: (n != merged.reference, natural_key(n)))
    if not nodes:
        table.add_row(Text("no clock estimates yet", style=GREY), "", "", "", "")
        return table
    for node in nodes:
        est = merged.clock[node]
        offset, unc = number(est.get("offset_us")), number(est.get("uncertainty_us"))
        if unc is None:
            unc_text = Text("unknown", style=GREY)
        else:
            unc_style = GREEN if unc < 10 else YELLOW if unc < 100 else RED
            unc_text = Text(f"± {abs(unc):.1f} µs", style=unc_style)
        residual = merged.loop_residual_us.get(node)
        table.add_row(
            node,
            Text(_fmt_duration(offset), style=GREY if offset is None else ""),
            unc_text,
            "" if residual is None else f"{residual:.1f} µs",
            Text("reference", style="cyan") if node == merged.reference else "",
        )
    return table


# ----- picture --------------------------------------------------------------------------------


def _groups(merged: Merged) -> list[tuple[str, list[NicId], list[NicId]]]:
    """(rail, source NICs, destination NICs) per heatmap; paths between rails get their own."""
    rails: dict[str, set[NicId]] = {}
    cross_src: set[NicId] = set()
    cross_dst: set[NicId] = set()
    for src, dst in merged.paths:
        rail = _pair_rail(src, dst)
        if rail == CROSS_RAIL:
            cross_src.add(src)
            cross_dst.add(dst)
        else:
            rails.setdefault(rail, set()).update((src, dst))
    out = [(rail, sorted(n, key=nic_sort_key), sorted(n, key=nic_sort_key)) for rail, n in rails.items()]
    out.sort(key=lambda g: natural_key(g[0]))
    if cross_src:
        out.append((CROSS_RAIL, sorted(cross_src, key=nic_sort_key), sorted(cross_dst, key=nic_sort_key)))
    return out


def _suspect_lines(merged: Merged) -> list[tuple[str, str]]:
    """(link, "direction; kinds; confidence") per suspect: two lines each, so long names fit the panel."""
    lines = []
    for sus in merged.suspects:
        conf = number(sus.get("confidence"))
        kinds = ", ".join(str(k) for k in sus.get("kinds") or ()) or "?"
        pct = "?" if conf is None else f"{conf:.0%}"
        lines.append((str(sus.get("link", "?")), f"{sus.get('direction', '?')}; {kinds}; {pct}"))
    return lines


def _is_dead(path: Mapping[str, Any] | None) -> bool:
    """A path measured but with nothing received: no delay to show, which must not read as 'no data'."""
    if not path:
        return False
    verdict = verdict_of(path)
    return (number(path.get("loss")) or 0.0) >= 1.0 or "dead" in (verdict.get("kinds") or ())


def plot(merged: Merged, out: Path) -> Path:
    """Write a PNG of the cluster: per rail, p50 one-way delay and loss heatmaps, then clock offsets.

    Bad paths are outlined in blue, suspect NICs' labels are red, the suspects are listed beside the
    clock chart and the top one is in the title. Missing paths are grey. Returns ``out``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    groups = _groups(merged)
    suspect_nics = {str(s["nic"]) for s in merged.suspects if s.get("nic")}
    bad_pairs = set(merged.bad_paths())
    # Two rails side by side once there are several, so an 8-rail cluster stays a screenful tall.
    per_row = 2 if len(groups) >= 4 else 1
    n_max = max((max(len(s), len(d)) for _, s, d in groups), default=0)
    cell_in = 0.42 if n_max <= 16 else max(0.12, 7.0 / n_max)
    side = max(4.5, cell_in * n_max + 2.0)
    heights = [
        max(3.6, cell_in * max(len(srcs) for _, srcs, _ in groups[i : i + per_row]) + 1.8)
        for i in range(0, len(groups), per_row)
    ] or [1.2]
    heights.append(4.0)
    fig = Figure(figsize=(2 * per_row * side + 1.0, sum(heights) + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(heights), 2 * per_row, height_ratios=heights)

    delays = [v for p in merged.paths.values() if (v := number(p.get("owd_p50_us"))) is not None and v > 0]
    losses = [v * 100 for p in merged.paths.values() if (v := number(p.get("loss"))) is not None]
    if delays and max(delays) / min(delays) > 20:
        delay_norm: Normalize = LogNorm(vmin=min(delays), vmax=max(delays))
    else:
        delay_norm = Normalize(vmin=min(delays, default=0.0), vmax=max(max(delays, default=1.0), 1e-3))
    loss_norm = Normalize(vmin=0.0, vmax=max(5.0, max(losses, default=0.0)))
    delay_cmap = matplotlib.colormaps["YlOrRd"].with_extremes(bad="#d0d0d0")
    loss_cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="#d0d0d0")

    for index, (rail, srcs, dsts) in enumerate(groups):
        row, first_col = divmod(index, per_row)
        same_rail = rail != CROSS_RAIL
        for col, (key, scale, cmap, norm, label) in enumerate(
            (
                ("owd_p50_us", 1.0, delay_cmap, delay_norm, "p50 one-way delay (µs)"),
                ("loss", 100.0, loss_cmap, loss_norm, "loss (%)"),
            )
        ):
            ax = fig.add_subplot(grid[row, 2 * first_col + col])
            data = np.full((len(srcs), len(dsts)), np.nan)
            for i, src in enumerate(srcs):
                for j, dst in enumerate(dsts):
                    path = merged.paths.get((src, dst))
                    value = number(path.get(key)) if path else None
                    if value is not None:
                        data[i, j] = value * scale
            image = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
            fig.colorbar(image, ax=ax, shrink=0.85, label=label)
            if len(srcs) * len(dsts) <= 144:  # beyond that the numbers are too small to read
                for i in range(len(srcs)):
                    for j in range(len(dsts)):
                        if math.isnan(data[i, j]):
                            if _is_dead(merged.paths.get((srcs[i], dsts[j]))):
                                ax.text(j, i, "dead", ha="center", va="center", fontsize=7, color="#b00000")
                        else:
                            rgba = cmap(norm(data[i, j]))
                            dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
                            text = f"{data[i, j]:.1f}" if col else _fmt_us(data[i, j])
                            ax.text(
                                j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black"
                            )
            for i, src in enumerate(srcs):
                for j, dst in enumerate(dsts):
                    if (src, dst) in bad_pairs:
                        ax.add_patch(
                            Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#0050ff", linewidth=2.5)
                        )
            names = (lambda n: split_nic(n)[0]) if same_rail else (lambda n: n)
            ax.set_xticks(range(len(dsts)), [names(n) for n in dsts], rotation=60, ha="right", fontsize=8)
            ax.set_yticks(range(len(srcs)), [names(n) for n in srcs], fontsize=8)
            for tick, nic in (
                *zip(ax.get_xticklabels(), dsts, strict=True),
                *zip(ax.get_yticklabels(), srcs, strict=True),
            ):
                if nic in suspect_nics:
                    tick.set_color("red")
                    tick.set_fontweight("bold")
            ax.set_xlabel("receiver")
            ax.set_ylabel("sender")
            what = "p50 one-way delay" if col == 0 else "loss"
            ax.set_title(f"{'rail ' + rail if same_rail else 'between rails'}: {what}", fontsize=10)
    if not groups:
        ax = fig.add_subplot(grid[0, :])
        ax.axis("off")
        ax.text(0.5, 0.5, "no paths measured yet", ha="center", va="center", fontsize=14, color="grey")

    # Clock offsets: one bar per node, the error bar its uncertainty, the reference in grey.
    ax = fig.add_subplot(grid[-1, :per_row])
    nodes = sorted(merged.clock, key=natural_key)
    offsets = [number(merged.clock[n].get("offset_us")) for n in nodes]
    uncs = [number(merged.clock[n].get("uncertainty_us")) for n in nodes]
    largest = max((abs(o) for o in offsets if o is not None), default=0.0)
    unit, div = ("ms", 1e3) if largest >= 1000 else ("µs", 1.0)
    if nodes:
        heights_v = [0.0 if o is None else o / div for o in offsets]
        errors = [0.0 if u is None else abs(u) / div for u in uncs]
        colors = [
            "#9e9e9e" if n == merged.reference else ("#d0d0d0" if o is None else "#4c72b0")
            for n, o in zip(nodes, offsets, strict=True)
        ]
        ax.bar(range(len(nodes)), heights_v, yerr=errors, color=colors, capsize=4, ecolor="black")
        ax.set_xticks(
            range(len(nodes)),
            nodes,
            rotation=45 if len(nodes) > 8 else 0,
            ha="right" if len(nodes) > 8 else "center",
            fontsize=8,
        )
        ax.axhline(0, color="black", linewidth=0.6)
        # Room above and below for the labels (bars stick to zero, so margins alone give none there).
        low = min(0.0, *(h - e for h, e in zip(heights_v, errors, strict=True)))
        high = max(0.0, *(h + e for h, e in zip(heights_v, errors, strict=True)))
        pad = 0.15 * ((high - low) or 1.0)
        ax.set_ylim(low - pad, high + pad)
        for i, (o, u) in enumerate(zip(offsets, uncs, strict=True)):
            label = (
                "?"
                if o is None
                else ("ref" if nodes[i] == merged.reference else f"±{abs(u):.1f} µs" if u is not None else "± ?")
            )
            ax.annotate(
                label,
                (i, heights_v[i]),
                textcoords="offset points",
                xytext=(0, 4 if heights_v[i] >= 0 else -12),
                ha="center",
                fontsize=7,
            )
    else:
        ax.text(0.5, 0.5, "no clock estimates yet", ha="center", va="center", color="grey", transform=ax.transAxes)
    residuals = [r for r in merged.loop_residual_us.values() if r is not None]
    residual = f"\nloop residual ≤ {max(residuals):.1f} µs" if residuals else ""
    ax.set_title(f"clock offset from {merged.reference or '?'} (± uncertainty){residual}", fontsize=10)
    ax.set_ylabel(f"offset ({unit})")

    # Suspects, in words: the one thing the reader came for. The text may run past its axes, so it
    # stays out of the layout (else the constrained layout pushes the heatmaps' colour bars aside).
    ax = fig.add_subplot(grid[-1, per_row:])
    ax.axis("off")
    lines = _suspect_lines(merged)
    shown = "\n".join(f"{i + 1}. {link}\n   {details}" for i, (link, details) in enumerate(lines[:8]))
    if len(lines) > 8:
        shown += f"\n… and {len(lines) - 8} more"
    texts: tuple[tuple[float, str, dict[str, Any]], ...] = (
        (1.0, "Suspects", {"fontsize": 12, "fontweight": "bold"}),
        (0.85, shown, {"fontsize": 9, "color": "#b00000", "family": "monospace"}),
        (0.85, "" if lines else "none: no link explains a bad path", {"fontsize": 10, "color": "#2e7d32"}),
        (
            0.02,
            f"{len(merged.paths)} paths, {len(bad_pairs)} bad (outlined in blue), {len(merged.nodes)} "
            f"daemon{'' if len(merged.nodes) == 1 else 's'} reporting\n"
            "suspect NICs' labels in red, grey cells not measured",
            {"fontsize": 8, "color": "grey"},
        ),
    )
    for y, text, style in texts:
        if text:
            ax.text(0.0, y, text, va="top" if y > 0.5 else "bottom", transform=ax.transAxes, in_layout=False, **style)

    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(merged.time)) if merged.time else "time unknown"
    headline = f"top suspect: {lines[0][0]} ({lines[0][1]})" if lines else "no suspects"
    fig.suptitle(
        f"Fleet Lens  ·  {when}\n{headline}", fontsize=13, fontweight="bold", color="#b00000" if lines else "black"
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
