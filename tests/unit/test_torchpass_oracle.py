"""TorchPass's oracle: runs with injected faults end bitwise equal to the fault-free run, no step lost or doubled.

Each test launches a real local job (``python -m torchpass run --local``: 3 ranks, 1 spare, gloo on
127.0.0.1, ports chosen by the kernel) of a deterministic training with dropout, Adam, an LR scheduler and a
small piece of registered user state. This file is also the rank script: executed directly, it trains.

Faults are injected by the rank script itself through ``CW_TEST_KILL`` (``slot:step:phase``, comma
separated): it SIGKILLs its own process in the forward pass, inside backward while gradient buckets are being
all-reduced, or inside the optimizer step; ``freeze`` stops it with SIGSTOP instead (a silent rank whose
sockets stay open). ``node`` and ``nodestop`` (Slurm-mode tests) SIGKILL or SIGSTOP the rank's whole process
group, that is the rank and its node agent together: a node crash. ``crashnode`` (in the forward pass),
``crashnode-backward`` and ``crashnode-optimizer`` (sandbox tests) write
``crash-request-<slot>-<step>`` naming its Slurm node and waits there for the test to crash that whole node
(``clockwork sandbox fault node NODE crash``). ``slot:gen:transfer`` kills the rank
while it sends or receives state during the recovery into generation ``gen`` (a failure during recovery).
A marker file makes each kill happen once, so the replacement in the same slot does not kill itself too.
``after-update`` kills it right after its optimizer step, and ``CW_TEST_USER_COLLECTIVE=1`` makes every step
end with a ``ctx.all_reduce`` of the loss (a collective after the update).
``CW_TEST_STEP_SLEEP`` (seconds) slows every step down, so a test can act while the job runs.
``CW_TEST_HOLD`` (``step:file``) holds every slot at the start of ``step`` until ``file`` exists, so a test can
act while the job is surely still running, however slow the machine.
``CW_TEST_MIGRATE`` (``slot:step``) makes a rank request the planned migration of ``slot`` at ``step``.

The oracle:

* every tensor of the final model, optimizer state, scheduler state and registered state of every slot is
  ``torch.equal`` (same dtype and bits) to the fault-free run's;
* each slot's journal (a line per committed step, and a line when the slot adopted state sent by a replica)
  shows every step 0..N-1 committed exactly once, in order, no step skipped or done twice;
* the coordinator's events show the failure, the new generation and the recovery with its timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
STEPS = 36
NPROC = 3
RUN_TIMEOUT_S = 150


# ======================================================================================================
# The rank script (runs in each rank and spare process)
# ======================================================================================================


class _Tally:
    """User state registered with TorchPass: samples seen (must roll back with an abandoned step)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = int(state["samples"])


def _rank_main() -> int:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import torchpass as tp

    out = Path(os.environ["CW_TEST_DIR"])
    steps = int(os.environ.get("CW_TEST_STEPS", str(STEPS)))
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    migrate = os.environ.get("CW_TEST_MIGRATE", "")
    step_sleep = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))
    hold_step, _, hold_file = os.environ.get("CW_TEST_HOLD", "-1:").partition(":")

    def journal(slot: int, line: str) -> None:
        with open(out / f"journal-slot{slot}.txt", "a") as f:
            f.write(f"{line} {os.getpid()}\n")

    def maybe_kill(slot: int, when: int, phase: str) -> None:
        if (str(slot), str(when), phase) not in kills:
            return
        try:
            fd = os.open(out / f"killed-{slot}-{when}-{phase}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # already done once: the replacement must not kill itself too
        os.write(fd, f"{time.time()}\n".encode())
        os.close(fd)
        if phase.startswith("crashnode"):  # the test crashes this whole node; wait here until then
            node = os.environ.get("SLURMD_NODENAME", "")
            (out / f"crash-request-{slot}-{when}").write_text(f"{node} {time.time()}\n")
            while True:
                time.sleep(1)
        if phase in ("node", "nodestop"):  # the whole "node": this rank and its agent (one process group)
            os.killpg(os.getpgrp(), signal.SIGSTOP if phase == "nodestop" else signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP if phase == "freeze" else signal.SIGKILL)

    def sink(kind: str, fields: dict[str, Any]) -> None:
        if kind == "torchpass.joined" and fields["received"]:
            journal(fields["slot"], f"adopt {fields['generation']} {fields['resume_step'] - 1}")
        if kind == "torchpass.transfer":
            maybe_kill(ctx.slot, fields["generation"], "transfer")

    ctx = tp.init(event_sink=sink)

    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4)
    )
    ddp = ctx.wrap_model(model, bucket_cap_mb=0.002)  # ~one bucket per layer: kills land between all-reduces
    opt = ctx.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5))
    tally = ctx.register("tally", _Tally())
    ctx.on_commit(lambda step: journal(ctx.slot, f"commit {ctx.generation} {step}"))

    model.register_forward_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "forward"))
    model.register_forward_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "freeze"))
    model.register_forward_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "node"))
    model.register_forward_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "nodestop"))
    model.register_forward_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "crashnode"))
    model[0].weight.register_hook(lambda grad: maybe_kill(ctx.slot, ctx.step, "backward"))  # late in backward
    model[0].weight.register_hook(lambda grad: maybe_kill(ctx.slot, ctx.step, "crashnode-backward"))
    opt.register_step_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "optimizer"))
    opt.register_step_pre_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "crashnode-optimizer"))
    opt.register_step_post_hook(lambda *_: maybe_kill(ctx.slot, ctx.step, "after-update"))
    user_collective = os.environ.get("CW_TEST_USER_COLLECTIVE", "") == "1"

    generator = torch.Generator().manual_seed(7)
    x_all = torch.randn(480, 16, generator=generator)
    y_all = x_all @ torch.randn(16, 4, generator=generator) + 0.1 * torch.randn(480, 4, generator=generator)
    loader = tp.StepLoader(TensorDataset(x_all, y_all), batch_size=8, seed=3)

    for step, (x, y) in ctx.steps(loader, steps):
        while step == int(hold_step) and not Path(hold_file).exists():
            time.sleep(0.05)
        if migrate:
            slot, when = (int(v) for v in migrate.split(":"))
            asker = 1 if slot == 0 else 0
            if ctx.slot == asker and step == when and not (out / "migrate-requested").exists():
                (out / "migrate-requested").write_text(json.dumps(ctx.request_migration(slot)))
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if user_collective:  # a loss averaged for a log line, after the update
            ctx.all_reduce(loss.detach().clone())
        tally.samples += len(x)
        if step_sleep:
            time.sleep(step_sleep)

    final = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "tally": tally.state_dict(),
        "committed": ctx.committed_step,
    }
    torch.save(final, out / f"final-slot{ctx.slot}.pt")
    print(f"slot {ctx.slot} done at step {ctx.committed_step} (generation {ctx.generation})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

# After the rank script: its processes must not need ``tests`` importable.
from tests.unit.local_jobs import JobResult, assert_bitwise_equal, load_final, local_command  # noqa: E402


@dataclass
class Run(JobResult):
    """One finished job: its folder, launcher exit status and output, and the coordinator's events."""

    out: Path
    returncode: int
    output: str
    events: list[dict[str, Any]]


def _run(
    base: Path,
    name: str,
    *,
    kill: str = "",
    migrate: str = "",
    spares: int = 1,
    settings: tuple[str, ...] = (),
    user_collective: bool = False,
) -> Run:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_MIGRATE=migrate, CW_TEST_STEPS=str(STEPS))
    env["CW_TEST_USER_COLLECTIVE"] = "1" if user_collective else ""
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=spares, settings=settings)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    events_file = out / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    return Run(out, proc.returncode, proc.stdout + proc.stderr, events)


def _final(run: Run, slot: int) -> dict[str, Any]:
    return load_final(run.out, slot)


def _assert_same_final_state(run: Run, reference: Run, *, nproc: int = NPROC, steps: int = STEPS) -> None:
    expected = _final(reference, 0)
    assert expected["committed"] == steps - 1
    for slot in range(nproc):
        assert_bitwise_equal(_final(run, slot), expected, f"slot {slot}")


def _journal(run: Run, slot: int) -> list[tuple[str, int, int, int]]:
    lines = (run.out / f"journal-slot{slot}.txt").read_text().splitlines()
    return [(kind, int(gen), int(step), int(pid)) for kind, gen, step, pid in (line.split() for line in lines)]


def _assert_each_step_once(
    run: Run, *, nproc: int = NPROC, steps: int = STEPS
) -> dict[int, list[tuple[str, int, int, int]]]:
    """Per slot: commits are 0..N-1 in order, each once; an adopted state is the step the slot had to reach."""
    journals = {}
    for slot in range(nproc):
        entries = _journal(run, slot)
        next_step = 0
        for kind, _gen, step, _pid in entries:
            if kind == "commit":
                assert step == next_step, f"slot {slot}: committed {step}, expected {next_step}: {entries}"
                next_step = step + 1
            else:  # adopted a replica's state as of `step`: the step it was doing, or (fresh start) -1 / the last
                assert step in (next_step - 1, next_step), f"slot {slot}: adopted {step} at {next_step}: {entries}"
                next_step = step + 1
        assert next_step == steps, f"slot {slot} ended at {next_step}: {entries}"
        journals[slot] = entries
    return journals


def _recovered(run: Run, slot: int) -> dict[str, Any]:
    matches = [f for f in run.of_kind("torchpass.recovered") if slot in f["slots"]]
    assert matches, f"no recovery of slot {slot}: {run.of_kind('torchpass.recovered')}\n{run.output[-4000:]}"
    fields = matches[0]
    for key in ("detect_ms", "rebuild_ms", "transfer_ms", "total_ms", "spare_ready_ms"):
        assert key in fields, f"{key} missing from {fields}"
    print(f"recovered slot {slot}: {json.dumps(fields, sort_keys=True)}")
    return fields


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-oracle")


@pytest.fixture(scope="module")
def reference(base: Path) -> Run:
    """The fault-free run every faulted run must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_run_is_consistent(reference: Run) -> None:
    _assert_each_step_once(reference)
    assert not reference.of_kind("torchpass.recovered")
    started = reference.of_kind("torchpass.started")
    assert len(started) == 1 and started[0]["generation"] == 0
    expected = _final(reference, 0)
    for slot in range(1, NPROC):  # the replicas agree with each other
        assert_bitwise_equal(_final(reference, slot), expected, f"slot {slot}")
    assert expected["tally"]["samples"] == STEPS * 8


def test_fresh_interpreters_train_bitwise_like_the_zygotes_forks(base: Path, reference: Run) -> None:
    """``zygote = false``: every process starts its own interpreter, and a SIGKILL still recovers; the result is
    the reference's (made by processes forked from the zygote), bit for bit."""
    run = _run(base, "no-zygote", kill="2:10:backward", settings=("zygote=false",))
    run.check_ok()
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    _recovered(run, 2)


@pytest.mark.parametrize(
    ("kill", "slot"),
    [
        ("1:9:forward", 1),
        ("2:13:backward", 2),
        ("1:17:optimizer", 1),
        ("0:11:forward", 0),  # rank 0, whose store hosted generation 0's rendezvous
    ],
    ids=["forward", "backward-allreduce", "optimizer-step", "rank0"],
)
def test_sigkill_recovers_bitwise(base: Path, reference: Run, kill: str, slot: int) -> None:
    run = _run(base, "kill-" + kill.replace(":", "-"), kill=kill)
    run.check_ok()
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[slot]}) == 2, "the slot was not taken over by another process"
    fields = _recovered(run, slot)
    assert fields["transfer_bytes"] > 0


def test_failure_after_the_update_commits_the_step(base: Path, reference: Run) -> None:
    """Slot 1 dies right after its optimizer step; the survivors, also past their update, see it in the script's
    own ctx.all_reduce. The step is not abandoned (a redo would apply the update twice): it commits, and the
    recovery follows at once."""
    run = _run(base, "after-update", kill="1:15:after-update", user_collective=True)
    run.check_ok()
    assert (run.out / "killed-1-15-after-update").exists(), "the fault was not injected"
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[1]}) == 2
    assert "collective failed after the step's update" in run.output
    _recovered(run, 1)


def test_two_failures_five_steps_apart(base: Path, reference: Run) -> None:
    run = _run(base, "two-failures", kill="1:8:backward,2:13:optimizer")
    run.check_ok()
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[1]}) == 2 and len({pid for *_, pid in journals[2]}) == 2
    _recovered(run, 1)
    _recovered(run, 2)
    assert len(run.of_kind("torchpass.member_failed")) == 2


def test_failure_during_recovery(base: Path, reference: Run) -> None:
    """Slot 2 dies at step 10; slot 0, the replica sending its state to the spare in generation 1, dies then."""
    run = _run(base, "during-recovery", kill="2:10:forward,0:1:transfer")
    run.check_ok()
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    failed = run.of_kind("torchpass.member_failed")
    assert len(failed) == 2 and failed[1]["generation"] == 1, failed
    assert max(f["generation"] for f in run.of_kind("torchpass.recovered")) >= 2


def test_planned_migration(base: Path, reference: Run) -> None:
    run = _run(base, "migrate", migrate="2:12")
    run.check_ok()
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[2]}) == 2
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [2] and migrated[0]["handoff_ok"], migrated
    departed = run.of_kind("torchpass.departed")
    assert departed and departed[0]["handoff_ok"]
    assert not run.of_kind("torchpass.member_failed")
    print(f"migrated slot 2: {json.dumps(migrated[0], sort_keys=True)}")


def test_silent_rank_is_evicted_and_replaced(base: Path, reference: Run) -> None:
    """A rank frozen with SIGSTOP keeps its sockets open: only its missing heartbeats reveal it. The survivors'
    blocked all-reduce is aborted when the new generation is announced, long before the collective timeout."""
    # The collective timeout lies past the run's own timeout: a run that finished at all did not wait for it.
    settings = ("heartbeat_timeout_s=2", "heartbeat_interval_s=0.2", f"collective_timeout_s={4 * RUN_TIMEOUT_S}")
    run = _run(base, "freeze", kill="1:10:freeze", settings=settings)
    run.check_ok()
    _assert_same_final_state(run, reference)
    _assert_each_step_once(run)
    failed = run.of_kind("torchpass.member_failed")
    assert len(failed) == 1 and "no heartbeat" in failed[0]["why"]
    _recovered(run, 1)
