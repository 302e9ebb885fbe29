"""The demo's training job (examples/train_ddp.py) must train, converge and be bitwise reproducible.

The product demo proves "no step lost" by comparing the final-weights hash of a faulted run with a fault-free
run of the same seed, so reproducibility is tested here with real processes and a real gloo process group
(--local mode: 3 ranks on 127.0.0.1, no Slurm needed). The Slurm-environment parsing, which only runs under
srun, is tested directly on the script's functions.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
STEPS = 10
RANKS = 3
STEP_LINE = re.compile(r"^step (\d+) loss (\d+\.\d+)$", re.MULTILINE)
SHA_LINE = re.compile(r"^final weights sha256 ([0-9a-f]{64})$", re.MULTILINE)
DONE_LINE = re.compile(r"^rank (\d+) on (\S+) \((\S+)\) done$", re.MULTILINE)


def _train(seed: int) -> subprocess.CompletedProcess[str]:
    """Run the script as a user would; a generous timeout turns a rendezvous hang into a failure."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--local", str(RANKS), "--steps", str(STEPS), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Three runs shared by the tests (each costs a few seconds): seed 0 twice and seed 1 once."""
    return {"seed0": _train(0), "seed0_again": _train(0), "seed1": _train(1)}


def _ok(run: subprocess.CompletedProcess[str]) -> str:
    """The run's stdout, after asserting it succeeded (with its output in the failure message)."""
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    return run.stdout


def _sha(run: subprocess.CompletedProcess[str]) -> str:
    """The single 'final weights sha256' value of a successful run."""
    hashes = SHA_LINE.findall(_ok(run))
    assert len(hashes) == 1, run.stdout
    return hashes[0]


def test_local_run_trains_converges_and_reports_every_rank(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    stdout = _ok(runs["seed0"])

    steps = STEP_LINE.findall(stdout)
    assert [int(step) for step, _ in steps] == list(range(1, STEPS + 1)), stdout
    losses = [float(loss) for _, loss in steps]
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"

    assert "loss vs step" in stdout  # the ASCII curve a newcomer reads
    _sha(runs["seed0"])

    done = DONE_LINE.findall(stdout)
    assert sorted(int(rank) for rank, _, _ in done) == list(range(RANKS)), stdout
    # --local keeps every connection on loopback: that is the address each rank reports.
    assert {address for _, _, address in done} == {"127.0.0.1"}, stdout


def test_same_seed_gives_bitwise_identical_weights_and_another_seed_does_not(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    assert _sha(runs["seed0"]) == _sha(runs["seed0_again"])
    assert _sha(runs["seed0"]) != _sha(runs["seed1"])


# --- The Slurm side, tested on the script's own functions (no srun here) ---------------------------------


@pytest.fixture(scope="module")
def script() -> ModuleType:
    """Import the example as a module; it is a user script, not part of an installed package."""
    spec = importlib.util.spec_from_file_location("train_ddp_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node1", ["node1"]),
        ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_expand_hostlist(script: ModuleType, hostlist: str, hosts: list[str]) -> None:
    assert script.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[3-1]", "node[1-2", "node]", "node[a-b]"])
def test_expand_hostlist_rejects_malformed_lists(script: ModuleType, hostlist: str) -> None:
    with pytest.raises(script.LaunchError):
        script.expand_hostlist(hostlist)


def test_launch_from_slurm_reads_srun_variables(script: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[2-3]")  # the step's nodes win over the job's

    launch = script.launch_from_slurm(None, 60.0)
    assert (launch.rank, launch.world_size, launch.local_rank) == (2, 3, 0)
    assert launch.master_addr == "node2"
    assert launch.master_port == 29511

    monkeypatch.setenv("MASTER_PORT", "30001")
    assert script.launch_from_slurm(None, 60.0).master_port == 30001
    assert script.launch_from_slurm(30002, 60.0).master_port == 30002  # --port wins


def test_launch_outside_slurm_is_a_clear_error(script: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(script.LaunchError, match="--local"):
        script.launch_from_slurm(None, 60.0)


def test_loss_plot_has_ten_rows_and_one_column_per_step(script: ModuleType) -> None:
    losses = [1.0 / (step + 1) for step in range(40)]
    lines = script.loss_plot(losses).splitlines()
    body = [line for line in lines if "|" in line]
    assert len(body) == 10
    assert body[0].rstrip().endswith("|*")  # the highest loss sits top-left
    assert body[-1].rstrip().endswith("*")  # the lowest loss sits bottom-right
    assert lines[-2].endswith("+" + "-" * 40)
