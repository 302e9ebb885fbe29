"""TorchPass's oracle for expert parallelism beside HSDP: jobs with injected faults end bitwise equal to the
fault-free run, every step committed once, a failed rank rebuilt from the rank at its ep coordinate in the other
replica (its experts, its FSDP shard of everything else, optimizer and scheduler state).

Each test launches a real local job (``python -m torchpass run --local``, gloo on 127.0.0.1) of a small
Llama-shaped MoE model (attention blocks whose feed-forward is a top-1 :class:`torchpass.sharded.expert_parallel.MoE`
of 4 experts, RMSNorm, an output head) trained deterministically with AdamW and an LR scheduler (two micro-batches
accumulated per step), sharded with ``ctx.wrap_fsdp(mesh_shape=(2, 2), ep=2, shard=Block)``: (dp_replicate 2 x ep
2), 4 ranks + 1 spare, each rank its own batch, tokens moved to their experts' rank and back with all-to-all.
This file is also the rank script: executed directly, it trains.

Faults (``CW_TEST_KILL``: ``slot:step:phase:layer``; a marker file makes each happen once) are SIGKILLs the rank
deals itself at a point of the step:

* ``epforward``: in block ``layer``'s MoE, after its router ran and before the dispatch all-to-all (the ep peer
  waits in that all-to-all for a dead rank);
* ``epbackward``: in the backward pass, when the gradient of block ``layer``'s MoE output arrives, before the
  combine all-to-all's backward (the ep peer waits in it);
* ``optimizer``: inside the optimizer step;
* ``moment``: at a random moment of the step (``layer``: thousandths of the step before's wall time).

The oracle: every slot's gathered model (non-expert parameters ``full_tensor``-ed; expert weights are the slot's
own), optimizer and scheduler state are ``torch.equal`` to the same slot's in the fault-free run; each slot's
journal shows every step committed exactly once.
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
STEPS = 8
LAYERS = 2
RANKS = 4
RUN_TIMEOUT_S = 180


# ======================================================================================================
# The rank script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.utils.data import TensorDataset

    import torchpass as tp
    from torchpass.sharded.expert_parallel import MoE

    if os.environ.get("CW_TEST_TRANSPARENT") == "1":  # an unmodified script's MoE mesh: refused at start
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(backend="gloo")
        init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp_replicate", "ep"))
        return 0

    out = Path(os.environ["CW_TEST_DIR"])
    steps = int(os.environ.get("CW_TEST_STEPS", str(STEPS)))
    ep = int(os.environ.get("CW_TEST_EP", "2"))
    tp_size = int(os.environ.get("CW_TEST_TP", "1"))
    shards = int(os.environ.get("CW_TEST_SHARDS", "2"))
    replicas = int(os.environ.get("CW_TEST_REPLICAS", "2"))
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    migrate = os.environ.get("CW_TEST_MIGRATE", "")

    def journal(slot: int, line: str) -> None:
        with open(out / f"journal-slot{slot}.txt", "a") as f:
            f.write(f"{line} {os.getpid()}\n")

    def maybe_kill(phase: str, layer: int = -1) -> None:
        spec = (str(ctx.slot), str(ctx.step), phase, str(layer))
        if spec not in kills:
            return
        try:
            fd = os.open(out / ("killed-" + "-".join(spec)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # done once: the replacement must not kill itself too
        os.write(fd, f"{time.time()}\n".encode())
        os.close(fd)
        if os.environ.get("CW_TEST_KILL_TOGETHER") == "1":  # one crash of all victims: each waits for the rest
            markers = [out / ("killed-" + "-".join(k)) for k in kills]
            deadline = time.monotonic() + 60.0
            while not all(m.exists() for m in markers) and time.monotonic() < deadline:
                time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    def sink(kind: str, fields: dict[str, Any]) -> None:
        if kind == "torchpass.joined" and fields["received"]:
            journal(fields["slot"], f"adopt {fields['generation']} {fields['resume_step'] - 1}")

    ctx = tp.init(event_sink=sink)

    dim, heads, hidden, seq, experts = 16, 4, 32, 6, 4

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = (w(x).view(b, n, -1, dim // heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            scores = (q @ k.transpose(-2, -1)) / (dim // heads) ** 0.5
            attended = torch.softmax(scores + torch.full((n, n), float("-inf")).triu(1), dim=-1) @ v
            return self.wo(attended.transpose(1, 2).reshape(b, n, -1))  # under TP: this rank's heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attention, self.moe = Attention(), MoE(dim, hidden, experts)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.attention_norm(x))
            return x + self.moe(self.ffn_norm(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block(x)
            return self.output(self.norm(x))

    torch.manual_seed(1234)
    plain = Model()
    blocks: list[Block] = list(plain.layers)  # type: ignore[arg-type]

    def before_backward_of(layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:  # the MoE output's gradient comes before the combine all-to-all's backward
                output.register_hook(lambda grad: maybe_kill("epbackward", layer))

        return hook

    for index, block in enumerate(blocks):
        block.moe.router.register_forward_hook(lambda *_, i=index: maybe_kill("epforward", i))
        block.moe.register_forward_hook(before_backward_of(index))
        # before the plan's hooks: after wo's partial sum, ahead of its all-reduce over the TP group
        block.attention.wo.register_forward_hook(lambda *_, i=index: maybe_kill("tpforward", i))
    tensor_parallel: dict[str, Any] = {}
    if tp_size > 1:  # the attention cut over tp (Megatron's), the MoE left whole on every TP rank
        plan: dict[str, Any] = {}
        for i in range(LAYERS):
            plan |= {f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        tensor_parallel = {"tp": tp_size, "tp_plan": plan}
    model = ctx.wrap_fsdp(plain, mesh_shape=(replicas, shards), ep=ep, shard=Block, **tensor_parallel)
    w1 = blocks[0].moe.w1
    layout = (ctx.mesh.mesh_dim_names if ep > 1 and ctx.mesh is not None else None, type(w1).__name__, tuple(w1.shape))
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01))
    sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    ctx.on_commit(lambda step: journal(ctx.slot, f"commit {ctx.generation} {step}"))
    opt.register_step_pre_hook(lambda *_: maybe_kill("optimizer"))

    def kill_at_a_moment(step: int, took_s: float) -> None:
        for spec in kills:
            marker = out / ("killed-" + "-".join(spec))
            if spec[:3] != (str(ctx.slot), str(step), "moment") or marker.exists():
                continue

            def fire(marker: Path = marker) -> None:
                marker.write_text(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(int(spec[3]) / 1000 * took_s, fire).start()

    generator = torch.Generator().manual_seed(7)
    x_all = torch.randn(256, seq, dim, generator=generator)
    y_all = x_all[..., :4] * 0.5 + 0.1 * torch.randn(256, seq, 4, generator=generator)
    loader = tp.StepLoader(TensorDataset(x_all, y_all), batch_size=4, seed=3)

    began = time.monotonic()
    for step, (x, y) in ctx.steps(loader, steps):
        now = time.monotonic()
        kill_at_a_moment(step, now - began)
        began = now
        if migrate:  # a planned migration of slot S at step N, asked by another rank (as clockwork migrate would)
            slot, when = (int(v) for v in migrate.split(":"))
            if ctx.slot == (1 if slot == 0 else 0) and step == when and not (out / "migrate-requested").exists():
                (out / "migrate-requested").write_text(str(ctx.request_migration(slot)))
        for part in range(2):  # gradient accumulation: two micro-batches of 2 sequences per step
            chunk = slice(2 * part, 2 * part + 2)
            (nn.functional.mse_loss(model(x[chunk]), y[chunk]) / 2).backward()
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
        "committed": ctx.committed_step,
        "layout": layout,
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
print(f"test_torchpass_ep: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)


def _point() -> tuple[int, int]:
    """A random step (not the first or last two) and block."""
    return _draw.randrange(2, STEPS - 2), _draw.randrange(LAYERS)


def _run(
    base: Path,
    name: str,
    *,
    kill: str = "",
    ep: int = 2,
    spares: int = 1,
    together: bool = False,
    migrate: str = "",
    settings: tuple[str, ...] = (),
    replicas: int = 2,
    tp: int = 1,
    shards: int = 2,
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_EP=str(ep), CW_TEST_MIGRATE=migrate)
    env["CW_TEST_REPLICAS"], env["CW_TEST_TP"], env["CW_TEST_SHARDS"] = str(replicas), str(tp), str(shards)
    env["CW_TEST_KILL_TOGETHER"] = "1" if together else ""
    # the runtime net compares the replicas of each ep coordinate every 3 steps (a mismatch stops the job)
    cmd = local_command(
        out, SCRIPT, nproc=replicas * shards * tp, spares=spares, settings=("replica_check_every_steps=3", *settings)
    )
    with open(out / "launcher.log", "w") as log:  # a file, so that a hung job's output is still there to read
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher's ranks die with it (PR_SET_PDEATHSIG)
            returncode = proc.wait()
    return FinishedJob(out, returncode, (out / "launcher.log").read_text())


def _assert_each_step_once(run: FinishedJob, ranks: int = RANKS) -> dict[int, list[tuple[str, int, int, int]]]:
    """Per slot: commits are 0..N-1 in order, each once; an adopted state is the step the slot had to reach."""
    journals = {}
    for slot in range(ranks):
        lines = (run.out / f"journal-slot{slot}.txt").read_text().splitlines()
        entries = [(kind, int(gen), int(step), int(pid)) for kind, gen, step, pid in (ln.split() for ln in lines)]
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


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-ep")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    """The fault-free (dp_replicate 2 x ep 2) run every faulted one must match bit for bit, per slot; it snapshots
    after steps 3 and 7 (which must change nothing in the training)."""
    run = _run(base, "reference", settings=("snapshot_every_steps=4", f"snapshot_dir={base / 'snapshots'}"))
    run.check_ok()
    return run


def test_fault_free_ep_run_is_consistent(reference: FinishedJob) -> None:
    """The replicas of each ep coordinate end equal; the two ep coordinates hold different experts and the same
    non-expert weights; training moved the model."""
    _assert_each_step_once(reference)
    assert not reference.of_kind("torchpass.recovered")
    final = [load_final(reference.out, slot) for slot in range(RANKS)]
    for slot in range(RANKS):
        assert final[slot]["committed"] == STEPS - 1
        assert_bitwise_equal(final[slot], final[slot ^ 2], f"slot {slot} vs its replica {slot ^ 2}")
    assert final[0]["layout"] == (("replicate", "ep"), "Parameter", (2, 16, 32)), final[0]["layout"]
    experts = {k for k in final[0]["model"] if k.endswith(("moe.w1", "moe.w2"))}
    assert len(experts) == 2 * LAYERS, sorted(final[0]["model"])
    for key, value in final[0]["model"].items():
        same = bool((value == final[1]["model"][key]).all())
        assert same == (key not in experts), f"{key}: ep coordinates 0 and 1 should {'' if same else 'not '}agree"
    assert final[0]["optim"]["state"], "no optimizer state: nothing trained"
    assert "the replicas agree" in reference.output, "the runtime net never compared the replicas"


def test_ep_trains_what_hsdp_alone_trains(base: Path, reference: FinishedJob) -> None:
    """The same job without expert parallelism (every expert on every rank, HSDP 2 x 2) ends numerically at the
    same weights (not bitwise: the sums run in another order): the all-to-alls deliver each token to its expert
    and back, and the replicate-only reduction of the expert gradients is the global batch's mean."""
    import torch

    plain = _run(base, "no-ep", ep=1)
    plain.check_ok()
    for slot in range(RANKS):
        got, expected = load_final(reference.out, slot)["model"], load_final(plain.out, slot)["model"]
        assert expected.keys() == got.keys()
        for name, value in expected.items():
            if name.endswith(("moe.w1", "moe.w2")):
                value = value.chunk(2)[slot % 2]  # this ep coordinate's experts of the full set
            assert torch.allclose(got[name], value, atol=1e-5, rtol=1e-4), f"slot {slot}: {name}"


@pytest.mark.parametrize(
    ("phase", "slot"),
    [("epforward", 0), ("epbackward", None), ("optimizer", None), ("moment", None)],
    ids=["forward-all-to-all-slot0", "backward-all-to-all", "optimizer-step", "moment"],
)
def test_sigkill_rebuilds_the_ep_coordinate_from_the_other_replica(
    base: Path, reference: FinishedJob, phase: str, slot: int | None
) -> None:
    victim = slot if slot is not None else _draw.randrange(1, RANKS)
    step, layer = _point()
    if phase == "optimizer":
        layer = -1
    elif phase == "moment":
        layer = _draw.randrange(50, 950)
    kill = f"{victim}:{step}:{phase}:{layer}"
    print(f"kill {kill}")
    run = _run(base, "kill-" + kill.replace(":", "-"), kill=kill)
    moves = _check_fault(run, reference, kill)
    assert [m["source"] for m in moves if m["target"] == victim] == [victim ^ 2], moves


def _check_fault(run: FinishedJob, reference: FinishedJob, kill: str) -> list[dict[str, Any]]:
    """The oracle, and the moves: each victim's state came from its ep coordinate in the other replica."""
    run.check_ok()
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    for s in range(RANKS):
        assert_bitwise_equal(load_final(run.out, s), load_final(reference.out, s), f"slot {s}")
    journals = _assert_each_step_once(run)
    victims = sorted({int(spec.split(":")[0]) for spec in kill.split(",")})
    for victim in victims:
        assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not taken over by another process"
    recovered = run.of_kind("torchpass.recovered")
    assert recovered, f"no recovery: {run.output[-4000:]}"
    moves = [m for f in recovered for m in f.get("moves", [])]
    for move in moves:  # the same ep coordinate, from the other replica
        assert move["source"] % 2 == move["target"] % 2 == move["part"], moves
        assert move["source"] // 2 != move["target"] // 2, moves
        part = move["part"]
        assert move["what"] == f"ep {part} (experts and FSDP shard {part}) of the 2x2 (replicate x ep) mesh", moves
        assert move["bytes"] > 0, moves
    for victim in victims:
        assert any(m["target"] == victim for m in moves), f"slot {victim} received nothing: {moves}"
    return moves


def test_node_crash_kills_a_whole_replica_row(base: Path, reference: FinishedJob) -> None:
    """Both ep ranks of replica 1 (slots 2 and 3: one node at 2 ranks per node) die in the same step, inside the
    forward all-to-all; two spares take them, each fed by its ep counterpart in replica 0 (slots 0 and 1)."""
    step, layer = _point()
    kill = f"2:{step}:epforward:{layer},3:{step}:epforward:{layer}"
    run = _run(base, "node-crash", kill=kill, spares=2, together=True)
    moves = _check_fault(run, reference, kill)
    assert {m["target"]: m["source"] for m in moves} == {2: 0, 3: 1}, moves


def test_two_failures_at_different_ep_coordinates(base: Path, reference: FinishedJob) -> None:
    """One rank of each ep coordinate, in different replicas and steps (forward, then backward all-to-all): two
    recoveries, each fed from the other replica."""
    first, layer = _point()
    second = first + 1
    kill = f"1:{first}:epforward:{layer},2:{second}:epbackward:{_draw.randrange(LAYERS)}"
    run = _run(base, "two-failures", kill=kill, spares=2)
    moves = _check_fault(run, reference, kill)
    assert sorted((m["target"], m["source"]) for m in moves) == [(1, 3), (2, 0)], moves


def test_planned_migration_moves_an_ep_rank_with_its_state(base: Path, reference: FinishedJob) -> None:
    """A planned migration (clockwork migrate, the GPU health watch) of an ep rank: it hands its own experts and
    shard to the spare, and the job ends bitwise equal to the fault-free run."""
    step, _ = _point()
    victim = _draw.randrange(RANKS)
    run = _run(base, "migrate", migrate=f"{victim}:{step}")
    run.check_ok()
    for s in range(RANKS):
        assert_bitwise_equal(load_final(run.out, s), load_final(reference.out, s), f"slot {s}")
    journals = _assert_each_step_once(run)
    assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not moved to another process"
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [victim] and migrated[0]["handoff_ok"], migrated
    assert not run.of_kind("torchpass.member_failed")


def test_ep_beside_tp_rebuilds_a_rank_from_its_coordinate_in_the_other_replica(base: Path) -> None:
    """(dp_replicate 2 x ep 2 x tp 2), 8 ranks: the attention cut over tp, each TP rank keeping its ep
    coordinate's experts whole. The fault-free run's TP ranks hold the same experts and its replicas the same
    state; a SIGKILL at a random step in the forward all-to-all, the all-to-all's backward or the attention's TP
    all-reduce is rebuilt from the same (ep, tp) coordinate of the other replica, and every slot ends bitwise
    equal to the fault-free run, every step committed once."""
    ranks = 8
    reference = _run(base, "ep-tp-reference", tp=2)
    reference.check_ok()
    final = [load_final(reference.out, slot) for slot in range(ranks)]
    assert final[0]["layout"] == (("replicate", "ep", "tp"), "Parameter", (2, 16, 32)), final[0]["layout"]
    for key in (k for k in final[0]["model"] if k.endswith(("moe.w1", "moe.w2"))):
        assert torch_equal(final[0]["model"][key], final[1]["model"][key]), f"{key}: the TP ranks' experts differ"
        assert not torch_equal(final[0]["model"][key], final[2]["model"][key]), f"{key}: ep 0 and 1 agree"
    for slot in range(ranks):
        assert_bitwise_equal(final[slot], final[slot ^ 4], f"slot {slot} vs its replica {slot ^ 4}")
    step, layer = _point()
    victim, phase = _draw.randrange(ranks), _draw.choice(["epforward", "epbackward", "tpforward"])
    kill = f"{victim}:{step}:{phase}:{layer}"
    print(f"kill {kill}")
    run = _run(base, "ep-tp-kill-" + kill.replace(":", "-"), kill=kill, tp=2)
    run.check_ok()
    assert (run.out / ("killed-" + kill.replace(":", "-"))).exists(), "the fault was not injected"
    for slot in range(ranks):
        assert_bitwise_equal(load_final(run.out, slot), final[slot], f"slot {slot}")
    journals = _assert_each_step_once(run, ranks)
    assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not taken over by another process"
    moves = [m for r in run.of_kind("torchpass.recovered") for m in r.get("moves", [])]
    (move,) = [m for m in moves if m["target"] == victim]
    ep_rank, tp_rank = divmod(victim % 4, 2)
    assert move["source"] == victim ^ 4 and move["bytes"] > 0, moves
    assert (
        move["what"] == f"part {victim % 4} (ep {ep_rank}: its experts and FSDP shard, tp {tp_rank}) of the 2x2x2 mesh"
    )


def test_ep_carved_from_a_larger_dp_shard_rebuilds_a_rank_from_its_peer_copy(base: Path) -> None:
    """(1 x dp_shard 4, ep 2), ``peer_copy_sync``: FSDP shards the dense weights over 4 ranks, the experts go to
    ep groups of 2 adjacent shards, and shards 0 and 2 (1 and 3) hold the same experts. A SIGKILL in an all-to-all
    (forward or backward) is rebuilt from the ring neighbour's peer copy, bitwise equal per slot."""
    settings, ranks = ("peer_copy_sync=true",), 4
    reference = _run(base, "1x4-ep2-reference", replicas=1, shards=4, settings=settings)
    reference.check_ok()
    final = [load_final(reference.out, slot) for slot in range(ranks)]
    assert final[0]["layout"] == (("shard",), "Parameter", (2, 16, 32)), final[0]["layout"]
    for key in (k for k in final[0]["model"] if k.endswith(("moe.w1", "moe.w2"))):
        assert torch_equal(final[0]["model"][key], final[2]["model"][key]), f"{key}: ep 0's holders differ"
        assert not torch_equal(final[0]["model"][key], final[1]["model"][key]), f"{key}: ep 0 and 1 agree"
    step, layer = _point()
    victim, phase = _draw.randrange(ranks), _draw.choice(["epforward", "epbackward"])
    kill = f"{victim}:{step}:{phase}:{layer}"
    print(f"kill {kill} (1 x dp_shard 4, ep 2)")
    run = _run(base, "1x4-ep2-kill", replicas=1, shards=4, kill=kill, settings=settings)
    run.check_ok()
    assert (run.out / ("killed-" + kill.replace(":", "-"))).exists(), f"the fault {kill} was not injected"
    for slot in range(ranks):
        assert_bitwise_equal(load_final(run.out, slot), final[slot], f"slot {slot}")
    journals = _assert_each_step_once(run, ranks)
    assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not taken over by another process"
    moves = [m for f in run.of_kind("torchpass.recovered") for m in f.get("moves", [])]
    (move,) = [m for m in moves if m["target"] == victim]
    assert move["source"] == (victim + 1) % ranks and move["bytes"] > 0, moves
    assert (
        move["what"]
        == f"shard {victim} (with the experts of ep {victim % 2}) of the 1x4 (replicate x shard, ep 2) mesh"
    )


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(a.shape == b.shape and torch.equal(a, b))


def test_transparent_mode_refuses_an_expert_parallel_mesh_at_start(tmp_path: Path) -> None:
    """An unmodified script whose mesh names an ep dimension is refused before training, naming the feature."""
    env = dict(os.environ, CW_TEST_DIR=str(tmp_path), CW_TEST_TRANSPARENT="1")
    cmd = local_command(tmp_path, SCRIPT, nproc=2, spares=0, flags=["--transparent"])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "expert parallelism (MoE) in transparent mode is not built" in output, output[-3000:]


def test_restored_from_a_snapshot_ends_bitwise_equal(base: Path, reference: FinishedJob) -> None:
    """The ep job's snapshot (every ep coordinate's experts and FSDP shard) restored into a new job: every slot
    loads its own coordinate's state and ends bitwise equal to the run that wrote it."""
    steps = reference.complete_snapshots(base / "snapshots", [3, 7])
    step = 3 if 3 in steps else steps[0]
    run = _run(base, "restored", settings=(f"restore={base / 'snapshots' / f'step-{step:010d}'}",))
    run.check_ok()
    restored = run.logged("torchpass.restored")
    assert len(restored) == RANKS and {r["step"] for r in restored} == {step}, restored
    for slot in range(RANKS):
        assert_bitwise_equal(load_final(run.out, slot), load_final(reference.out, slot), f"slot {slot}")


def test_without_a_replica_peer_copies_rebuild_the_ep_coordinate(base: Path) -> None:
    """(1 x ep 2), ``peer_copy_sync``: no replica holds a rank's experts, so its ring neighbour's peer copy does. A
    SIGKILL in the backward all-to-all ends bitwise equal to the fault-free run, every step committed once."""
    settings = ("peer_copy_sync=true",)
    reference = _run(base, "1x2-reference", replicas=1, settings=settings)
    reference.check_ok()
    step, layer = _point()
    victim = _draw.randrange(2)
    kill = f"{victim}:{step}:epbackward:{layer}"
    print(f"kill {kill} (1 x ep 2)")
    run = _run(base, "1x2-kill", replicas=1, kill=kill, settings=settings)
    run.check_ok()
    assert (run.out / ("killed-" + kill.replace(":", "-"))).exists(), f"the fault {kill} was not injected"
    for s in range(2):
        assert_bitwise_equal(load_final(run.out, s), load_final(reference.out, s), f"slot {s}")
    journals = _assert_each_step_once(run, 2)
    assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not taken over by another process"
    moves = [m for f in run.of_kind("torchpass.recovered") for m in f.get("moves", [])]
    (move,) = [m for m in moves if m["target"] == victim]
    assert move["source"] == 1 - victim and move["part"] == victim and move["bytes"] > 0, moves
