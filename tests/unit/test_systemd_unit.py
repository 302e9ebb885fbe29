"""etc/systemd/clockworkd.service: systemd accepts it, and it starts clockworkd the way clockworkd can be started."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "etc" / "systemd" / "clockworkd.service"
SITE_VENV = "/opt/clockwork/venv/bin/"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """``systemd-analyze verify`` with the venv path pointed at this checkout's (it checks that ExecStart
    exists): no error and no warning (an unknown key is only a warning, so any output fails)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing (Debian package systemd; make venv installs it)"
    text = UNIT.read_text()
    assert f"ExecStart={SITE_VENV}clockworkd " in text
    unit = tmp_path / "clockworkd.service"
    unit.write_text(text.replace(SITE_VENV, str(Path(sys.executable).parent) + "/"))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


def test_the_unit_runs_options_clockworkd_has() -> None:
    exec_start = next(line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    options = [word for word in exec_start.split()[1:] if word.startswith("--")]
    helptext = subprocess.run(
        [str(Path(sys.executable).parent / "clockworkd"), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert options and all(option in helptext for option in options), (options, helptext)
