"""`make demo`'s command runs end to end: cluster up with a daemon per node; a training job across 3 nodes with
its loss curve, carrying on while one of its NICs goes dark (LinkPass); a lossy switch port named and cleared by
Fleet Lens; a TorchPass job that loses a node and carries on at the same step, ending bitwise equal to a
fault-free run; tear-down."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, SandboxManager, worker_sandbox_config
from tests.integration.test_lifecycle import assert_nothing_left


def test_demo_survives_a_node_crash_and_cleans_up(sandbox_manager: SandboxManager, short_tmp: Path) -> None:
    sandbox_manager.ensure_down()
    state = short_tmp / "demo-state"
    try:
        result = subprocess.run(
            [CLOCKWORK, "--set", f"sandbox.state_dir={state}", "demo", "--steps", "16", "--ft-steps", "120"],
            capture_output=True,
            text=True,
            timeout=280,
        )
    finally:  # even if the demo hung or was killed, leave no cluster behind
        Sandbox(worker_sandbox_config(state)).down()
    assert result.returncode == 0, result.stdout + result.stderr
    scene1, _, rest = result.stdout.partition("Step 4.")
    lens, _, scene2 = rest.partition("Step 5.")
    assert "ended COMPLETED" in scene1
    losses = [float(m) for m in re.findall(r"\| step \d+ loss ([0-9.]+) \(\d+ ms\)", scene1)]
    assert len(losses) == 16 and losses[-1] < losses[0]
    assert "loss vs step" in scene1 and "final weights sha256" in scene1
    for i in (1, 2, 3):
        assert f"rank {i - 1} on node{i} (198.18.0.{i}) done" in scene1
    assert "The hostname of the client socket cannot be retrieved" not in result.stdout  # c10d's noise
    # LinkPass: node2's nic0 went dark mid-training, the job went on, the failover and the pause are printed.
    assert ">>> node2's nic0 goes dark now" in scene1
    assert re.search(r"LinkPass moved node2's traffic off nic0 within \d+ ms", scene1), scene1
    assert re.search(r"slowest step from then on took \d+ ms of work \(a step takes \d+ ms otherwise\)", scene1), scene1
    # Fleet Lens: the lossy port is named (and only it), then cleared.
    assert re.search(r"\| .*node3.*nic1", lens), lens
    assert "names nobody" in lens
    # Scene 2: a node of the TorchPass job crashes; the job carries on at the same step, same weights everywhere.
    assert ">>> node3 crashes now" in scene2 and "torchpass.recovered" in scene2, scene2
    recovered_at = int(re.search(r"torchpass\.recovered .*step (\d+)", scene2).group(1))  # type: ignore[union-attr]
    steps_after = [int(s) for s in re.findall(r"\| step (\d+) loss .* \(generation 1\)", scene2)]
    assert steps_after and min(steps_after) >= recovered_at and max(steps_after) == 119, scene2
    hashes = re.findall(r"slot (\d): final weights sha256 ([0-9a-f]{64})", scene2)
    assert sorted(slot for slot, _ in hashes) == ["0", "1", "2"] and len({h for _, h in hashes}) == 1, scene2
    faulted = re.search(r"final weights sha256, node crash:\s+([0-9a-f]{64})", scene2)
    fault_free = re.search(r"final weights sha256, no fault:\s+([0-9a-f]{64})", scene2)
    assert faulted and fault_free and faulted.group(1) == fault_free.group(1) == hashes[0][1], scene2
    assert "Bit for bit the same" in scene2
    assert "batch script exit 0:0" in scene2
    assert_nothing_left(Sandbox(worker_sandbox_config(state)))
