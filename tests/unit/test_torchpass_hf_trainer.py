"""An unmodified Hugging Face ``Trainer`` DDP script in transparent mode: SIGKILLs at random moments and a planned
migration, each ending bitwise equal, per slot, to the fault-free TorchPass run.

This file is also the rank script (run by ``torchpass run --local --transparent``: 2 ranks, 1 spare, gloo on
127.0.0.1). It is an ordinary Trainer script: a tiny GPT-2 built from a config (dropout on, nothing downloaded),
``TrainingArguments(use_cpu=True, ddp_backend="gloo")`` with ``gradient_accumulation_steps=2`` (accelerate's
``DataLoaderShard`` over its ``SeedableRandomSampler``, the default linear LR schedule, the loss gathered across
ranks to log it every 3 steps: a collective inside a step) and a stateful callback of the script's own (it counts
the optimizer steps it saw). It imports nothing from TorchPass.

Faults (``CW_TEST_KILL``, ``slot:batch:phase`` comma separated): SIGKILL in the forward pass, in backward (a
gradient hook) or before the optimizer step (only at a window's last batch). ``batch`` counts batches across
epochs as ``global_step * accumulation + batch within the window``, from the Trainer's state, which moves with the
state. A marker file makes each kill happen once. ``CW_TEST_STEP_FILE`` (``slot:batch``) makes that slot write
``at-step`` there, for a test to start ``clockwork migrate``.

The oracle: every tensor of the final model, optimizer and LR scheduler state of every slot, the Trainer's
``global_step`` and ``epoch``, and the callback's count, equal to the fault-free run's (one shared reference run).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
NPROC = 2
SAMPLES = 64
BATCH = 4
EPOCHS = 2
ACCUMULATE = 2
BATCHES_PER_EPOCH = SAMPLES // (BATCH * NPROC)  # 8
BATCHES = EPOCHS * BATCHES_PER_EPOCH  # 16
OPTIMIZER_STEPS = BATCHES // ACCUMULATE  # 8
PHASES = ("forward", "backward", "optimizer")
RUN_TIMEOUT_S = 240


def _rank_main() -> int:
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import ExportableState

    out = Path(os.environ["CW_TEST_DIR"])
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    step_file = os.environ.get("CW_TEST_STEP_FILE", "")
    step_sleep = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))
    rank = int(os.environ["RANK"])
    (out / f"pid-slot{rank}-{os.getpid()}").write_text("")

    class Tokens(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (SAMPLES, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Faults(TrainerCallback, ExportableState):
        """Counts the optimizer steps it saw (state of the script's own) and injects the faults."""

        def __init__(self) -> None:
            self.steps_seen = 0
            self.in_window = 0
            self.state_now: Any = None

        def state(self) -> dict[str, Any]:
            return {"args": {}, "attributes": {"steps_seen": self.steps_seen}}

        def batch_no(self) -> int:
            return int(self.state_now.global_step) * ACCUMULATE + self.in_window

        def maybe_kill(self, phase: str) -> None:
            when = self.batch_no()
            if (str(rank), str(when), phase) not in kills:
                return
            try:
                fd = os.open(out / f"killed-{rank}-{when}-{phase}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # already done once: the replacement must not kill itself too
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.state_now = state

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.state_now, self.in_window = state, 0

        def forward(self) -> None:
            if step_file == f"{rank}:{self.batch_no()}":
                (out / "at-step").write_text(str(time.time()))
            if step_sleep:
                time.sleep(step_sleep)
            self.maybe_kill("forward")

        def backward(self) -> None:
            self.maybe_kill("backward")

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.in_window += 1

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.maybe_kill("optimizer")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps_seen += 1

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    faults = Faults()
    model.register_forward_pre_hook(lambda module, inputs: faults.forward() if module.training else None)
    model.transformer.wte.weight.register_hook(lambda grad: faults.backward())
    args = TrainingArguments(
        output_dir=str(out / "hf-out"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        num_train_epochs=EPOCHS,
        learning_rate=1e-2,
        logging_steps=3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[faults])
    trainer.train()
    final = {
        "model": trainer.model.state_dict(),
        "optim": trainer.optimizer.state_dict(),
        "sched": trainer.lr_scheduler.state_dict(),
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "steps_seen": faults.steps_seen,
        "pid": os.getpid(),
    }
    torch.save(final, out / f"final-slot{rank}.pt")
    print(f"slot {rank} done at global step {trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

# After the rank script: its processes must not need ``tests`` importable.
from tests.unit.local_jobs import FinishedJob as Run  # noqa: E402
from tests.unit.local_jobs import (  # noqa: E402
    assert_bitwise_equal,
    assert_slots_like_reference,
    framework_command,
    framework_env,
    load_final,
    local_command,
    run_framework_job,
)

FINAL_KEYS = ("model", "optim", "sched", "global_step", "epoch", "steps_seen")


def _command(out: Path) -> list[str]:
    return framework_command(out, SCRIPT, nproc=NPROC)


_env = framework_env


def _run(base: Path, name: str, **env: str) -> Run:
    return run_framework_job(base, name, SCRIPT, nproc=NPROC, timeout_s=RUN_TIMEOUT_S, **env)


def _final_state(out: Path, slot: int) -> dict[str, Any]:
    final = load_final(out, slot)
    return {k: final[k] for k in FINAL_KEYS}


def _assert_like_reference(run: Run, reference: Run, what: str) -> None:
    last = OPTIMIZER_STEPS - 1
    assert_slots_like_reference(run, reference, nproc=NPROC, keys=FINAL_KEYS, last_step=last, what=what)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-hf-trainer")


@pytest.fixture(scope="module")
def reference(base: Path) -> Run:
    """The fault-free run every faulted run must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_trainer_run_trains_every_window_once(reference: Run) -> None:
    final = load_final(reference.out, 0)
    assert final["global_step"] == OPTIMIZER_STEPS and final["epoch"] == EPOCHS, final
    assert final["steps_seen"] == OPTIMIZER_STEPS, final
    assert {int(s["step"]) for s in final["optim"]["state"].values()} == {OPTIMIZER_STEPS}
    assert final["sched"]["last_epoch"] == OPTIMIZER_STEPS, "the linear schedule stepped once per window"
    assert_bitwise_equal(_final_state(reference.out, 1), _final_state(reference.out, 0), "slot 1")
    assert not reference.of_kind("torchpass.recovered")
    assert "TorchPass owns the process group" in reference.output
    assert "Hugging Face Trainer: its counters and callbacks' state move with the state" in reference.output


def _random_kills(rng: random.Random) -> str:
    """Two kills at random batches (at least three apart, so the first recovery is over), random phases, on
    random slots, slot 0 always among them. The optimizer phase exists only on a window's last batch."""
    first = rng.randrange(0, BATCHES - 5)
    second = rng.randrange(first + 3, BATCHES)
    slots = [0, rng.randrange(NPROC)]
    rng.shuffle(slots)
    specs = []
    for slot, batch in zip(slots, (first, second), strict=True):
        phases = PHASES if batch % ACCUMULATE == ACCUMULATE - 1 else PHASES[:2]
        specs.append(f"{slot}:{batch}:{rng.choice(phases)}")
    return ",".join(specs)


@pytest.mark.parametrize("draw", range(2))
def test_sigkills_at_random_moments_end_bitwise_equal(base: Path, reference: Run, draw: int) -> None:
    """Two SIGKILLs per run, slot 0 among them, at random batches and phases (the last window of training
    included); the seed is printed (and fixed by CW_TEST_SEED) so that a failing draw can be replayed."""
    seed = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30)) + draw
    kill = _random_kills(random.Random(seed))
    print(f"CW_TEST_SEED={seed - draw} draw {draw}: kills {kill}")
    run = _run(base, f"random{draw}-" + kill.replace(":", "-").replace(",", "_"), CW_TEST_KILL=kill)
    _assert_like_reference(run, reference, f"seed {seed}: {kill}")
    assert len(list(run.out.glob("killed-*"))) == 2, f"seed {seed}: {kill}: the faults were not injected"
    assert len(run.of_kind("torchpass.member_failed")) == 2, run.of_kind("torchpass.member_failed")
    assert len(list(run.out.glob("pid-slot0-*"))) >= 2, "slot 0 was not taken over by another process"


def test_planned_migration_moves_a_trainer_rank_live(base: Path, reference: Run) -> None:
    """``clockwork migrate`` while the Trainer trains: slot 1 moves to the spare at a window boundary, its
    counters and callbacks' state with it, and the job ends bitwise equal to the fault-free run."""
    from clockwork.cli.main import run as clockwork

    out = base / "migrate"
    out.mkdir()
    proc = subprocess.Popen(
        _command(out),
        env=_env(out, CW_TEST_STEP_FILE="1:6", CW_TEST_STEP_SLEEP="0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out / "at-step").exists():
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "slot 1 never reached batch 6"
            time.sleep(0.05)
        assert clockwork(["migrate", "--coordinator", str(out / "coordinator"), "--rank", "1"]) == 0
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    run = Run(out, proc.returncode, output)
    _assert_like_reference(run, reference, "migration")
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [1] and migrated[0]["handoff_ok"], migrated
    assert len(list(out.glob("pid-slot1-*"))) == 2, "slot 1 was not taken over by another process"
    assert not run.of_kind("torchpass.member_failed")


ACCELERATE_SCRIPT = SCRIPT.parent / "data" / "accelerate_loop_script.py"


def test_a_hand_written_accelerate_loop_is_refused_at_start_without_burning_spares(base: Path) -> None:
    """accelerate without a Trainer (its own loop, which TorchPass cannot re-enter) is refused once accelerate
    prepares the model, with the reason and the alternative: the job fails before any spare is put in a slot."""
    out = base / "accelerate-refused"
    out.mkdir()
    cmd = local_command(out, ACCELERATE_SCRIPT, nproc=NPROC, spares=1, flags=["--transparent"])
    proc = subprocess.run(cmd, env=_env(out), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    run = Run(out, proc.returncode, proc.stdout + proc.stderr)
    assert run.returncode == 1, run.output[-4000:]
    assert "accelerate prepared a model outside a transformers Trainer" in run.output, run.output[-4000:]
    failed = run.of_kind("torchpass.failed")
    assert failed and "use the model-aware API" in failed[0]["reason"], failed
    assert not [g for g in run.of_kind("torchpass.generation") if g.get("replaced")], "a spare was put in a slot"
