"""An unmodified PyTorch Lightning FSDP2 script (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``) in
transparent mode: SIGKILLs of random slots at random moments (slot 0 among them) and a planned migration, each
ending bitwise equal, per slot, to the fault-free TorchPass run.

This file is also the rank script (run by ``torchpass run --local --transparent``: 2 ranks, 1 spare, gloo on
127.0.0.1). It is an ordinary Lightning FSDP2 script: ``Trainer(accelerator="cpu", devices=LOCAL_WORLD_SIZE,
num_nodes=..., strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1))``, a
``LightningModule`` whose ``configure_model`` shards each Linear and then the network with
``fully_shard(..., mesh=self.device_mesh["data_parallel"])``, Dropout, Adam and a StepLR stepped each epoch from
``configure_optimizers``, ``accumulate_grad_batches=2``, a loss logged with ``sync_dist=True`` (a collective inside
each step), a validation loader (the sanity check, a validation after each epoch), a stateful callback of its own
(batches and losses it saw: a redone window that did not roll it back would count twice), and a ``DataLoader``
without a sampler (Lightning injects its ``DistributedSampler`` over the mesh's data-parallel dimension). It imports
nothing from TorchPass. Checkpointing is off: the ``ModelCheckpoint`` callback of this strategy writes a
distributed checkpoint (``torch.distributed.checkpoint``) whose collectives transparent mode does not follow, and
``CW_TEST_VARIANT=checkpoint`` checks that it is refused at start. ``CW_TEST_VARIANT=tensor-parallel`` is
Lightning's TP recipe instead: ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``, and
``configure_model`` first cuts the network with ``parallelize_module(..., self.device_mesh["tensor_parallel"],
{"0": ColwiseParallel(), "3": RowwiseParallel()})``.

There is no replica in pure FSDP: a SIGKILLed rank's shard is rebuilt from the copy its ring neighbour keeps
(peer copies, on by default). Faults (``CW_TEST_KILL``, ``slot:batch:phase`` comma separated): SIGKILL in
``training_step`` (forward), in backward (a gradient hook on the first layer's output, so after the later layers'
reduce-scatters), or before the optimizer step (only at a window's second batch). ``batch`` is Lightning's own
``total_batch_idx``, which moves with the state. A marker file makes each kill happen once. ``CW_TEST_STEP_FILE``
(``slot:batch``) makes that slot write ``at-step`` there, for a test to start ``clockwork migrate``.

The oracle: each slot's own shards of the model and optimizer state (``to_local()``: the bits that slot holds),
the scheduler state, ``global_step``, the epoch and the callback's state, equal to the fault-free run's.
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
SAMPLES = 96
BATCH = 4
EPOCHS = 2
ACCUMULATE = 2
BATCHES_PER_EPOCH = SAMPLES // (BATCH * NPROC)  # 12
BATCHES = EPOCHS * BATCHES_PER_EPOCH  # 24
OPTIMIZER_STEPS = BATCHES // ACCUMULATE  # 12
PHASES = ("forward", "backward", "optimizer")
RUN_TIMEOUT_S = 240


def _rank_main() -> int:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.data import DataLoader, TensorDataset

    out = Path(os.environ["CW_TEST_DIR"])
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    step_file = os.environ.get("CW_TEST_STEP_FILE", "")
    step_sleep = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))
    (out / f"pid-slot{os.environ['RANK']}-{os.getpid()}").write_text("")

    class Tally(L.Callback):
        """The batches and losses this rank trained on, as callback state."""

        def __init__(self) -> None:
            self.batches = 0
            self.loss_sum = 0.0

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.batches += 1
            self.loss_sum += float(outputs["loss"])

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches, "loss_sum": self.loss_sum}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.batches, self.loss_sum = state["batches"], state["loss_sum"]

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
            self.net[0].register_forward_hook(self.arm_backward_kill)

        def arm_backward_kill(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:  # a training forward, not validation's
                output.register_hook(lambda _grad: self.maybe_kill("backward"))

        def configure_model(self) -> None:
            if self.device_mesh["tensor_parallel"].size() > 1:  # Lightning's TP recipe: the plan first
                plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
                parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def batch_no(self) -> int:
            return int(self.trainer.fit_loop.epoch_loop.total_batch_idx)

        def maybe_kill(self, phase: str) -> None:
            when = self.batch_no()
            if (str(self.global_rank), str(when), phase) not in kills:
                return
            try:
                fd = os.open(out / f"killed-{self.global_rank}-{when}-{phase}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # already done once: the replacement must not kill itself too
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if step_file == f"{self.global_rank}:{self.batch_no()}":
                (out / "at-step").write_text(str(time.time()))
            if step_sleep:
                time.sleep(step_sleep)
            self.maybe_kill("forward")
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.maybe_kill("optimizer")

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = x @ torch.randn(8, 2, generator=generator)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    validation = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=BATCH)
    L.seed_everything(1234)
    model = Net()
    tally = Tally()
    world, devices = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    variant = os.environ.get("CW_TEST_VARIANT", "")  # what transparent mode must refuse at start
    strategy: Any = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if variant == "tensor-parallel":
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=world // devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[tally],
        enable_checkpointing=variant == "checkpoint",
        default_root_dir=str(out / "lightning"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, validation)

    def local(value: Any) -> Any:  # this slot's own shard of every DTensor
        if hasattr(value, "to_local"):
            return value.to_local().clone()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, list):
            return [local(v) for v in value]
        return value

    final = {
        "model": local(dict(model.net.state_dict())),
        "optim": local(trainer.optimizers[0].state_dict()),
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "tally": tally.state_dict(),
        "sharded": all(hasattr(p, "to_local") for p in model.net.parameters()),
        "pid": os.getpid(),
    }
    torch.save(final, out / f"final-slot{trainer.global_rank}.pt")
    print(f"slot {trainer.global_rank} done at global step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

# After the rank script: its processes must not need ``tests`` importable.
from tests.unit.local_jobs import FinishedJob as Run  # noqa: E402
from tests.unit.local_jobs import (  # noqa: E402
    assert_slots_like_reference,
    framework_command,
    framework_env,
    load_final,
    run_framework_job,
)

FINAL_KEYS = ("model", "optim", "sched", "global_step", "epoch", "tally")


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
    return tmp_path_factory.mktemp("torchpass-lightning-fsdp")


@pytest.fixture(scope="module")
def reference(base: Path) -> Run:
    """The fault-free run every faulted run must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_lightning_fsdp_run_shards_and_trains_every_window_once(reference: Run) -> None:
    final = load_final(reference.out, 0)
    assert final["sharded"], "configure_model's fully_shard left a parameter that is not a DTensor"
    assert final["global_step"] == OPTIMIZER_STEPS and final["epoch"] == EPOCHS, final
    assert {int(s["step"]) for s in final["optim"]["state"].values()} == {OPTIMIZER_STEPS}
    assert final["sched"]["last_epoch"] == EPOCHS, "StepLR stepped once per epoch"
    assert final["tally"]["batches"] == BATCHES, final["tally"]
    other = _final_state(reference.out, 1)
    assert not all(torch_equal(a, b) for a, b in zip(final["model"].values(), other["model"].values(), strict=True)), (
        "both slots hold the same bits: the model is not sharded"
    )
    assert "TorchPass owns the process group" in reference.output
    assert "model sharded over a 1x2 mesh" in reference.output, "not pure FSDP over TorchPass's mesh"
    assert "the sanity check before training is skipped" in reference.output
    assert "its loop counters and callbacks' state move with the state" in reference.output
    assert not reference.of_kind("torchpass.recovered")


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(a.shape == b.shape and torch.equal(a, b))


def _random_kills(rng: random.Random) -> str:
    """Two kills at random batches (far enough apart for the replacement's peer copies to be in place again),
    random phases, on random slots, slot 0 always among them. The optimizer phase exists only on a window's last
    batch."""
    first = rng.randrange(1, BATCHES - 11)
    second = rng.randrange(first + 6, BATCHES - 1)
    slots = [0, rng.randrange(NPROC)]
    rng.shuffle(slots)
    specs = []
    for slot, batch in zip(slots, (first, second), strict=True):
        phases = PHASES if batch % ACCUMULATE == ACCUMULATE - 1 else PHASES[:2]
        specs.append(f"{slot}:{batch}:{rng.choice(phases)}")
    return ",".join(specs)


@pytest.mark.parametrize("draw", range(2))
def test_sigkills_at_random_moments_rebuild_the_shard_bitwise(base: Path, reference: Run, draw: int) -> None:
    """Two SIGKILLs per run, slot 0 among them, at random batches and phases; the lost shard comes from the
    neighbour's peer copy. The seed is printed (and fixed by CW_TEST_SEED) so that a failing draw can be
    replayed; each CI run draws new ones."""
    seed = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30)) + draw
    kill = _random_kills(random.Random(seed))
    print(f"CW_TEST_SEED={seed - draw} draw {draw}: kills {kill}")
    run = _run(base, f"random{draw}-" + kill.replace(":", "-").replace(",", "_"), CW_TEST_KILL=kill)
    _assert_like_reference(run, reference, f"seed {seed}: {kill}")
    assert len(list(run.out.glob("killed-*"))) == 2, f"seed {seed}: {kill}: the faults were not injected"
    assert len(run.of_kind("torchpass.member_failed")) == 2, run.of_kind("torchpass.member_failed")
    assert len(list(run.out.glob("pid-slot0-*"))) >= 2, "slot 0 was not taken over by another process"
    recoveries = [r for r in run.of_kind("torchpass.recovered") if r["slots"]]  # not a rebuild without a loss
    assert len(recoveries) == 2, recoveries
    for recovered in recoveries:  # each lost shard came from the other slot: the peer copy it kept
        (slot,) = recovered["slots"]
        (move,) = [m for m in recovered["moves"] if m["target"] == slot]
        assert move["source"] == 1 - slot and move["what"] == f"shard {slot} of the 1x2 mesh", recovered


def test_a_kill_on_an_epochs_last_batch_recovers_without_waiting_out_a_timeout(base: Path, reference: Run) -> None:
    """Killed in the forward of epoch 0's last batch: the survivor finishes that batch (its collectives skipped),
    runs the epoch's validation, rolls the window back and redoes it beside the replacement. The validation's
    forwards (under no_grad) had added to FSDP2's record of the forward order, from which a backward prefetches
    all-gathers, and no backward had cleared it: the survivor's first backward prefetched one all-gather more than
    the replacement's, and both waited out collective_timeout_s (``torchpass.collective_error``: "Timed out
    waiting 20000ms for recv") before a rebuild with no member lost. Every join now clears that record."""
    kill = f"0:{BATCHES_PER_EPOCH - 1}:forward"
    run = _run(base, "epoch-end-" + kill.replace(":", "-"), CW_TEST_KILL=kill)
    _assert_like_reference(run, reference, kill)
    assert len(run.of_kind("torchpass.member_failed")) == 1, run.of_kind("torchpass.member_failed")
    assert not run.of_kind("torchpass.collective_error"), run.of_kind("torchpass.collective_error")
    assert len(run.of_kind("torchpass.recovered")) == 1, run.of_kind("torchpass.recovered")


def test_planned_migration_moves_a_lightning_fsdp_rank_with_its_shard(base: Path, reference: Run) -> None:
    """``clockwork migrate`` while Lightning trains: slot 1 moves to the spare at a step boundary with its shard,
    counters and callbacks' state, and the job ends bitwise equal to the fault-free run."""
    from clockwork.cli.main import run as clockwork

    out = base / "migrate"
    out.mkdir()
    proc = subprocess.Popen(
        _command(out),
        env=_env(out, CW_TEST_STEP_FILE="1:9", CW_TEST_STEP_SLEEP="0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out / "at-step").exists():
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "slot 1 never reached batch 9"
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


def test_tensor_parallel_size_2_is_protected_a_killed_rank_rebuilt_from_its_peer_copy(base: Path) -> None:
    """``tensor_parallel_size=2``: the fault-free run cuts the network over TorchPass's (data_parallel,
    tensor_parallel) mesh; a SIGKILL of a random slot at a random batch and phase is rebuilt from the copy of its
    (shard, tp) state that the other rank keeps, and every slot ends bitwise equal to the fault-free run."""
    reference = _run(base, "tp-reference", CW_TEST_VARIANT="tensor-parallel")
    reference.check_ok()
    batches = EPOCHS * SAMPLES // BATCH  # one data-parallel rank: both TP ranks read every batch
    steps = batches // ACCUMULATE
    final = load_final(reference.out, 0)
    assert final["sharded"] and final["global_step"] == steps and final["tally"]["batches"] == batches, final
    assert "model sharded over a 1x1x2 mesh" in reference.output, "not TP over TorchPass's mesh"
    seed = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(seed)
    batch = rng.randrange(1, batches - 1)
    phase = rng.choice(PHASES if batch % ACCUMULATE == ACCUMULATE - 1 else PHASES[:2])
    slot = rng.randrange(NPROC)
    kill = f"{slot}:{batch}:{phase}"
    print(f"CW_TEST_SEED={seed}: kill {kill}")
    run = _run(base, "tp-" + kill.replace(":", "-"), CW_TEST_VARIANT="tensor-parallel", CW_TEST_KILL=kill)
    what = f"seed {seed}: {kill}"
    assert_slots_like_reference(run, reference, nproc=NPROC, keys=FINAL_KEYS, last_step=steps - 1, what=what)
    assert list(run.out.glob("killed-*")), f"seed {seed}: {kill}: the fault was not injected"
    (recovered,) = [r for r in run.of_kind("torchpass.recovered") if r["slots"]]
    (move,) = [m for m in recovered["moves"] if m["target"] == slot]
    assert move["source"] == 1 - slot and move["what"] == f"part {slot} (shard 0, tp {slot}) of the 1x1x2 mesh"


def test_modelcheckpoint_is_refused_at_start_without_burning_spares(base: Path) -> None:
    """ModelCheckpoint's distributed checkpoint under ModelParallelStrategy: the job fails at start with the reason
    and the alternative, before any spare is put in a slot (a crash loop of spares is what an unprotected feature
    would otherwise cost)."""
    variant, reason = "checkpoint", "ModelCheckpoint under ModelParallelStrategy"
    run = _run(base, f"refused-{variant}", CW_TEST_VARIANT=variant)
    assert run.returncode == 1, run.output[-4000:]
    failed = run.of_kind("torchpass.failed")
    assert failed and reason in failed[0]["reason"], failed or run.output[-4000:]
    assert not [g for g in run.of_kind("torchpass.generation") if g.get("replaced")], "a spare was put in a slot"
    assert not list(run.out.glob("final-slot*.pt")), "a rank trained"


def test_lightning_fsdp1_strategy_is_refused_naming_model_parallel_strategy() -> None:
    """Lightning's FSDPStrategy (FSDP1) builds ``FullyShardedDataParallel``, which has no TorchPass mesh: refused
    with ModelParallelStrategy as the alternative. Lightning builds it only on a GPU, so the adapter is given a real
    ``FSDPStrategy`` on a stand-in trainer (the refusal reads nothing else)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from torchpass.errors import TorchPassError
    from torchpass.frameworks.lightning import LightningAdapter

    trainer = SimpleNamespace(strategy=FSDPStrategy(), checkpoint_callbacks=[], reload_dataloaders_every_n_epochs=0)
    with pytest.raises(TorchPassError, match=r"FSDPStrategy \(FSDP1.*use ModelParallelStrategy\("):
        LightningAdapter(SimpleNamespace(), trainer)  # type: ignore[arg-type]
