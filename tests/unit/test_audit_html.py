"""The HTML audit report really draws: a headless Chromium renders it and its heatmaps show the fault in red."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from clockwork.audit import html_report
from clockwork.audit.verdict import judge
from clockwork.contracts.config.audit import AuditConfig
from tests.conftest import in_ci
from tests.unit.audit_raw import make_raw

RED, GREEN = html_report.RED, html_report.GREEN


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    message = "the HTML report test needs a headless Chromium (make venv installs the chromium package)"
    if in_ci():
        pytest.fail(message + " (CI must run everything)")
    pytest.skip(message + " (skipped on a developer machine only)")


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",  # root in CI; the page is our own, with no script
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_report_renders_heatmaps_with_the_faulty_link_in_red(tmp_path: Path) -> None:
    report = judge(make_raw(loss={"node2/nic0": 10.0}), AuditConfig())
    page = tmp_path / "audit.html"
    page.write_text(html_report.render(report))

    dom = _browser(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert "Clockwork Fleet Audit" in dom and ">FAIL<" in dom
    # loss, Lens's one-way delay, round trip and bandwidth for each of the two rails
    assert len(re.findall(r'<svg class="heatmap"', dom)) == 8
    assert len(re.findall(r'class="cell cell-bad"', dom)) == 6  # node2's row and column on rail nic0, loss map

    shot = tmp_path / "audit.png"
    _browser(tmp_path, "--window-size=1400,2400", f"--screenshot={shot}", page.as_uri())
    pixels = _colour_counts(Image.open(shot).convert("RGB"))
    cell_area = (html_report.CELL_W - 2) * (html_report.CELL_H - 2)
    # six red cells, minus the digits drawn on them; many green ones
    assert pixels[RED] > 6 * cell_area * 0.7, pixels[RED]
    assert pixels[GREEN] > 30 * cell_area * 0.7, pixels[GREEN]


def test_healthy_report_has_no_red_cells(tmp_path: Path) -> None:
    page = tmp_path / "audit.html"
    page.write_text(html_report.render(judge(make_raw(), AuditConfig())))
    dom = _browser(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert ">PASS<" in dom and "cell-bad" not in dom
    assert "nothing: every check passed" in dom


def _colour_counts(image: Image.Image) -> dict[tuple[int, int, int], int]:
    counts: dict[tuple[int, int, int], int] = {}
    for count, colour in image.getcolors(maxcolors=1 << 24) or []:
        counts[colour] = count
    return counts


def test_badness_scale() -> None:
    assert html_report.badness("loss_pct", 0.0, []) == 0.0
    assert html_report.badness("loss_pct", 10.0, []) == 1.0
    assert html_report.badness("gbps", 10.0, [10.0, 0.2]) == 0.0
    assert html_report.badness("gbps", 0.2, [10.0, 0.2]) == 1.0
    assert html_report.badness("rtt_us", 100.0, [100.0, 2000.0]) == 0.0
    assert html_report.badness("rtt_us", 2000.0, [100.0, 2000.0]) == 1.0
    assert html_report.colour(0.0) == "#2ca02c" and html_report.colour(1.0) == "#d62728"
