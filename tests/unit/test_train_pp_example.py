"""examples/train_pp.py (2 replicas x 2 pipeline stages of a Llama-shaped model) trains as the user guide says to
run it: the two replicas of each stage end with the same weights, the stages differ, and the loss falls. Its faults
are the oracle's (test_torchpass_pp.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_pp.py"


def test_the_pp_example_trains_each_stage_to_one_set_of_weights(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "4", "--spares", "0", str(SCRIPT)]
    run = subprocess.run(
        [*cmd, "--steps", "21", "--depth", "1"], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    found = re.findall(r"^slot (\d) \(stage (\d)\): final weights sha256 ([0-9a-f]{64})$", output, re.MULTILINE)
    hashes = {int(slot): (int(stage), digest) for slot, stage, digest in found}
    assert sorted(hashes) == [0, 1, 2, 3], output[-4000:]
    assert [hashes[s][0] for s in range(4)] == [0, 1, 0, 1], hashes
    assert hashes[0] == hashes[2] and hashes[1] == hashes[3] and hashes[0][1] != hashes[1][1], hashes
    losses = [float(v) for v in re.findall(r"^step \d+ \(slot 1\): loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 2, losses


def test_the_pp_example_with_fsdp_in_the_stages_trains_each_part_to_one_set_of_weights(tmp_path: Path) -> None:
    """``--dp-shard 2``: 8 ranks, slot r * 4 + s * 2 + k runs FSDP shard s of stage k; the two replicas of each
    (stage, shard) end with the same shards, and the loss falls."""
    cmd = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "8", "--spares", "0", str(SCRIPT)]
    run = subprocess.run(
        [*cmd, "--steps", "21", "--depth", "1", "--dp-shard", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    found = re.findall(r"^slot (\d) \(stage (\d)\): final weights sha256 ([0-9a-f]{64})$", output, re.MULTILINE)
    hashes = {int(slot): (int(stage), digest) for slot, stage, digest in found}
    assert sorted(hashes) == list(range(8)), output[-4000:]
    assert [hashes[s][0] for s in range(8)] == [0, 1] * 4, hashes
    assert all(hashes[part] == hashes[part + 4] for part in range(4)), hashes
    assert len({hashes[part][1] for part in range(4)}) == 4, hashes  # every (stage, shard) holds its own
    losses = [float(v) for v in re.findall(r"^step \d+ \(slot 1\): loss (\d+\.\d+)$", output, re.MULTILINE)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 2, losses
