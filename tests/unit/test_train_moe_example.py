"""examples/train_moe.py (expert parallelism beside HSDP, a Llama-shaped MoE model) trains as the user guide says to
run it: the two replicas of each ep coordinate end with the same weights, the two coordinates hold different
experts, and the loss falls. Its faults are the oracle's (test_torchpass_ep.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"


def test_the_moe_example_trains_each_ep_coordinate_to_one_set_of_weights(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "4", "--spares", "0", str(SCRIPT)]
    run = subprocess.run(
        [*cmd, "--mesh", "2x2", "--steps", "30"], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    hashes = dict(re.findall(r"^slot (\d): final weights sha256 ([0-9a-f]{64})$", output, re.MULTILINE))
    assert sorted(hashes) == ["0", "1", "2", "3"], output[-4000:]
    assert hashes["0"] == hashes["2"] and hashes["1"] == hashes["3"] and hashes["0"] != hashes["1"], hashes
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 2, losses
