"""Fleet Lens surfaces: Prometheus metrics, the HDF5 history, terminal tables, the PNG and the Grafana dashboard.

Everything works from hand-made snapshots (the dict each daemon's Lens component publishes), so no
prober, socket or cluster is needed; the HTTP test binds port 0 on 127.0.0.1 only.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import struct
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from clockwork.cli.lens_render import clock_table, matrix_table, plot, suspects_table
from clockwork.contracts.lens_view import merge
from clockworkd.lens.history import HistoryWriter, read_history
from clockworkd.lens.metrics import METRIC_NAMES, MetricsServer, render_text

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "etc" / "grafana" / "clockwork-lens.json"
T0 = 1764430000.123


def _path(src: str, dst: str, p50: float | None = 11.0, loss: float = 0.0, bad: bool = False) -> dict[str, Any]:
    return {
        "src": src,
        "dst": dst,
        "window_s": 1.0,
        "sent": 100,
        "received": round(100 * (1 - loss)),
        "loss": loss,
        "owd_min_us": None if p50 is None else p50 - 2,
        "owd_p50_us": p50,
        "owd_p99_us": None if p50 is None else p50 + 20,
        "jitter_us": 2.1,
        "rate_mbps": None,
        "verdict": {
            "src": src,
            "dst": dst,
            "bad": bad,
            "reasons": [f"loss {loss:.1%} (baseline 0.0%)"] if bad else [],
            "kinds": ["loss"] if bad else [],
            "score": 0.6 if bad else 0.0,
        },
    }


def _suspect(link: str, nic: str | None, confidence: float, kinds: list[str]) -> dict[str, Any]:
    return {
        "link": link,
        "links": [f"rail1>{nic}"] if nic else [],
        "switch": "rail1",
        "port": "p3",
        "nic": nic,
        "direction": "downlink",
        "kinds": kinds,
        "confidence": confidence,
        "evidence": {"bad_paths": 2, "good_paths": 0},
    }


def _snapshot(node: str = "node1", t: float = T0) -> dict[str, Any]:
    return {
        "node": node,
        "enabled": True,
        "interval_ms": 10,
        "time": t,
        "reference": "node1",
        "clock": {
            "node1": {"offset_us": 0.0, "uncertainty_us": 0.0},
            "node2": {"offset_us": 12503.2, "uncertainty_us": 1.8},
            "node3": {"offset_us": -830.5, "uncertainty_us": None},
        },
        "loop_residual_us": 0.7,
        "paths": [
            _path("node2/nic0", "node1/nic0", p50=11.0, loss=0.03, bad=True),
            _path("node3/nic0", "node1/nic0", p50=None, loss=0.0),
        ],
        "suspects": [_suspect("node1/nic0 <-> rail0", "node1/nic0", 0.6, ["loss", "delay"])],
        "counters": {
            "probes_sent": 123,
            "probes_received": 120,
            "rejected": 2,
            "send_errors": 0,
            "probe_ticks_skipped": 1,
        },
    }


def _cluster() -> list[dict[str, Any] | None]:
    """Three daemons on two rails; node3/nic1 cannot receive (its downlink drops 10%)."""
    snaps: list[dict[str, Any] | None] = []
    nodes = ["node1", "node2", "node3"]
    for dst_node in nodes:
        snap = _snapshot(dst_node)
        snap["paths"] = [
            _path(f"{src}/{rail}", f"{dst_node}/{rail}", p50=10.0 + i, loss=0.1 if bad else 0.0, bad=bad)
            for rail in ("nic0", "nic1")
            for i, src in enumerate(n for n in nodes if n != dst_node)
            for bad in [f"{dst_node}/{rail}" == "node3/nic1"]
        ]
        conf = {"node1": 0.5, "node2": 0.9, "node3": 0.7}[dst_node]
        snap["suspects"] = [_suspect("node3/nic1 <-> rail1", "node3/nic1", conf, ["loss"])]
        if dst_node == "node2":
            snap["suspects"].append(_suspect("leaf0 <-> spine1", None, 0.3, ["delay"]))
            snap["clock"] = {"node1": {"offset_us": 99.0, "uncertainty_us": 50.0}}  # not the reference's copy
        snaps.append(snap)
    snaps.append(None)  # a daemon that did not answer
    return snaps


def _text(table: Table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


# ----- metrics --------------------------------------------------------------------------------


def test_metrics_text_has_the_samples_and_skips_none() -> None:
    text = render_text(_snapshot())
    lines = set(text.splitlines())
    expected = {
        'clockwork_lens_owd_seconds{dst="node1/nic0",src="node2/nic0",stat="p50"} 1.1e-05',
        'clockwork_lens_owd_seconds{dst="node1/nic0",src="node2/nic0",stat="min"} 9e-06',
        'clockwork_lens_owd_seconds{dst="node1/nic0",src="node2/nic0",stat="p99"} 3.1e-05',
        'clockwork_lens_loss_ratio{dst="node1/nic0",src="node2/nic0"} 0.03',
        'clockwork_lens_loss_ratio{dst="node1/nic0",src="node3/nic0"} 0.0',
        'clockwork_lens_jitter_seconds{dst="node1/nic0",src="node2/nic0"} 2.1e-06',
        'clockwork_lens_path_bad{dst="node1/nic0",src="node2/nic0"} 1.0',
        'clockwork_lens_path_bad{dst="node1/nic0",src="node3/nic0"} 0.0',
        'clockwork_lens_clock_offset_seconds{node="node2",reference="node1"} 0.0125032',
        'clockwork_lens_clock_offset_seconds{node="node3",reference="node1"} -0.0008305',
        'clockwork_lens_clock_uncertainty_seconds{node="node2"} 1.8e-06',
        "clockwork_lens_loop_residual_seconds 7e-07",
        'clockwork_lens_suspect{direction="downlink",kinds="delay,loss",link="node1/nic0 <-> rail0",'
        'nic="node1/nic0"} 0.6',
        "clockwork_lens_probes_sent_total 123.0",
        "clockwork_lens_probes_received_total 120.0",
        "clockwork_lens_probes_rejected_total 2.0",
        "clockwork_lens_enabled 1.0",
    }
    assert expected <= lines, expected - lines
    # node3/nic0 has no one-way delay and node3 no uncertainty: absent, never exported as 0.
    assert 'src="node3/nic0",stat=' not in text
    assert 'clockwork_lens_clock_uncertainty_seconds{node="node3"}' not in text
    samples = {line.split("{")[0].split(" ")[0] for line in lines if line and not line.startswith("#")}
    assert samples <= METRIC_NAMES


def test_metrics_survive_no_snapshot_and_malformed_fields() -> None:
    assert "clockwork_lens_owd_seconds{" not in render_text(None)
    broken = _snapshot()
    broken["paths"] = [{"src": "a/nic0", "dst": "b/nic0", "loss": "n/a", "owd_p50_us": True}, "junk", None]
    broken["clock"] = {"node1": None}
    broken["counters"] = None
    text = render_text(broken)
    assert "clockwork_lens_loss_ratio{" not in text
    assert "\nclockwork_lens_probes_sent_total " not in text
    assert "clockwork_lens_loop_residual_seconds 7e-07" in text


def test_metrics_server_serves_on_port_0_and_closes() -> None:
    current: dict[str, Any] = {"snap": _snapshot()}
    server = MetricsServer(lambda: current["snap"], "127.0.0.1", 0)
    server.start()
    try:
        assert server.port > 0 and server.bind == "127.0.0.1"
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = reply.read().decode()
        assert "clockwork_lens_probes_sent_total 123.0" in body
        # The daemon swaps its snapshot; the next scrape sees the new one.
        newer = _snapshot()
        newer["counters"]["probes_sent"] = 456
        current["snap"] = newer
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert "clockwork_lens_probes_sent_total 456.0" in reply.read().decode()
    finally:
        server.close()
    server.close()  # twice is fine
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


# ----- history --------------------------------------------------------------------------------


def test_history_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "lens" / "node1.h5"  # the folder is created on first append
    writer = HistoryWriter(path, max_bytes=10_000_000)
    assert writer.append(_snapshot(t=T0))
    assert writer.append(_snapshot(t=T0 + 60))
    h = read_history(path)
    assert h["node"] == "node1"
    paths = h["paths"]
    assert paths["src"] == ["node2/nic0", "node3/nic0"] * 2
    assert paths["dst"] == ["node1/nic0"] * 4
    np.testing.assert_allclose(paths["time"], [T0, T0, T0 + 60, T0 + 60])
    np.testing.assert_allclose(paths["loss"], [0.03, 0.0, 0.03, 0.0])
    assert paths["owd_p50_us"][0] == pytest.approx(11.0)
    assert np.isnan(paths["owd_p50_us"][1])  # None is NaN
    assert paths["bad"].tolist() == [1, 0, 1, 0]
    clocks = h["clocks"]
    assert clocks["node"][:3] == ["node1", "node2", "node3"]
    assert clocks["offset_us"][1] == pytest.approx(12503.2)
    assert np.isnan(clocks["uncertainty_us"][2])
    suspects = h["suspects"]
    assert suspects["link"] == ["node1/nic0 <-> rail0"] * 2
    assert suspects["kinds"][0] == ["loss", "delay"]
    assert suspects["confidence"][0] == pytest.approx(0.6)
    assert suspects["nic"] == ["node1/nic0"] * 2
    assert clocks["reference"][0] == "node1"


def test_history_keeps_names_none_and_new_names_across_appends(tmp_path: Path) -> None:
    path = tmp_path / "node1.h5"
    writer = HistoryWriter(path, max_bytes=10_000_000)
    snap = _snapshot()
    snap["suspects"] = [_suspect("leaf0 <-> spine1", None, 0.4, ["delay"])]
    snap["reference"] = None
    assert writer.append(snap)
    snap["paths"] = [_path("node9/nic3", "node1/nic3")]
    assert writer.append(snap)
    h = read_history(path)
    assert h["suspects"]["nic"] == [None, None]
    assert h["clocks"]["reference"][0] is None
    assert h["paths"]["src"] == ["node2/nic0", "node3/nic0", "node9/nic3"]


def test_history_rotation_keeps_size_bounded(tmp_path: Path) -> None:
    path = tmp_path / "node1.h5"
    max_bytes = 60_000
    writer = HistoryWriter(path, max_bytes=max_bytes)
    snap = _snapshot()
    snap["paths"] = [_path(f"node{i}/nic0", "node1/nic0") for i in range(2, 42)]
    for minute in range(80):
        snap["time"] = T0 + 60 * minute
        assert writer.append(snap)
        rotated = path.with_name("node1.h5.1")
        on_disk = path.stat().st_size + (rotated.stat().st_size if rotated.exists() else 0)
        assert on_disk <= 2 * max_bytes * 1.1, (minute, on_disk)
    assert rotated.exists()
    assert path.stat().st_size <= max_bytes * 1.1
    both = read_history(path, include_rotated=True)
    newest = read_history(path)
    assert len(both["paths"]["time"]) > len(newest["paths"]["time"]) > 0
    assert np.all(np.diff(both["paths"]["time"]) >= 0)  # older file first
    assert both["paths"]["time"][-1] == pytest.approx(T0 + 60 * 79)


def test_history_appends_a_hundred_path_snapshot_each_time(tmp_path: Path) -> None:
    """Once a minute from the daemon's event loop: every append of a 100-path snapshot lands whole (its cost
    is a benchmark's matter, not a test's)."""
    path = tmp_path / "h.h5"
    writer = HistoryWriter(path, max_bytes=50_000_000)
    snap = _snapshot()
    snap["paths"] = [_path(f"node{i % 10}/nic{i // 10}", f"node{(i + 1) % 10}/nic{i // 10}") for i in range(100)]
    assert all(writer.append(snap) for _ in range(6))
    assert len(read_history(path)["paths"]["time"]) == 600


def test_history_unwritable_path_returns_false(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where a folder should be")  # defeats root too
    writer = HistoryWriter(blocker / "node1.h5", max_bytes=1_000_000)
    with caplog.at_level(logging.WARNING, logger="clockwork.lens"):
        assert writer.append(_snapshot()) is False
    assert any("append failed" in r.getMessage() for r in caplog.records)


def test_history_moves_a_corrupt_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "node1.h5"
    path.write_bytes(b"half an HDF5 file from a crash")
    writer = HistoryWriter(path, max_bytes=1_000_000)
    assert writer.append(_snapshot())
    assert path.with_name("node1.h5.1").read_bytes().startswith(b"half")
    assert len(read_history(path)["paths"]["time"]) == 2


# ----- render ---------------------------------------------------------------------------------


def test_merge_dedups_suspects_and_takes_the_reference_clock() -> None:
    merged = merge(_cluster())
    assert [s["link"] for s in merged.suspects] == ["node3/nic1 <-> rail1", "leaf0 <-> spine1"]
    assert merged.suspects[0]["confidence"] == 0.9  # the highest of the three daemons'
    assert len(merged.paths) == 12  # 3 receivers x 2 senders x 2 rails
    assert merged.reference == "node1"
    assert merged.clock["node2"]["offset_us"] == 12503.2  # node1's copy, not node2's
    assert merged.nodes == ["node1", "node2", "node3"]
    assert merged.time == T0
    assert sorted(merged.bad_paths()) == [("node1/nic1", "node3/nic1"), ("node2/nic1", "node3/nic1")]


def test_merge_without_the_reference_uses_the_first_clock() -> None:
    snaps = _cluster()[1:]
    assert merge(snaps).clock == {"node1": {"offset_us": 99.0, "uncertainty_us": 50.0}}
    empty = merge([])
    assert (empty.paths, empty.suspects, empty.clock, empty.reference) == ({}, [], {}, None)


def test_matrix_table_cells() -> None:
    merged = merge(_cluster())
    text = _text(matrix_table(merged, "p50"))
    assert "One-way delay p50 (µs): 12 paths, 2 bad" in text
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text.splitlines()
        if "│" in line
    }
    header = [c.strip() for c in next(line for line in text.splitlines() if "src \\ dst" in line).split("┃")[2:-1]]
    # Rail by rail: every nic0 before every nic1.
    assert header == ["node1/nic0", "node2/nic0", "node3/nic0", "node1/nic1", "node2/nic1", "node3/nic1"]
    assert rows["node1/nic0"] == ["·", "10.0", "10.0", "—", "—", "—"]
    assert rows["node2/nic1"] == ["—", "—", "—", "10.0", "·", "11.0"]
    loss = _text(matrix_table(merged, "loss"))
    loss_rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in loss.splitlines()
        if "│" in line
    }
    assert loss_rows["node1/nic1"][5] == "10.0%"
    assert loss_rows["node1/nic1"][4] == "0.0%"
    with pytest.raises(ValueError):
        matrix_table(merged, "p42")  # type: ignore[arg-type]


def test_matrix_colours_bad_red_and_missing_grey() -> None:
    merged = merge(_cluster())
    table = matrix_table(merged, "p50")
    cells = {col.header: [c for c in col.cells if isinstance(c, Text)] for col in table.columns}
    src_order = [str(c) for c in cells["src \\ dst"]]
    bad_cell = cells["node3/nic1"][src_order.index("node1/nic1")]
    good_cell = cells["node2/nic1"][src_order.index("node1/nic1")]
    missing = cells["node1/nic1"][src_order.index("node1/nic0")]
    assert "red" in str(bad_cell.style) and str(bad_cell) == "10.0"
    assert str(good_cell.style) == "green"
    assert str(missing.style) == "grey50"


def test_matrix_handles_dead_paths_and_nothing_at_all() -> None:
    snap = _snapshot()
    snap["paths"] = [_path("node2/nic0", "node1/nic0", p50=None, loss=1.0, bad=True)]
    assert "dead" in _text(matrix_table(merge([snap]), "p50"))
    assert "no paths measured" in _text(matrix_table(merge([]), "min"))


def test_suspects_and_clock_tables() -> None:
    merged = merge(_cluster())
    sus = _text(suspects_table(merged))
    assert "node3/nic1 <-> rail1" in sus and "0.90" in sus and "rail1:p3" in sus
    assert sus.index("node3/nic1 <-> rail1") < sus.index("leaf0 <-> spine1")
    assert "none" in _text(suspects_table(merge([])))
    clocks = _text(clock_table(merged))
    assert "Clock offsets from node1" in clocks
    assert "+12.503 ms" in clocks and "± 1.8 µs" in clocks and "-830.5 µs" in clocks
    assert "unknown" in clocks and "reference" in clocks


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = plot(merge(_cluster()), tmp_path / "out" / "lens.png")
    assert out == tmp_path / "out" / "lens.png"
    width, height = _png_size(out)
    assert width >= 600 and height >= 600
    assert out.stat().st_size > 20_000  # heatmaps, not an empty canvas


def test_plot_copes_with_nothing_and_with_gaps(tmp_path: Path) -> None:
    _png_size(plot(merge([]), tmp_path / "empty.png"))
    snap = copy.deepcopy(_snapshot())
    snap["paths"].append(_path("node2/nic0", "node1/nic1", p50=None, loss=1.0, bad=True))  # between rails
    snap["clock"]["node2"] = {"offset_us": None, "uncertainty_us": None}
    snap["loop_residual_us"] = None
    width, height = _png_size(plot(merge([snap]), tmp_path / "gaps.png"))
    assert width > 0 and height > 0


# ----- Grafana --------------------------------------------------------------------------------


def _exprs(node: Any) -> list[str]:
    """Every PromQL string in the dashboard: panel targets and template variable queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                found.append(value)
            elif key == "definition" and isinstance(value, str) and value.startswith("label_values("):
                found.append(value)
            else:
                found += _exprs(value)
    elif isinstance(node, list):
        for item in node:
            found += _exprs(item)
    return found


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\bclockwork_[a-z0-9_]+", expr))
        assert names, f"expression without a Clockwork metric: {expr}"
        used |= names
    assert used <= METRIC_NAMES, used - METRIC_NAMES
    # The panels the dashboard promises.
    assert {
        "clockwork_lens_owd_seconds",
        "clockwork_lens_loss_ratio",
        "clockwork_lens_clock_offset_seconds",
        "clockwork_lens_clock_uncertainty_seconds",
        "clockwork_lens_suspect",
        "clockwork_lens_probes_sent_total",
        "clockwork_lens_probes_received_total",
        "clockwork_lens_probes_rejected_total",
    } <= used
    # METRIC_NAMES itself must not promise more than the exporter emits for a full snapshot.
    emitted = {
        line.split("{")[0].split(" ")[0]
        for line in render_text(_snapshot()).splitlines()
        if line and not line.startswith("#")
    }
    assert emitted == METRIC_NAMES
    # Every panel queries the dashboard's Prometheus variable.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
