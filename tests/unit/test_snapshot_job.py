"""A real local TorchPass job snapshots, is killed whole, and resumes from its snapshot bitwise.

Each test launches ``python -m torchpass run --local`` (2 ranks, gloo on 127.0.0.1, the real writer
processes) of a deterministic training with dropout, Adam and an LR scheduler. This file is also the rank
script: executed directly, it trains and writes a hash of its final model and optimizer state.

* killed whole (launcher, ranks and writers SIGKILLed at once, as when a job is lost) after a snapshot, then
  restarted with ``--restore latest``: the final state equals the fault-free run's, bit for bit;
* restarted as Slurm would requeue it (``SLURM_RESTART_COUNT=1``, no flag) with the newest snapshot
  damaged: the damaged one is rejected, the previous one is loaded, and the result is still bitwise equal;
* a periodic snapshot (``snapshot_interval_s``, planned by the coordinator) and an on-demand one
  (``clockwork snapshot take``) are written at one step by every rank and verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
STEPS = 30
RUN_TIMEOUT_S = 120


def _rank_main() -> int:
    import torch
    from torch import nn

    import torchpass as tp

    out = Path(os.environ["CW_TEST_DIR"])
    steps = int(os.environ.get("CW_TEST_STEPS", str(STEPS)))
    kill_at = int(os.environ.get("CW_TEST_KILL_AT", "-1"))
    wait_for = os.environ.get("CW_TEST_WAIT_FOR", "")
    sleep_s = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))
    pause_at, _, pause_for = os.environ.get("CW_TEST_PAUSE", "-1:").partition(":")  # "STEP:FILE"

    def wait(path: str) -> None:
        deadline = time.monotonic() + 60
        while path and not Path(path).exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    ctx = tp.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    ddp = ctx.wrap_model(model)
    opt = ctx.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, 5, 0.9))

    def batch(step: int) -> Any:
        generator = torch.Generator().manual_seed(1000 * step + ctx.slot)
        return torch.randn(16, 8, generator=generator)

    for step, x in ctx.steps(batch, steps):
        loss = ddp(x).pow(2).mean() + 0.01 * torch.rand(()).item()  # draws from the per-step RNG too
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if sleep_s:
            time.sleep(sleep_s)
        if step == int(pause_at) and ctx.slot == 0:
            wait(pause_for)  # the other slot waits in the next step's all-reduce
            # The manifest exists a moment before rank 0's snapshot thread has read the writer's answer and
            # is free for the next snapshot; on a loaded machine the next step could come first and skip it.
            assert ctx._snapshotter.wait(60), "the snapshot thread stayed busy"
        if step == kill_at and ctx.slot == 0:
            wait(wait_for)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole job: launcher, ranks, writers
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    for state in opt.state_dict()["state"].values():
        for value in state.values():
            digest.update(value.detach().numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    digest.update(json.dumps(sched.state_dict(), sort_keys=True, default=str).encode())
    (out / f"final-{ctx.slot}.json").write_text(json.dumps({"sha": digest.hexdigest(), "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests
# ======================================================================================================

from tests.unit.local_jobs import logged_events  # noqa: E402


def _launch(
    out: Path, snapdir: Path, *extra: str, env: dict[str, str] | None = None, wait: bool = True
) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CLOCKWORK_", "TORCHPASS_"))}
    environ.update({"CW_TEST_DIR": str(out), "PYTHONUNBUFFERED": "1", **(env or {})})
    command = [
        sys.executable,
        "-m",
        "torchpass",
        "run",
        "--local",
        "--nproc",
        "2",
        "--spares",
        "0",
        "--events",
        str(out / "events.jsonl"),
        "--coordinator-file",
        str(out / "coordinator"),
        "--set",
        f"snapshot_dir={snapdir}",
        *extra,
        str(SCRIPT),
    ]
    log = (out / "launcher.log").open("ab")
    proc = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if wait:
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc


def _finals(out: Path) -> list[str]:
    return [json.loads((out / f"final-{slot}.json").read_text())["sha"] for slot in range(2)]


def _events(out: Path, kind: str) -> list[dict[str, Any]]:
    """The coordinator's events (``--events``) and the ranks' (their log lines ``event KIND {json}``)."""
    found = []
    path = out / "events.jsonl"
    if path.exists():
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found += [e["fields"] for e in lines if e["kind"] == kind]
    return found + logged_events((out / "launcher.log").read_text(errors="replace"), kind)


def _log(out: Path) -> str:
    return (out / "launcher.log").read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The fault-free run's final state hash on each slot."""
    out = tmp_path_factory.mktemp("reference")
    proc = _launch(out, out / "unused-snapshots")
    assert proc.returncode == 0, _log(out)
    finals = _finals(out)
    assert finals[0] == finals[1]
    return finals


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run snapshotting every 8 steps (after steps 7 and 15), killed whole at step 19 once step 15's
    snapshot exists; returns its snapshot directory. Step 14 waits for step 7's snapshot to be written and
    rank 0's snapshot thread to be free: on a loaded machine the writers could still be busy at step 15,
    which skips that snapshot (by design: training never waits)."""
    out = tmp_path_factory.mktemp("killed")
    snapdir = out / "snapshots"
    env = {
        "CW_TEST_KILL_AT": "19",
        "CW_TEST_WAIT_FOR": str(snapdir / "step-0000000015" / "manifest.json"),
        "CW_TEST_PAUSE": f"14:{snapdir / 'step-0000000007' / 'manifest.json'}",
    }
    proc = _launch(out, snapdir, "--set", "snapshot_every_steps=8", env=env)
    assert proc.returncode == -signal.SIGKILL, _log(out)
    assert not (out / "final-0.json").exists()  # it really died before the end
    full_log = (out / "launcher.log").read_text(errors="replace")
    pids = [line.split(" pid ")[1].split()[0] for line in full_log.splitlines() if ") pid " in line]
    assert len(pids) == 2
    leftovers = [p for pid in pids for p in Path("/dev/shm").glob(f"torchpass-snapshot-{pid}-*")]
    assert not leftovers, f"a killed job left its snapshot arenas in /dev/shm: {leftovers}"
    from clockwork.contracts.snapshots.store import list_snapshots

    assert [(i.step, i.complete) for i in list_snapshots(snapdir)] == [(7, True), (15, True)], _log(out)
    return snapdir


def test_restore_latest_after_the_whole_job_was_killed(reference: list[str], killed: Path, tmp_path: Path) -> None:
    snapdir = tmp_path / "snapshots"
    shutil.copytree(killed, snapdir)
    out = tmp_path / "resumed"
    proc = _launch(out, snapdir, "--restore", "latest")
    assert proc.returncode == 0, _log(out)
    restored = _events(out, "torchpass.restored")
    assert len(restored) == 2 and {e["step"] for e in restored} == {15}
    assert _finals(out) == reference


def test_requeued_job_skips_a_damaged_snapshot(reference: list[str], killed: Path, tmp_path: Path) -> None:
    from clockwork.contracts.snapshots.store import entry_file_offset, file_entries

    snapdir = tmp_path / "snapshots"
    shutil.copytree(killed, snapdir)
    shard = snapdir / "step-0000000015" / "rank-00001.h5"
    name = next(n for n, e in sorted(file_entries(shard).items()) if n.startswith("t/") and e["nbytes"])
    offset = entry_file_offset(shard, name)
    with shard.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    out = tmp_path / "requeued"
    proc = _launch(out, snapdir, env={"SLURM_RESTART_COUNT": "1"})  # restore=auto, as after a Slurm requeue
    assert proc.returncode == 0, _log(out)
    rejected = _events(out, "torchpass.snapshot_rejected")
    assert rejected and all(e["folder"].endswith("step-0000000015") for e in rejected)
    assert any("checksum mismatch" in e["error"] for e in rejected)
    assert {e["step"] for e in _events(out, "torchpass.restored")} == {7}
    assert _finals(out) == reference


def test_nothing_good_to_restore_fails_the_job(killed: Path, tmp_path: Path) -> None:
    snapdir = tmp_path / "snapshots"
    shutil.copytree(killed, snapdir)
    for folder in snapdir.iterdir():
        (folder / "manifest.json").unlink()
    out = tmp_path / "refused"
    proc = _launch(out, snapdir, env={"SLURM_JOB_RESTART_COUNT": "2"})
    assert proc.returncode != 0
    assert "no good snapshot" in _log(out)
    assert not (out / "final-0.json").exists()  # never a silent fresh start


def test_periodic_and_on_demand_snapshots(tmp_path: Path) -> None:
    from clockwork.contracts.snapshots.store import list_snapshots, load_manifest, verify_snapshot

    out = tmp_path / "periodic"
    snapdir = out / "snapshots"
    env = {"CW_TEST_STEPS": "120", "CW_TEST_STEP_SLEEP": "0.05"}
    proc = _launch(out, snapdir, "--set", "snapshot_interval_s=2", "--set", "snapshot_keep=10", env=env, wait=False)
    try:
        deadline = time.monotonic() + 60
        while not (out / "coordinator").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        while True:  # refused until the ranks have formed their first generation and their pace is known
            asked = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "clockwork.cli.main",
                    "snapshot",
                    "take",
                    "--coordinator",
                    str(out / "coordinator"),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if asked.returncode == 0 or "cannot snapshot" not in asked.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert asked.returncode == 0, asked.stderr
        demanded = int(asked.stdout.split("after step")[1].split()[0])
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, _log(out)
    requested = _events(out, "torchpass.snapshot_requested")
    assert any(e["reason"] == "periodic" for e in requested)
    assert any(e["reason"].startswith("requested by") and e["step"] == demanded for e in requested)
    complete = [i for i in list_snapshots(snapdir) if i.complete]
    taken = demanded  # a rank still writing the previous snapshot skips it: the coordinator asks again
    while taken not in {i.step for i in complete}:
        again = [e["step"] for e in requested if e["reason"].endswith(f"skipped the one after step {taken}")]
        assert again, _log(out)
        taken = again[0]
    assert any(e["reason"] == "periodic" and e["step"] in {i.step for i in complete} for e in requested), _log(out)
    for info in complete:
        assert verify_snapshot(info.path) == []
        assert sorted(load_manifest(info.path)["files"]) == ["rank-00000.h5", "rank-00001.h5"]
