"""Model-transparent mode: an unmodified DDP script survives crashes and migration, bitwise.

Each test launches a real local job in transparent mode (``python -m torchpass run --local --transparent``: 3
ranks, 1 spare, gloo on 127.0.0.1). The rank script is this file, executed directly: a plain PyTorch DDP
script in the DDP-example pattern (``init_process_group``, ``DistributedDataParallel``, Adam, an LR scheduler
stepped once per epoch, a DataLoader over a ``DistributedSampler`` iterated once per epoch after
``set_epoch``, a collective of its own every step). It imports nothing from TorchPass.

Faults are injected by the script itself with ordinary PyTorch hooks, through ``CW_TEST_KILL``
(``slot:step:phase``): SIGKILL in the forward pass, inside backward while gradient buckets are being
all-reduced, or inside the optimizer step. The step is read from Adam's own step count (part of the state
that moves, so it is right on a replacement too). ``epoch`` kills it between two passes over the loader,
``freeze`` stops it with SIGSTOP instead (a silent rank whose sockets stay open), and ``node`` SIGKILLs its
whole process group (rank and Slurm-mode agent: a node crash). ``crashnode`` (forward), ``crashnode-backward``
and ``crashnode-optimizer`` (sandbox tests) write ``crash-request-<slot>-<step>`` naming the Slurm node and wait
there for the test to crash that node. A marker file makes each kill happen once.
``CW_TEST_HOLD`` (``step:file``) holds every slot at that step until the file exists.
``CW_TEST_STEP_FILE`` (``slot:step``) makes that slot write ``at-step`` when it reaches the step, so a test can
act (``clockwork migrate``) while the job runs slowed down by ``CW_TEST_STEP_SLEEP``.
``CW_TEST_VARIANT`` makes the script leave what transparent mode can protect (for the start-up checks).

The oracle: every tensor of the final model, optimizer state and scheduler state of every slot is
``torch.equal`` to the fault-free run's; Adam's step count is the number of batches; the coordinator finished
with every member at the last step; the slot was taken over by another process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
EXAMPLE = SCRIPT.parents[2] / "examples" / "train_ddp_torchrun.py"
NPROC = 3
EPOCHS = 3
SAMPLES = 240
BATCH = 8
STEPS_PER_EPOCH = SAMPLES // (BATCH * NPROC)  # 10
STEPS = EPOCHS * STEPS_PER_EPOCH
RUN_TIMEOUT_S = 150


# ======================================================================================================
# The rank script: an unmodified DDP training script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = Path(os.environ["CW_TEST_DIR"])
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    step_file = os.environ.get("CW_TEST_STEP_FILE", "")
    step_sleep = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))
    hold_step, _, hold_file = os.environ.get("CW_TEST_HOLD", "-1:").partition(":")
    variant = os.environ.get("CW_TEST_VARIANT", "")

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (out / f"pid-slot{rank}-{os.getpid()}").write_text("")

    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4)
    )
    ddp = DDP(model, bucket_cap_mb=0.002)  # ~one bucket per layer: kills land between all-reduces
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    first = next(iter(model.parameters()))

    def step_no() -> int:
        state = opt.state.get(first)
        return int(state["step"]) if state else 0

    def maybe_kill(phase: str) -> None:
        when = step_no()
        if (str(rank), str(when), phase) not in kills:
            return
        try:
            fd = os.open(out / f"killed-{rank}-{when}-{phase}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # already done once: the replacement must not kill itself too
        os.close(fd)
        if phase.startswith("crashnode"):  # sandbox tests: the test crashes this whole node; wait here until then
            node = os.environ.get("SLURMD_NODENAME", "")
            (out / f"crash-request-{rank}-{when}").write_text(f"{node} {time.time()}\n")
            while True:
                time.sleep(1)
        if phase == "node":  # Slurm-mode tests: the whole "node", this rank and its agent (one process group)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP if phase == "freeze" else signal.SIGKILL)

    model.register_forward_pre_hook(lambda *_: maybe_kill("forward"))
    model.register_forward_pre_hook(lambda *_: maybe_kill("node"))
    model.register_forward_pre_hook(lambda *_: maybe_kill("freeze"))
    model.register_forward_pre_hook(lambda *_: maybe_kill("crashnode"))
    model[0].weight.register_hook(lambda grad: maybe_kill("backward"))  # late in backward
    model[0].weight.register_hook(lambda grad: maybe_kill("crashnode-backward"))
    opt.register_step_pre_hook(lambda *_: maybe_kill("optimizer"))
    opt.register_step_pre_hook(lambda *_: maybe_kill("crashnode-optimizer"))

    generator = torch.Generator().manual_seed(7)
    x_all = torch.randn(SAMPLES, 16, generator=generator)
    y_all = x_all @ torch.randn(16, 4, generator=generator) + 0.1 * torch.randn(SAMPLES, 4, generator=generator)
    dataset = TensorDataset(x_all, y_all)
    if variant == "no-sampler":
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=False)
        sampler = None
    else:
        sampler = DistributedSampler(dataset, shuffle=True, seed=3, drop_last=True)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    if variant == "second-loader":  # e.g. a validation set: not tracked, a start-up warning
        DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))

    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        epoch_loss = torch.zeros(1)
        for x, y in loader:
            if step_file and step_file == f"{rank}:{step_no()}":
                (out / "at-step").write_text(str(time.time()))
            while step_no() == int(hold_step) and not Path(hold_file).exists():
                time.sleep(0.05)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            if variant != "no-optimizer-step":
                opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # a collective of the script's own, inside the step
            epoch_loss += mean
            if step_sleep:
                time.sleep(step_sleep)
        maybe_kill("epoch")  # between two passes over the loader
        dist.all_reduce(epoch_loss)  # a collective of the script's own, between steps
        sched.step()

    final = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "pid": os.getpid()}
    torch.save(final, out / f"final-slot{rank}.pt")
    print(f"slot {rank}/{world} done at Adam step {step_no()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

# After the rank script: its processes must not need ``tests`` importable.
from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final, local_command  # noqa: E402


class Run(FinishedJob):
    """One finished job: its folder, launcher exit status and output, and the coordinator's events."""

    def final(self, slot: int) -> dict[str, Any]:
        return load_final(self.out, slot)

    def pids(self, slot: int) -> set[int]:
        return {int(p.name.rsplit("-", 1)[1]) for p in self.out.glob(f"pid-slot{slot}-*")}


def _command(out: Path, script: Path, *, spares: int = 1, nproc: int = NPROC, flag: bool = True) -> list[str]:
    flags = ["--transparent"] if flag else []
    options = ["--coordinator-file", str(out / "coordinator")]
    return local_command(out, script, nproc=nproc, spares=spares, flags=flags, options=options)


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CW_TEST_")}
    env.update(CW_TEST_DIR=str(out), **extra)
    return env


def _run(
    base: Path, name: str, *, spares: int = 1, nproc: int = NPROC, settings: tuple[str, ...] = (), **extra: str
) -> Run:
    out = base / name
    out.mkdir()
    cmd = _command(out, SCRIPT, spares=spares, nproc=nproc)
    cmd[-1:-1] = [arg for setting in settings for arg in ("--set", setting)]
    proc = subprocess.run(
        cmd, env=_env(out, **extra), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    return Run(out, proc.returncode, proc.stdout + proc.stderr)


def _training_state(final: dict[str, Any]) -> dict[str, Any]:
    return {k: final[k] for k in ("model", "optim", "sched")}


def _assert_same_final_state(run: Any, reference: Any, *, nproc: int = NPROC, steps: int = STEPS) -> None:
    """Every slot of ``run`` (a local, Slurm-mode or sandbox run: anything with ``out`` and ``of_kind``) ends
    bitwise equal to the fault-free reference, and the coordinator finished with every member at the last step."""
    expected = _training_state(load_final(reference.out, 0))
    for slot in range(nproc):
        assert_bitwise_equal(_training_state(load_final(run.out, slot)), expected, f"slot {slot}")
    finished = run.of_kind("torchpass.finished")
    assert finished and finished[-1]["committed"] == [steps - 1], finished


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-transparent")


@pytest.fixture(scope="module")
def reference(base: Path) -> Run:
    """The fault-free run every faulted run must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_run_trains_every_batch_once(reference: Run) -> None:
    import torch

    final = reference.final(0)
    steps = {int(s["step"]) for s in final["optim"]["state"].values()}
    assert steps == {STEPS}, f"Adam took {steps} steps, the loader has {STEPS} batches per rank"
    assert final["sched"]["last_epoch"] == EPOCHS
    for slot in range(1, NPROC):
        assert_bitwise_equal(_training_state(reference.final(slot)), _training_state(final), f"slot {slot}")
    assert not reference.of_kind("torchpass.recovered")
    started = reference.of_kind("torchpass.started")
    assert len(started) == 1 and started[0]["generation"] == 0
    # Training happened: the weights moved away from their initialisation.
    torch.manual_seed(1234)
    initial = torch.nn.Linear(16, 32).weight
    assert not torch.equal(final["model"]["0.weight"], initial)


@pytest.mark.parametrize(
    ("kill", "slot"),
    [
        ("1:4:forward", 1),  # epoch 0
        ("2:13:backward", 2),  # epoch 1: the newcomer fast-forwards one pass (and one scheduler step)
        ("1:24:optimizer", 1),  # epoch 2
        ("0:17:forward", 0),  # rank 0, whose store hosted generation 0's rendezvous
        # The first step of a pass, after the survivors ran the pass's epilogue (the script's all_reduce and
        # scheduler step): the newcomer skips it, the survivors' rollback keeps it.
        ("2:10:backward", 2),
    ],
    ids=["forward", "backward-allreduce", "optimizer-step", "rank0", "first-step-of-a-pass"],
)
def test_sigkill_recovers_bitwise(base: Path, reference: Run, kill: str, slot: int) -> None:
    run = _run(base, "kill-" + kill.replace(":", "-"), CW_TEST_KILL=kill)
    run.check_ok()
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    _assert_same_final_state(run, reference)
    assert len(run.pids(slot)) == 2, "the slot was not taken over by another process"
    assert run.final(slot)["pid"] != min(run.pids(slot)) or len(run.pids(slot)) == 2
    recovered = [f for f in run.of_kind("torchpass.recovered") if slot in f["slots"]]
    assert recovered and recovered[0]["transfer_bytes"] > 0, run.of_kind("torchpass.recovered")
    assert len(run.of_kind("torchpass.member_failed")) == 1


def test_sigkill_between_epochs(base: Path, reference: Run) -> None:
    """Rank 1 dies after its last batch of epoch 1, before the script's own between-epoch all_reduce: the
    survivors' all_reduce fails, they recover and run it again with the newcomer, which fast-forwarded two
    passes (skipping their collectives and scheduler steps) to get there."""
    run = _run(base, "kill-between-epochs", CW_TEST_KILL="1:20:epoch")
    run.check_ok()
    assert (run.out / "killed-1-20-epoch").exists(), "the fault was not injected"
    _assert_same_final_state(run, reference)
    assert len(run.pids(1)) == 2
    assert "collective between steps failed" in run.output


def test_silent_rank_is_evicted_and_replaced(base: Path, reference: Run) -> None:
    """A rank frozen with SIGSTOP keeps its sockets open: only its missing heartbeats reveal it. The
    survivors' blocked all-reduce (inside the script's backward) is aborted by the new generation."""
    run = _run(
        base,
        "freeze",
        settings=("heartbeat_timeout_s=2", "heartbeat_interval_s=0.2"),
        CW_TEST_KILL="1:15:freeze",
    )
    run.check_ok()
    _assert_same_final_state(run, reference)
    failed = run.of_kind("torchpass.member_failed")
    assert len(failed) == 1 and "no heartbeat" in failed[0]["why"], failed
    assert len(run.pids(1)) == 2


def test_two_failures_in_different_epochs(base: Path, reference: Run) -> None:
    run = _run(base, "two-failures", CW_TEST_KILL="1:8:backward,2:22:optimizer")
    run.check_ok()
    _assert_same_final_state(run, reference)
    assert len(run.pids(1)) == 2 and len(run.pids(2)) == 2
    assert len(run.of_kind("torchpass.member_failed")) == 2


def test_planned_migration_with_torchpass_migrate(base: Path, reference: Run) -> None:
    """``clockwork migrate --coordinator`` while the unmodified script trains: slot 2 moves to the spare at a step
    boundary."""
    from clockwork.cli.main import run as clockwork

    out = base / "migrate"
    out.mkdir()
    proc = subprocess.Popen(
        _command(out, SCRIPT),
        env=_env(out, CW_TEST_STEP_FILE="2:12", CW_TEST_STEP_SLEEP="0.15"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out / "at-step").exists():
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "slot 2 never reached step 12"
            time.sleep(0.05)
        assert clockwork(["migrate", "--coordinator", str(out / "coordinator"), "--rank", "2"]) == 0
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    run = Run(out, proc.returncode, output)
    run.check_ok()
    _assert_same_final_state(run, reference)
    assert len(run.pids(2)) == 2
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [2] and migrated[0]["handoff_ok"], migrated
    departed = run.of_kind("torchpass.departed")
    assert departed and departed[0]["handoff_ok"] and departed[0]["handoff_bytes"] > 0, departed
    assert not run.of_kind("torchpass.member_failed")


def test_snapshot_then_whole_job_killed_restores_bitwise(base: Path, reference: Run) -> None:
    """Snapshots in transparent mode: the unmodified script snapshots every 8 steps; once step 15's snapshot
    is complete the whole job (launcher, ranks, spare, writers) is SIGKILLed; ``--restore latest`` resumes it
    from that snapshot, mid-epoch, and it ends bitwise equal to the fault-free run."""
    snapdir = base / "snapshots-transparent"
    out = base / "snapshot-killed"
    out.mkdir()
    cmd = _command(out, SCRIPT)
    cmd[-1:-1] = ["--set", f"snapshot_dir={snapdir}", "--set", "snapshot_every_steps=8"]
    proc = subprocess.Popen(
        cmd,
        env=_env(out, CW_TEST_STEP_SLEEP="0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the kill below takes the whole job and only it
    )
    manifest = snapdir / "step-0000000015" / "manifest.json"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not manifest.exists():
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "no complete snapshot of step 15"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert not (out / "final-slot0.pt").exists(), "the job ended before it was killed"

    out2 = base / "snapshot-restored"
    out2.mkdir()
    cmd = _command(out2, SCRIPT)
    cmd[-1:-1] = ["--set", f"snapshot_dir={snapdir}", "--restore", "latest"]
    done = subprocess.run(cmd, env=_env(out2), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    run = Run(out2, done.returncode, done.stdout + done.stderr)
    run.check_ok()
    restored = [line for line in run.output.splitlines() if " event torchpass.restored " in line]
    assert len(restored) == NPROC, run.output[-6000:]
    steps = {json.loads(line.split(" event torchpass.restored ", 1)[1])["step"] for line in restored}
    assert steps and min(steps) >= 15, restored  # from the snapshot (or a later one), not from the start
    _assert_same_final_state(run, reference)


def test_script_without_distributed_sampler_is_refused_with_a_warning(base: Path) -> None:
    run = _run(base, "no-sampler", spares=0, nproc=2, CW_TEST_VARIANT="no-sampler")
    assert run.returncode != 0, run.output[-4000:]
    assert "a DataLoader without a DistributedSampler" in run.output, run.output[-4000:]
    assert "the model trains on batches from a loader TorchPass cannot see" in run.output, run.output[-4000:]
    assert not (run.out / "final-slot0.pt").exists()


def test_strict_mode_turns_a_start_up_warning_into_an_error(base: Path) -> None:
    """A second DistributedSampler loader is only a warning; with transparent_strict it stops the job."""
    lenient = _run(base, "second-loader", spares=0, nproc=2, CW_TEST_VARIANT="second-loader")
    lenient.check_ok()
    assert "further DataLoader(s) are not tracked" in lenient.output
    strict = _run(
        base,
        "second-loader-strict",
        spares=0,
        nproc=2,
        settings=("transparent_strict=true",),
        CW_TEST_VARIANT="second-loader",
    )
    assert strict.returncode != 0, strict.output[-4000:]
    assert "transparent mode (transparent_strict): 1 further DataLoader(s) are not tracked" in strict.output
    assert not (strict.out / "final-slot0.pt").exists()


def test_first_step_without_optimizer_step_is_an_error(base: Path) -> None:
    run = _run(base, "no-optimizer-step", spares=0, nproc=2, CW_TEST_VARIANT="no-optimizer-step")
    assert run.returncode != 0, run.output[-4000:]
    assert "ran no optimizer step" in run.output, run.output[-4000:]
    assert not (run.out / "final-slot0.pt").exists()


def test_example_script_runs_unmodified(base: Path) -> None:
    """examples/train_ddp_torchrun.py, as shipped, in a job whose only sign of the mode is the SPANK plugin's
    CLOCKWORK_FT=transparent (no --transparent): every rank ends with the same weights."""
    out = base / "example"
    out.mkdir()
    cmd = [*_command(out, EXAMPLE, spares=0, nproc=2, flag=False), "--epochs", "2"]
    env = _env(out, CLOCKWORK_FT="transparent")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    hashes = {line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if "final weights sha256" in line}
    assert len(hashes) == 1 and len(next(iter(hashes))) == 64, proc.stdout
    assert "epoch 1 mean loss" in proc.stdout
    assert "TorchPass owns the process group" in proc.stderr  # it ran under the bootstrap, not bare


def test_slurm_mode_node_crash_with_clockwork_ft_transparent(base: Path, reference: Run) -> None:
    """Slurm mode (one agent per simulated node, as in test_torchpass_agents), selected by the SPANK plugin's
    CLOCKWORK_FT=transparent alone: node 0 (slot 0 and the coordinator's leader) dies in epoch 1, agent and
    rank together; the standby node takes slot 0 and the job ends bitwise equal to the local fault-free run."""
    from tests.unit.test_torchpass_agents import _run_agents

    run = _run_agents(base, "slurm-node-crash", kill="0:13:node", script=SCRIPT, ft="transparent")
    assert run.codes == [-signal.SIGKILL, 0, 0, 0], f"agent exit codes {run.codes}\n{run.output[-12000:]}"
    _assert_same_final_state(run, reference)
    generation = next(g for g in run.of_kind("torchpass.generation") if g["replaced"])
    assert generation["replaced"] == {"0": "a3.0"}, generation
    assert "clockwork-ft transparent" in run.output
