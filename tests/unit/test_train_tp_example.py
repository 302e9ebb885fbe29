"""examples/train_tp.py (TP beside HSDP, a Llama-shaped model) and examples/train_tp_plain.py (the same model in a
plain torchtitan-shaped script, transparent mode) train as the user guide says to run them: every slot ends with
the same gathered weights, and the loss falls. Their faults are the oracles' (test_torchpass_tp.py,
test_torchpass_tp_transparent.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPT = EXAMPLES / "train_tp.py"


def test_the_tp_example_trains_to_one_set_of_weights(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "4", "--spares", "0", str(SCRIPT)]
    run = subprocess.run(
        [*cmd, "--mesh", "2x1x2", "--steps", "30"], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    hashes = dict(re.findall(r"^slot (\d): final weights sha256 ([0-9a-f]{64})$", output, re.MULTILINE))
    assert sorted(hashes) == ["0", "1", "2", "3"] and len(set(hashes.values())) == 1, output[-4000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 2, losses


def test_the_plain_tp_script_trains_unchanged_in_transparent_mode(tmp_path: Path) -> None:
    """Without a replica ((dp_shard 2 x tp 2)): the script's own mesh, plan and sampler over TorchPass's mesh."""
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--transparent", "--nproc", "4", "--spares", "0"]
    script = [str(EXAMPLES / "train_tp_plain.py"), "--mesh", "1x2x2", "--samples", "128", "--epochs", "3"]
    run = subprocess.run([*cmd, *script], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    hashes = dict(re.findall(r"^rank (\d): final weights sha256 ([0-9a-f]{64})$", output, re.MULTILINE))
    assert sorted(hashes) == ["0", "1", "2", "3"] and len(set(hashes.values())) == 1, output[-4000:]
    losses = [float(v) for v in re.findall(r"^rank 0: epoch \d+ loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, losses
