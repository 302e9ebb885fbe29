"""TorchPass's oracle for sharded training: HSDP and pure FSDP2 jobs with injected faults end bitwise equal to the
fault-free run, every step committed once, a failed rank rebuilt from the peer holding its shard.

Each test launches a real local job (``python -m torchpass run --local``: 4 ranks and 1 spare forked from the
zygote, gloo on 127.0.0.1) of a deterministic training with dropout, AdamW, gradient clipping over DTensors
(``clip_grad_norm_``) and an LR scheduler stepped every step, sharded with ``ctx.wrap_fsdp``: a 2 x 2 HSDP mesh
(2 replicas of 2 shards), or 1 x 4 (pure FSDP). This file is also the rank script: executed directly, it trains.

Faults (``CW_TEST_KILL``: ``slot:step:phase:layer``, comma separated; a marker file makes each happen once) are
SIGKILLs the rank deals itself at a point of the step:

* ``allgather``: in the forward pass, before layer ``layer``'s parameter all-gather (after the earlier layers');
* ``reducescatter``: in the backward pass, before layer ``layer``'s gradient reduce-scatter (after the later
  layers' reduce-scatters and all-reduces);
* ``allreduce``: right after layer ``layer``'s reduce-scatter, before its all-reduce over the replicas, so the
  peer holding the same shard in the other replica waits in that all-reduce for a dead rank;
* ``optimizer``: inside the optimizer step;
* ``updated``: right after the optimizer step (the update applied, the step not yet committed: under pure FSDP
  its peer copy is not made yet);
* ``moment``: at a random moment of the step: ``layer`` is a fraction in thousandths of the step before's wall
  time, after which a timer thread started as the step begins kills the rank, wherever it then is;
* ``crashnode-PHASE`` (the sandbox test, tests/integration/test_torchpass_fsdp_sandbox.py): at that point the rank
  writes ``crash-request-SLOT-STEP`` naming its Slurm node and waits there for the test to crash the whole node.

With ``CW_TEST_KILL_TOGETHER=1`` the victims die as one crash: each, at its point (all at the same point of the
same step), waits until every victim has reached its own before it kills itself, so that no recovery can run
between two of the deaths (one victim's loss noticed, and the other rebuilt from it, before it dies too). With
``CW_TEST_AFTER_SNAPSHOT=1`` a victim first waits until some snapshot is complete (its manifest exists).

The step and the layer are drawn at random per run (the seed is printed; ``CW_TEST_SEED`` replays it).

The oracle: the gathered (``full_tensor``) model, optimizer state and scheduler state of every slot are
``torch.equal`` to the fault-free run's; each slot's journal shows every step committed exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
STEPS = 12
NPROC = 4
LAYERS = 4  # sharded Linear layers of the model (the kill points' ``layer``)
RUN_TIMEOUT_S = 150


# ======================================================================================================
# The rank script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import torchpass as tp
    from torchpass.rank.transfer_plan import ShardedReplicas
    from torchpass.snapshot import snapshot_directory

    out = Path(os.environ["CW_TEST_DIR"])
    steps = int(os.environ.get("CW_TEST_STEPS", str(STEPS)))
    mesh_shape = tuple(int(v) for v in os.environ.get("CW_TEST_MESH", "2x2").split("x"))
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    migrate = os.environ.get("CW_TEST_MIGRATE", "")
    step_sleep = float(os.environ.get("CW_TEST_STEP_SLEEP", "0"))

    def journal(slot: int, line: str) -> None:
        with open(out / f"journal-slot{slot}.txt", "a") as f:
            f.write(f"{line} {os.getpid()}\n")

    def maybe_kill(phase: str, layer: int = -1) -> None:
        for spec in [(str(ctx.slot), str(ctx.step), p, str(layer)) for p in (phase, f"crashnode-{phase}")]:
            if spec not in kills:
                continue
            if os.environ.get("CW_TEST_AFTER_COPY") == "1":  # first the neighbours acknowledge the last commit's copy
                peers = ctx.shard_state(ShardedReplicas(*mesh_shape)).peers
                assert peers is not None and peers.wait_sent(30.0) >= ctx.committed_step, "no acknowledged copy"
            if os.environ.get("CW_TEST_AFTER_SNAPSHOT") == "1":  # first a snapshot is complete (its manifest)
                folder = snapshot_directory(ctx.config)
                deadline = time.monotonic() + 60.0
                while not any(folder.glob("step-*/manifest.json")) and time.monotonic() < deadline:
                    time.sleep(0.01)
            try:
                fd = os.open(out / ("killed-" + "-".join(spec)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # done once: the replacement must not kill itself too
            os.write(fd, f"{time.time()}\n".encode())
            os.close(fd)
            if os.environ.get("CW_TEST_KILL_TOGETHER") == "1":  # one crash of all victims: each waits for the rest
                markers = [out / ("killed-" + "-".join(k)) for k in kills if not k[2].startswith("crashnode")]
                deadline = time.monotonic() + 60.0
                while not all(m.exists() for m in markers) and time.monotonic() < deadline:
                    time.sleep(0.001)
            if spec[2].startswith("crashnode"):  # the sandbox test crashes this whole node; wait here until then
                node = os.environ.get("SLURMD_NODENAME", "")
                (out / f"crash-request-{ctx.slot}-{ctx.step}").write_text(f"{node} {time.time()}\n")
                while True:
                    time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)

    def sink(kind: str, fields: dict[str, Any]) -> None:
        if kind == "torchpass.joined" and fields["received"]:
            journal(fields["slot"], f"adopt {fields['generation']} {fields['resume_step'] - 1}")

    ctx = tp.init(event_sink=sink)

    class KillAfterReduceScatter:
        """FSDP2's default reduce-scatter through its public custom-comm seam (``set_custom_reduce_scatter``,
        duck-typed: torch 2.13 does not export the ``ReduceScatter`` base), then the ``allreduce`` kill point."""

        def __init__(self, layer: int) -> None:
            self.layer = layer

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
            work = torch.distributed.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
            maybe_kill("allreduce", self.layer)
            return work

    torch.manual_seed(1234)
    widths = [16, 48, 33, 32, 4]  # 33: a parameter that does not split evenly into shards
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < LAYERS - 1:
            layers += [nn.ReLU(), nn.Dropout(0.2)]
    model = nn.Sequential(*layers)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    options: dict[str, Any] = {}
    if os.environ.get("CW_TEST_MP") == "1":  # parameters gathered in bf16, gradients reduced in fp32, kept unsharded
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32), "reshard_after_forward": False}
    model = ctx.wrap_fsdp(model, mesh_shape=mesh_shape, shard=nn.Linear, **options)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01))
    sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    ctx.on_commit(lambda step: journal(ctx.slot, f"commit {ctx.generation} {step}"))

    def before_backward_of(layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:  # its gradient arrives before this layer's backward (and reduce-scatter)
                output.register_hook(lambda grad: maybe_kill("reducescatter", layer))

        return hook

    for index, linear in enumerate(linears):
        linear.register_forward_pre_hook(lambda *_, i=index: maybe_kill("allgather", i), prepend=True)
        linear.register_forward_hook(before_backward_of(index))
        linear.set_custom_reduce_scatter(KillAfterReduceScatter(index))  # type: ignore[operator]
    opt.register_step_pre_hook(lambda *_: maybe_kill("optimizer"))
    opt.register_step_post_hook(lambda *_: maybe_kill("updated"))

    def kill_at_a_moment(step: int, took_s: float) -> None:
        """The ``moment`` faults of this slot and step: a timer kills the rank that fraction of ``took_s`` later."""
        for spec in kills:
            marker = out / ("killed-" + "-".join(spec))
            if spec[:3] != (str(ctx.slot), str(step), "moment") or marker.exists():
                continue

            def fire(spec: tuple[str, ...] = spec, marker: Path = marker) -> None:
                marker.write_text(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(int(spec[3]) / 1000 * took_s, fire).start()

    generator = torch.Generator().manual_seed(7)
    x_all = torch.randn(512, 16, generator=generator)
    y_all = x_all @ torch.randn(16, 4, generator=generator) + 0.1 * torch.randn(512, 4, generator=generator)
    loader = tp.StepLoader(TensorDataset(x_all, y_all), batch_size=4, seed=3)

    began = time.monotonic()
    for step, (x, y) in ctx.steps(loader, steps):
        now = time.monotonic()
        kill_at_a_moment(step, now - began)
        began = now
        if migrate:
            slot, when = (int(v) for v in migrate.split(":"))
            if ctx.slot == (1 if slot == 0 else 0) and step == when and not (out / "migrate-requested").exists():
                (out / "migrate-requested").write_text(str(ctx.request_migration(slot)))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step_sleep:
            time.sleep(step_sleep)

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

from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final, local_command  # noqa: E402

SEED = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
print(f"test_torchpass_fsdp: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)


def _point() -> tuple[int, int]:
    """A random step (not the first or last two) and layer."""
    return _draw.randrange(2, STEPS - 2), _draw.randrange(LAYERS)


def _run(
    base: Path,
    name: str,
    *,
    mesh: str = "2x2",
    kill: str = "",
    migrate: str = "",
    spares: int = 1,
    mp: bool = False,
    settings: tuple[str, ...] = (),
    after_copy: bool = False,
    after_snapshot: bool = False,
    together: bool = False,
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_MIGRATE=migrate, CW_TEST_MESH=mesh)
    env["CW_TEST_MP"] = "1" if mp else ""
    env["CW_TEST_AFTER_COPY"] = "1" if after_copy else ""
    env["CW_TEST_AFTER_SNAPSHOT"] = "1" if after_snapshot else ""
    env["CW_TEST_KILL_TOGETHER"] = "1" if together else ""
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=spares, settings=settings)
    with open(out / "launcher.log", "w") as log:  # a file, so that a hung job's output is still there to read
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher's ranks die with it (PR_SET_PDEATHSIG)
            returncode = proc.wait()
    return FinishedJob(out, returncode, (out / "launcher.log").read_text())


def _assert_same_final_state(run: FinishedJob, reference: FinishedJob) -> None:
    expected = load_final(reference.out, 0)
    assert expected["committed"] == STEPS - 1
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")


def _journal(run: FinishedJob, slot: int) -> list[tuple[str, int, int, int]]:
    lines = (run.out / f"journal-slot{slot}.txt").read_text().splitlines()
    return [(kind, int(gen), int(step), int(pid)) for kind, gen, step, pid in (line.split() for line in lines)]


def _assert_each_step_once(run: FinishedJob) -> dict[int, list[tuple[str, int, int, int]]]:
    """Per slot: commits are 0..N-1 in order, each once; an adopted state is the step the slot had to reach."""
    journals = {}
    for slot in range(NPROC):
        entries = _journal(run, slot)
        next_step = 0
        for kind, _gen, step, _pid in entries:
            if kind == "commit":
                assert step == next_step, f"slot {slot}: committed {step}, expected {next_step}: {entries}"
            else:
                assert step in (next_step - 1, next_step), f"slot {slot}: adopted {step} at {next_step}: {entries}"
            next_step = step + 1
        assert next_step == STEPS, f"slot {slot} ended at {next_step}: {entries}"
        journals[slot] = entries
    return journals


def _recovered(run: FinishedJob, slot: int) -> dict[str, Any]:
    matches = [f for f in run.of_kind("torchpass.recovered") if slot in f["slots"]]
    assert matches, f"no recovery of slot {slot}: {run.of_kind('torchpass.recovered')}\n{run.output[-4000:]}"
    return matches[0]


def _check_fault(run: FinishedJob, reference: FinishedJob, kill: str) -> dict[str, Any]:
    run.check_ok()
    # No survivor waits out collective_timeout_s, not even in a gloo send queued on a just-closed connection
    # (torchpass.sharded.gloo_wait gives that wait up once the rank aborted the generation's groups).
    timed_out = [f for f in run.logged("torchpass.step_abandoned") if "timed out" in f["reason"].lower()]
    assert not timed_out, timed_out
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    _assert_same_final_state(run, reference)
    journals = _assert_each_step_once(run)
    victims = sorted({int(spec.split(":")[0]) for spec in kill.split(",")})
    for slot in victims:
        assert len({pid for *_, pid in journals[slot]}) == 2, f"slot {slot} was not taken over by another process"
    fields = _recovered(run, victims[0])
    fields["moves"] = [m for f in run.of_kind("torchpass.recovered") for m in f.get("moves", [])]
    for move in fields["moves"]:  # every shard came from a live holder of the same shard (2 x 2: slot % 2)
        assert move["source"] % 2 == move["target"] % 2 == move["part"], fields
        assert move["what"] == f"shard {move['part']} of the 2x2 mesh" and move["bytes"] > 0, fields
    return fields


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    """The fault-free HSDP run every faulted one must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_hsdp_run_is_consistent(reference: FinishedJob) -> None:
    _assert_each_step_once(reference)
    assert not reference.of_kind("torchpass.recovered")
    expected = load_final(reference.out, 0)
    for slot in range(1, NPROC):  # every slot gathers the same full state
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"slot {slot}")


@pytest.mark.parametrize(
    ("phase", "slot"),
    [("allgather", 0), ("reducescatter", None), ("allreduce", None), ("optimizer", None)],
    ids=["forward-allgather-slot0", "backward-reducescatter", "replicate-allreduce", "optimizer-step"],
)
def test_sigkill_rebuilds_the_shard_from_its_peer(
    base: Path, reference: FinishedJob, phase: str, slot: int | None
) -> None:
    victim = slot if slot is not None else _draw.randrange(1, NPROC)
    step, layer = _point()
    kill = f"{victim}:{step}:{phase}:{-1 if phase == 'optimizer' else layer}"
    print(f"kill {kill}")
    run = _run(base, "kill-" + kill.replace(":", "-"), kill=kill)
    fields = _check_fault(run, reference, kill)
    (move,) = [m for m in fields["moves"] if m["target"] == victim]
    assert move["source"] == victim ^ 2  # the same shard in the other replica: the only live holder


def test_two_failures_in_different_shards(base: Path, reference: FinishedJob) -> None:
    """Slots 1 (replica 0, shard 1) and 2 (replica 1, shard 0) die in the same step: both shards are rebuilt at
    once, each from the other replica, so the two sources sit in different replicas."""
    step, layer = _point()
    kill = f"1:{step}:reducescatter:{layer},2:{step}:reducescatter:{layer}"
    run = _run(base, "two-failures", kill=kill, spares=2)
    fields = _check_fault(run, reference, kill)
    sources = {m["target"]: m["source"] for m in fields["moves"] if m["target"] in (1, 2)}
    assert sources == {1: 3, 2: 0}, fields


def test_mixed_precision_without_resharding(base: Path) -> None:
    """``mp_policy`` (bf16 parameters gathered, fp32 gradients reduced) and ``reshard_after_forward=False`` pass
    through to fully_shard; a SIGKILL in backward still ends bitwise equal to the same job without one."""
    reference = _run(base, "mp_reference", mp=True)
    reference.check_ok()
    step, layer = _point()
    kill = f"2:{step}:reducescatter:{layer}"
    run = _run(base, "mp_kill", mp=True, kill=kill)
    _check_fault(run, reference, kill)
    import torch

    weight = load_final(run.out, 0)["model"]["0.weight"]
    assert weight.dtype == torch.float32  # the sharded parameters stay fp32: only their gathered copies are bf16


@pytest.fixture(scope="module")
def reference_fsdp(base: Path) -> FinishedJob:
    """Pure FSDP (1 x 4, no replica) without a fault."""
    run = _run(base, "1x4_reference", mesh="1x4")
    run.check_ok()
    return run


def test_planned_migration_in_pure_fsdp(base: Path, reference_fsdp: FinishedJob) -> None:
    """The departing rank hands its own shard (held nowhere else) to the spare, live."""
    step, _ = _point()
    run = _run(base, "1x4_migrate", mesh="1x4", migrate=f"2:{step}")
    run.check_ok()
    _assert_same_final_state(run, reference_fsdp)
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[2]}) == 2
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [2] and migrated[0]["handoff_ok"], migrated
    departed = run.of_kind("torchpass.departed")
    assert departed and departed[0]["handoff_ok"] and departed[0]["handoff_bytes"] > 0
    assert not run.of_kind("torchpass.member_failed")


def test_pure_fsdp_sudden_loss_stops_with_the_reason(base: Path) -> None:
    """Without a replica and with peer copies off, a crashed rank's shard exists nowhere: the job stops and says
    so (no invented state). With them (the default), tests/unit/test_torchpass_fsdp_peercopy.py."""
    step, layer = _point()
    run = _run(base, "1x4_lost", mesh="1x4", kill=f"1:{step}:allgather:{layer}", settings=("peer_copies=0",))
    assert run.returncode != 0
    failed = run.of_kind("torchpass.failed")
    assert failed and "shard 1" in failed[0]["reason"] and "no member holds" in failed[0]["reason"], failed
