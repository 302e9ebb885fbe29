"""Model-transparent mode for an unmodified FSDP2 script: a SIGKILLed rank is rebuilt from the peer holding its
shard, and every slot ends bitwise equal to the fault-free run.

The rank script is this file, executed directly: a plain PyTorch FSDP2 script (``init_process_group``,
``init_device_mesh`` of a 2 x 2 HSDP mesh, ``fully_shard`` on each Linear and on the model, AdamW, gradient
clipping, an LR scheduler stepped once per epoch, a DataLoader over a ``DistributedSampler`` iterated once per
epoch after ``set_epoch``). It imports nothing from TorchPass. Each test launches it with ``python -m torchpass
run --local --transparent`` (4 ranks, 1 spare, gloo on 127.0.0.1).

``CW_TEST_KILL`` (``slot:step``) makes that slot SIGKILL itself in the backward pass of that step, before the
reduce-scatter of a layer drawn at random (the step is AdamW's own count, which moves with the state, so it is
right on a replacement too), or with ``CW_TEST_KILL_UPDATED=1`` right after that step's optimizer step; a marker
file makes the kill happen once. ``CW_TEST_MESH`` (``RxS``, default 2x2) is the mesh
(1-D for one replica, unless ``CW_TEST_MESH_2D=1``). The seed is printed;
``CW_TEST_SEED`` replays it. The fault-free run also snapshots every shard, and a job restored from one of its
snapshots ends bitwise equal to it.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
NPROC = 4
EPOCHS = 2
BATCH = 4
SAMPLES = 96
STEPS = EPOCHS * SAMPLES // (BATCH * NPROC)  # 12
RUN_TIMEOUT_S = 150


# ======================================================================================================
# The rank script: an unmodified FSDP2 training script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = Path(os.environ["CW_TEST_DIR"])
    kill = os.environ.get("CW_TEST_KILL", "")
    kill_layer = int(os.environ.get("CW_TEST_KILL_LAYER", "0"))

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = int(os.environ.get("CW_TEST_MESH", "2x2").split("x")[0])
    if replicas == 1 and not os.environ.get("CW_TEST_MESH_2D"):  # pure FSDP: a 1-D mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))

    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 33), nn.ReLU(), nn.Dropout(0.2), nn.Linear(33, 4)
    )
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for layer in linears:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    first = next(iter(model.parameters()))

    def step_no() -> int:
        state = opt.state.get(first)
        return int(state["step"]) if state else 0

    def maybe_kill(*_: Any) -> None:
        if kill != f"{rank}:{step_no()}":
            return
        try:
            os.close(os.open(out / f"killed-{kill.replace(':', '-')}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # done once: the replacement must not kill itself too
        os.kill(os.getpid(), signal.SIGKILL)

    if os.environ.get("CW_TEST_KILL_UPDATED") == "1":  # AdamW counted the step already: kill = slot:step + 1
        opt.register_step_post_hook(maybe_kill)
    else:
        linears[kill_layer].register_forward_hook(lambda _m, _i, output: output.register_hook(maybe_kill) and None)

    generator = torch.Generator().manual_seed(7)
    x_all = torch.randn(SAMPLES, 16, generator=generator)
    y_all = x_all @ torch.randn(16, 4, generator=generator) + 0.1 * torch.randn(SAMPLES, 4, generator=generator)
    dataset = TensorDataset(x_all, y_all)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            opt.zero_grad()
        sched.step()

    def gathered(value: Any) -> Any:
        if hasattr(value, "full_tensor"):
            return value.full_tensor()
        if isinstance(value, dict):
            return {k: gathered(v) for k, v in value.items()}
        if isinstance(value, list):
            return [gathered(v) for v in value]
        return value

    final = {
        "model": gathered(dict(model.state_dict())),
        "optim": gathered(opt.state_dict()),
        "sched": sched.state_dict(),
    }
    torch.save(final, out / f"final-slot{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final, local_command, run_logged  # noqa: E402

SEED = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
print(f"test_torchpass_fsdp_transparent: CW_TEST_SEED={SEED}")


def _run(
    base: Path,
    name: str,
    *,
    kill: str = "",
    layer: int = 0,
    updated: bool = False,
    mesh: str = "2x2",
    two_d: bool = False,
    settings: tuple[str, ...] = (),
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_KILL_LAYER=str(layer), CW_TEST_MESH=mesh)
    env["CW_TEST_KILL_UPDATED"] = "1" if updated else ""
    env["CW_TEST_MESH_2D"] = "1" if two_d else ""
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=1, flags=["--transparent"], settings=settings)
    return run_logged(out, cmd, env, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp-transparent")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    """The fault-free run, snapshotting after steps 3, 7 and 11 (which must change nothing in the training)."""
    run = _run(base, "reference", settings=("snapshot_every_steps=4", f"snapshot_dir={base / 'snapshots'}"))
    run.check_ok()
    return run


def _recovered_bitwise(run: FinishedJob, reference: FinishedJob, kill: str) -> dict[str, Any]:
    """The faulted run finished, its fault injected, every slot bitwise equal to the reference: its one recovery."""
    run.check_ok()
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    expected = load_final(reference.out, 0)
    for other in range(NPROC):
        assert_bitwise_equal(load_final(run.out, other), expected, f"slot {other}")
    (recovered,) = run.of_kind("torchpass.recovered")
    return recovered


def test_fault_free_run_trains_every_batch_once(reference: FinishedJob) -> None:
    expected = load_final(reference.out, 0)
    step = next(iter(expected["optim"]["state"].values()))["step"]
    assert int(step) == STEPS, f"AdamW took {int(step)} steps, the loader has {STEPS} batches"
    for slot in range(1, NPROC):
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"slot {slot}")
    assert "transparent mode:" not in reference.output  # no start-up warning: the script is inside what it protects


def test_restored_from_a_snapshot_ends_bitwise_equal(base: Path, reference: FinishedJob) -> None:
    """The sharded model's snapshot (every shard, written in transparent mode) restored into a new job: every slot
    loads its own shard and ends bitwise equal to the run that wrote it."""
    steps = reference.complete_snapshots(base / "snapshots", [3, 7, 11])
    step = random.Random(SEED).choice([step for step in steps if step < STEPS - 1] or steps)
    run = _run(base, "restored", settings=(f"restore={base / 'snapshots' / f'step-{step:010d}'}",))
    run.check_ok()
    restored = run.logged("torchpass.restored")
    assert len(restored) == NPROC and {r["step"] for r in restored} == {step}, restored
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(run.out, slot), load_final(reference.out, slot), f"slot {slot}")


def test_sigkill_in_backward_rebuilds_the_shard(base: Path, reference: FinishedJob) -> None:
    draw = random.Random(SEED)
    slot, step, layer = draw.randrange(NPROC), draw.randrange(1, STEPS - 1), draw.randrange(3)
    kill = f"{slot}:{step}"
    print(f"kill {kill} before layer {layer}'s reduce-scatter")
    run = _run(base, "kill", kill=kill, layer=layer)
    recovered = _recovered_bitwise(run, reference, kill)
    assert recovered["slots"] == [slot], recovered
    (move,) = [m for m in recovered["moves"] if m["target"] == slot]
    assert move["source"] == slot ^ 2 and move["what"] == f"shard {slot % 2} of the 2x2 mesh", recovered


@pytest.fixture(scope="module")
def reference_1x4(base: Path) -> FinishedJob:
    """The fault-free run over a 1-D mesh (pure FSDP)."""
    run = _run(base, "reference_1x4", mesh="1x4", settings=("peer_copies=0",))
    run.check_ok()
    return run


def test_pure_fsdp_with_peer_copy_sync_recomputes_no_committed_step(base: Path, reference_1x4: FinishedJob) -> None:
    """Pure FSDP (1 x 4), ``peer_copy_sync``: a rank killed right after its update, before the copy of that step
    exists. The step's commit waits for every copy, so the step is redone from the one before (its batches
    again) and none is computed twice; the lost shard comes from its ring successor's copy."""
    reference = reference_1x4
    draw = random.Random(SEED + 1)
    slot, step = draw.randrange(NPROC), draw.randrange(2, STEPS - 1)
    kill = f"{slot}:{step}"
    print(f"kill {kill} right after its update")
    run = _run(base, "sync", kill=kill, updated=True, mesh="1x4", settings=("peer_copy_sync=true",))
    recovered = _recovered_bitwise(run, reference, kill)
    assert recovered["recomputed_steps"] == 0 and recovered["step"] == step - 1, recovered
    (move,) = [m for m in recovered["moves"] if m["target"] == slot]
    assert move["source"] == (slot + 1) % NPROC and move["bytes"] > 0, recovered


@pytest.mark.parametrize("sync", [False, True], ids=["peer-copies", "peer-copy-sync"])
def test_rollback_to_a_pass_end_keeps_the_epilogue(base: Path, reference_1x4: FinishedJob, sync: bool) -> None:
    """Pure FSDP: a rank killed right after the update of the first step of the second pass, before the copy of
    that step is kept. Every shard is held at the pass's last step only, so the step is redone from there, from
    copies taken before the script's epilogue stepped the LR scheduler, which the loops do not run again.

    Without the vote, the survivors roll back to their own copies: the scheduler's step (and the learning rate
    it set) must come back with them. With ``peer_copy_sync``, the failed vote has already undone each
    survivor's update: its state is the committed one and must be served as such, not replaced with its copy.
    Either way every rank ended silently different before (fresh-clone CI, seed 28)."""
    slot = random.Random(SEED + 2).randrange(NPROC)
    first_of_pass = STEPS // EPOCHS + 1  # AdamW's count after the first update of the second pass
    kill = f"{slot}:{first_of_pass}"
    print(f"kill {kill} right after its update")
    settings = ("peer_copy_sync=true",) if sync else ()
    run = _run(base, f"epilogue-{sync}", kill=kill, updated=True, mesh="1x4", settings=settings)
    recovered = _recovered_bitwise(run, reference_1x4, kill)
    assert recovered["step"] == first_of_pass - 1, recovered
    restored = sorted(m["target"] for m in recovered["moves"] if m["source"] == m["target"])
    if sync:  # only the lost shard moves
        assert [m["target"] for m in recovered["moves"]] == [slot] and not restored, recovered
    else:  # every survivor restored its own copy
        assert restored == sorted(set(range(NPROC)) - {slot}), recovered


def test_a_replicate_dimension_of_size_one_is_ordinary(base: Path, reference_1x4: FinishedJob) -> None:
    """A configurable script writes ``init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp_replicate", "dp_shard"))``
    for pure FSDP. That mesh is the 1 x 4 layout it amounts to (it failed before training with "a flat 1x4 mesh
    names 1 dimension(s)"): the script gets its two named dimensions, a SIGKILL in backward is rebuilt from the
    peer copy, and every slot ends bitwise equal to the 1-D run's."""
    draw = random.Random(SEED + 3)
    slot, step, layer = draw.randrange(NPROC), draw.randrange(1, STEPS - 1), draw.randrange(3)
    kill = f"{slot}:{step}"
    print(f"kill {kill} before layer {layer}'s reduce-scatter, over a (1, 4) mesh")
    run = _run(base, "two-d-1x4", kill=kill, layer=layer, mesh="1x4", two_d=True)
    recovered = _recovered_bitwise(run, reference_1x4, kill)
    (move,) = [m for m in recovered["moves"] if m["target"] == slot]
    assert move["source"] == (slot + 1) % NPROC and move["bytes"] > 0, recovered
