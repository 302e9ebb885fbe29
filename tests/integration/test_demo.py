"""`make demo`'s command runs end to end: cluster up, training job across 3 nodes, loss curve, tear-down."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

from clockworkd.config.schema import SandboxConfig
from clockworkd.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, SandboxManager
from tests.integration.test_lifecycle import assert_nothing_left


def test_demo_runs_training_across_three_nodes_and_cleans_up(sandbox_manager: SandboxManager, short_tmp: Path) -> None:
    sandbox_manager.ensure_down()
    state = short_tmp / "demo-state"
    try:
        result = subprocess.run(
            [CLOCKWORK, "--set", f"sandbox.state_dir={state}", "demo", "--steps", "6"],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:  # even if the demo hung or was killed, leave no cluster behind
        Sandbox(replace(SandboxConfig(), state_dir=str(state))).down()
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "ended COMPLETED" in out
    losses = [float(m) for m in re.findall(r"\| step \d+ loss ([0-9.]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "loss vs step" in out and "final weights sha256" in out
    for i in (1, 2, 3):
        assert f"rank {i - 1} on node{i} (198.18.0.{i}) done" in out
    assert_nothing_left(state)
