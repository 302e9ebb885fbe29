"""TorchPass's oracle for tensor parallelism beside HSDP: jobs with injected faults end bitwise equal to the
fault-free run, every step committed once, a failed rank rebuilt from the rank at its (shard, tp) coordinate in
the other replica.

Each test launches a real local job (``python -m torchpass run --local``, gloo on 127.0.0.1) of a small
Llama-shaped model (attention and MLP blocks, RMSNorm, an output head) trained deterministically with AdamW,
``tp.clip_grad_norm_`` (over gradients on two meshes) and an LR scheduler, sharded with
``ctx.wrap_fsdp(mesh_shape=(R, S), tp=T, tp_plan=...)``: a Colwise/Rowwise plan as torchtitan's
``parallelize_llama`` writes it (without sequence parallelism), then ``fully_shard`` per block over the
(replicate, shard) submesh. Layouts: (dp_replicate 2 x tp 2), 4 ranks; (2 x dp_shard 2 x tp 2), 8 ranks.
This file is also the rank script: executed directly, it trains.

Faults (``CW_TEST_KILL``: ``slot:step:phase:layer``, comma separated; a marker file makes each happen once) are
SIGKILLs the rank deals itself at a point of the step:

* ``tpforward``: in block ``layer``'s forward, after its MLP's RowwiseParallel ``w2`` computed its partial sum and
  before the all-reduce over the TP group (the TP peer waits in that all-reduce for a dead rank);
* ``tpgather``: in the output head's forward, after its ColwiseParallel matmul and before the all-gather of the
  logits over the TP group (``output_layouts=Replicate()``);
* ``tpbackward``: in the backward pass, before block ``layer``'s attention input gradient is all-reduced over the
  TP group (the gradient of ColwiseParallel ``wq``'s output arrives; the TP peer waits in the all-reduce);
* ``optimizer``: inside the optimizer step;
* ``moment``: at a random moment of the step (``layer``: thousandths of the step before's wall time).

* ``crashnode-PHASE`` (PHASE one of the above but ``moment``; the sandbox test,
  tests/integration/test_torchpass_tp_sandbox.py): at that point the rank writes ``crash-request-SLOT-STEP``
  naming its Slurm node and waits there for the test to crash the whole node (both TP ranks on it).

With ``CW_TEST_KILL_TOGETHER=1`` the victims die as one crash (a node: both TP ranks of one replica row): each
waits at its point until every victim reached its own, then kills itself.

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
STEPS = 10
LAYERS = 2  # transformer blocks (the kill points' ``layer``)
RUN_TIMEOUT_S = 180


# ======================================================================================================
# The rank script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torch.utils.data import TensorDataset

    import torchpass as tp
    from torchpass.rank.transfer_plan import ShardedReplicas

    out = Path(os.environ["CW_TEST_DIR"])
    steps = int(os.environ.get("CW_TEST_STEPS", str(STEPS)))
    replicas, shards, tp_size = (int(v) for v in os.environ.get("CW_TEST_MESH", "2x1x2").split("x"))
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    sequence_parallel = os.environ.get("CW_TEST_SP") == "1"
    migrate = os.environ.get("CW_TEST_MIGRATE", "")

    def journal(slot: int, line: str) -> None:
        with open(out / f"journal-slot{slot}.txt", "a") as f:
            f.write(f"{line} {os.getpid()}\n")

    def maybe_kill(phase: str, layer: int = -1) -> None:
        specs = [(str(ctx.slot), str(ctx.step), p, str(layer)) for p in (phase, f"crashnode-{phase}")]
        spec = next((s for s in specs if s in kills), None)
        if spec is None:
            return
        if replicas == 1:  # no replica: first the neighbours acknowledge the copy of the last commit
            peers = ctx.shard_state(ShardedReplicas(1, shards * tp_size, tp=tp_size)).peers
            assert peers is not None and peers.wait_sent(30.0) >= ctx.committed_step, "no acknowledged copy"
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
    if os.environ.get("CW_TEST_NODE_RANKS"):  # the node this slot stands for: the peer-copy ring's input
        os.environ["SLURMD_NODENAME"] = f"node{ctx.slot // int(os.environ['CW_TEST_NODE_RANKS'])}"

    dim, heads, hidden, seq = 16, 4, 32, 6

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = (w(x).view(b, n, -1, dim // heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            scores = (q @ k.transpose(-2, -1)) / (dim // heads) ** 0.5
            mask = torch.full((n, n), float("-inf")).triu(1)
            attended = torch.softmax(scores + mask, dim=-1) @ v  # local heads only: dim // tp per rank
            return self.wo(attended.transpose(1, 2).reshape(b, n, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

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
    plan: dict[str, Any] = {"output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(LAYERS):
        plan |= {f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")}
        plan |= {f"layers.{i}.attention.wo": RowwiseParallel(), f"layers.{i}.feed_forward.w2": RowwiseParallel()}
    if sequence_parallel:  # torchtitan's full plan: norms sequence-sharded, Rowwise outputs reduce-scattered
        seq_sharded = (Shard(1),)
        plan = {
            "layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=seq_sharded, use_local_output=True
            ),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        for i in range(LAYERS):
            for norm, sub in (("attention_norm", "attention"), ("ffn_norm", "feed_forward")):
                plan[f"layers.{i}.{norm}"] = SequenceParallel()
                plan[f"layers.{i}.{sub}"] = PrepareModuleInput(
                    input_layouts=seq_sharded, desired_input_layouts=(Replicate(),)
                )
            plan |= {f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            plan |= {f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")}
            plan |= {
                f"layers.{i}.{w}": RowwiseParallel(output_layouts=Shard(1)) for w in ("attention.wo", "feed_forward.w2")
            }
    for index, block in enumerate(blocks):  # before the plan's hooks: ahead of w2's all-reduce
        block.feed_forward.w2.register_forward_hook(lambda *_, i=index: maybe_kill("tpforward", i))
    plain.output.register_forward_hook(lambda *_: maybe_kill("tpgather"))  # ahead of the logits' all-gather
    if tp_size == 1:  # the same model without tensor parallelism: HSDP only (the numerical cross-check)
        model = ctx.wrap_fsdp(plain, mesh_shape=(replicas, shards), shard=Block)
    else:
        model = ctx.wrap_fsdp(plain, mesh_shape=(replicas, shards), tp=tp_size, tp_plan=plan, shard=Block)
    wq: Any = blocks[0].attention.wq.weight
    layout = (wq.device_mesh.mesh_dim_names, [str(p) for p in wq.placements], tuple(wq.to_local().shape))
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01))
    sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    ctx.on_commit(lambda step: journal(ctx.slot, f"commit {ctx.generation} {step}"))

    def before_backward_of(layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:  # arrives before wq's backward, whose input gradient is all-reduced over TP
                output.register_hook(lambda grad: maybe_kill("tpbackward", layer))

        return hook

    for index, block in enumerate(blocks):
        block.attention.wq.register_forward_hook(before_backward_of(index))
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
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        tp.clip_grad_norm_(model.parameters(), max_norm=0.5)  # over both meshes' gradients
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
print(f"test_torchpass_tp: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)


def _ranks(mesh: str) -> int:
    replicas, shards, tp = (int(v) for v in mesh.split("x"))
    return replicas * shards * tp


def _point() -> tuple[int, int]:
    """A random step (not the first or last two) and block."""
    return _draw.randrange(2, STEPS - 2), _draw.randrange(LAYERS)


def _run(
    base: Path,
    name: str,
    *,
    mesh: str = "2x1x2",
    kill: str = "",
    spares: int = 1,
    together: bool = False,
    sp: bool = False,
    migrate: str = "",
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_MESH=mesh)
    env["CW_TEST_KILL_TOGETHER"] = "1" if together else ""
    env["CW_TEST_SP"] = "1" if sp else ""
    env["CW_TEST_MIGRATE"] = migrate
    env["CW_TEST_NODE_RANKS"] = str(_ranks(mesh) // 2) if mesh.startswith("1x") else ""  # two "nodes"
    # the runtime net compares the replicas of each (shard, tp) part every 3 steps (a mismatch stops the job)
    cmd = local_command(out, SCRIPT, nproc=_ranks(mesh), spares=spares, settings=("replica_check_every_steps=3",))
    with open(out / "launcher.log", "w") as log:  # a file, so that a hung job's output is still there to read
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher's ranks die with it (PR_SET_PDEATHSIG)
            returncode = proc.wait()
    return FinishedJob(out, returncode, (out / "launcher.log").read_text())


def _assert_same_final_state(run: FinishedJob, reference: FinishedJob, ranks: int) -> None:
    expected = load_final(reference.out, 0)
    assert expected["committed"] == STEPS - 1
    for slot in range(ranks):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")


def _assert_each_step_once(run: FinishedJob, ranks: int) -> dict[int, list[tuple[str, int, int, int]]]:
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


def _check_fault(run: FinishedJob, reference: FinishedJob, kill: str, mesh: str = "2x1x2") -> list[dict[str, Any]]:
    """The oracle, and the moves: each victim's state came from its coordinate in the other replica."""
    run.check_ok()
    ranks = _ranks(mesh)
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    _assert_same_final_state(run, reference, ranks)
    journals = _assert_each_step_once(run, ranks)
    victims = sorted({int(spec.split(":")[0]) for spec in kill.split(",")})
    for slot in victims:
        assert len({pid for *_, pid in journals[slot]}) == 2, f"slot {slot} was not taken over by another process"
    recovered = run.of_kind("torchpass.recovered")
    assert recovered, f"no recovery: {run.output[-4000:]}"
    moves = [m for f in recovered for m in f.get("moves", [])]
    per_replica = ranks // 2
    tp = int(mesh.split("x")[2])
    for move in moves:  # the same (shard, tp) coordinate, from the other replica
        assert move["source"] % per_replica == move["target"] % per_replica == move["part"], moves
        assert move["source"] // per_replica != move["target"] // per_replica, moves
        shard, rank_in_tp = divmod(move["part"], tp)
        assert move["what"] == f"part {move['part']} (shard {shard}, tp {rank_in_tp}) of the {mesh} mesh", moves
        assert move["bytes"] > 0, moves
    for slot in victims:
        assert any(m["target"] == slot for m in moves), f"slot {slot} received nothing: {moves}"
    return moves


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-tp")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    """The fault-free (2 x tp 2) run every faulted one must match bit for bit."""
    run = _run(base, "reference")
    run.check_ok()
    return run


def test_fault_free_tp_run_is_consistent(reference: FinishedJob) -> None:
    """Every slot gathers the same full state, and it is not the initial one (training moved it)."""
    _assert_each_step_once(reference, 4)
    assert not reference.of_kind("torchpass.recovered")
    expected = load_final(reference.out, 0)
    for slot in range(1, 4):
        assert_bitwise_equal(load_final(reference.out, slot), expected, f"slot {slot}")
    assert expected["optim"]["state"], "no optimizer state: nothing trained"
    assert "the replicas agree" in reference.output, "the runtime net never compared the replicas"
    # wq is cut by rows over tp (ColwiseParallel) and FSDP's dim-0 shard over (replicate, shard): 16 / 2 rows
    names, placements, local = expected["layout"]
    assert names == ("replicate", "shard", "tp") and placements[2] == "S(0)" and local == (8, 16), expected["layout"]


def test_planned_migration_moves_a_tp_rank_with_its_state(base: Path, reference: FinishedJob) -> None:
    """A planned migration (clockwork migrate, the GPU health watch) of a TP rank: the departing rank hands its own
    (shard, tp) state to the spare, and the job ends bitwise equal to the fault-free run."""
    step, _ = _point()
    victim = _draw.randrange(4)
    run = _run(base, "migrate", migrate=f"{victim}:{step}")
    run.check_ok()
    _assert_same_final_state(run, reference, 4)
    journals = _assert_each_step_once(run, 4)
    assert len({pid for *_, pid in journals[victim]}) == 2, f"slot {victim} was not moved to another process"
    migrated = run.of_kind("torchpass.migrated")
    assert migrated and migrated[0]["slots"] == [victim] and migrated[0]["handoff_ok"], migrated
    assert not run.of_kind("torchpass.member_failed")


@pytest.fixture(scope="module")
def without_tp(base: Path) -> FinishedJob:
    """The same job without tensor parallelism: HSDP 2 x 1."""
    run = _run(base, "no-tp", mesh="2x1x1")
    run.check_ok()
    return run


def _assert_close(run: FinishedJob, plain: FinishedJob) -> None:
    import torch

    expected, got = load_final(plain.out, 0)["model"], load_final(run.out, 0)["model"]
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-5, rtol=1e-4), name


def test_tp_trains_the_model_hsdp_alone_trains(reference: FinishedJob, without_tp: FinishedJob) -> None:
    """The same job without tensor parallelism (HSDP 2 x 1) ends numerically at the same weights (not bitwise: TP
    sums in another order): the TP plan's collectives run, and a TP group's ranks train on the same batch."""
    _assert_close(reference, without_tp)


@pytest.fixture(scope="module")
def reference_sp(base: Path) -> FinishedJob:
    """The fault-free run of torchtitan's full plan (sequence parallelism: reduce-scatters and all-gathers)."""
    run = _run(base, "sp-reference", sp=True)
    run.check_ok()
    return run


@pytest.mark.parametrize("phase", ["tpforward", "tpbackward"], ids=["forward-reducescatter", "backward-reducescatter"])
def test_sequence_parallel_plan_survives_a_sigkill_in_its_reduce_scatter(
    base: Path, reference_sp: FinishedJob, without_tp: FinishedJob, phase: str
) -> None:
    """SequenceParallel norms and PrepareModuleInput around attention and MLP, RowwiseParallel outputs sharded by
    sequence: the TP peer waits in a reduce-scatter (forward: w2's output; backward: the attention input's
    gradient) for a dead rank. The run ends bitwise equal to its fault-free run, which trains the same model as
    HSDP alone does."""
    _assert_close(reference_sp, without_tp)
    step, layer = _point()
    victim = _draw.randrange(4)
    kill = f"{victim}:{step}:{phase}:{layer}"
    run = _run(base, "sp-kill-" + kill.replace(":", "-"), kill=kill, sp=True)
    moves = _check_fault(run, reference_sp, kill)
    assert [m["source"] for m in moves if m["target"] == victim] == [victim ^ 2], moves


@pytest.mark.parametrize(
    ("phase", "slot"),
    [("tpforward", 0), ("tpgather", None), ("tpbackward", None), ("optimizer", None), ("moment", None)],
    ids=["forward-tp-allreduce-slot0", "forward-tp-allgather", "backward-tp-allreduce", "optimizer-step", "moment"],
)
def test_sigkill_rebuilds_the_coordinate_from_the_other_replica(
    base: Path, reference: FinishedJob, phase: str, slot: int | None
) -> None:
    victim = slot if slot is not None else _draw.randrange(1, 4)
    step, layer = _point()
    if phase in ("optimizer", "tpgather"):
        layer = -1
    elif phase == "moment":
        layer = _draw.randrange(50, 950)
    kill = f"{victim}:{step}:{phase}:{layer}"
    print(f"kill {kill}")
    run = _run(base, "kill-" + kill.replace(":", "-"), kill=kill)
    moves = _check_fault(run, reference, kill)
    assert [m["source"] for m in moves if m["target"] == victim] == [victim ^ 2], moves


def test_node_crash_kills_a_whole_tp_group(base: Path, reference: FinishedJob) -> None:
    """Both TP ranks of replica 1 (slots 2 and 3: one node at 2 ranks per node) die in the same step; two spares
    take them, each fed by its counterpart in replica 0 (slots 0 and 1) at the same step."""
    step, layer = _point()
    kill = f"2:{step}:tpforward:{layer},3:{step}:tpforward:{layer}"
    run = _run(base, "node-crash", kill=kill, spares=2, together=True)
    moves = _check_fault(run, reference, kill)
    assert {m["target"]: m["source"] for m in moves} == {2: 0, 3: 1}, moves


def test_three_dimensional_mesh_with_a_shard_dimension(base: Path) -> None:
    """(dp_replicate 2 x dp_shard 2 x tp 2), 8 ranks: a SIGKILL in a TP all-reduce in backward ends bitwise equal
    to the same job without one."""
    mesh = "2x2x2"
    reference = _run(base, "2x2x2-reference", mesh=mesh)
    reference.check_ok()
    step, layer = _point()
    victim = _draw.randrange(8)
    kill = f"{victim}:{step}:tpbackward:{layer}"
    run = _run(base, "2x2x2-kill", mesh=mesh, kill=kill)
    moves = _check_fault(run, reference, kill, mesh)
    assert [m["source"] for m in moves if m["target"] == victim] == [victim ^ 4], moves


@pytest.fixture(scope="module")
def reference_pure(base: Path) -> FinishedJob:
    """The fault-free (dp_shard 2 x tp 2) run, no replica: every rank's state exists once, plus its peer copy."""
    run = _run(base, "1x2x2-reference", mesh="1x2x2")
    run.check_ok()
    return run


# The peer-copy ring over (dp_shard 2 x tp 2) on two nodes of two ranks (a TP group each): node0 holds slots 0
# and 1, node1 slots 2 and 3; neighbours sit on different nodes, so each slot's copy is on the other node.
PURE_RING_SUCCESSOR = {0: 2, 2: 1, 1: 3, 3: 0}


def _check_pure_fault(run: FinishedJob, reference: FinishedJob, kill: str) -> dict[int, int]:
    """The oracle without a replica: bitwise equal, every step once (the victims were killed once their last
    commit's copies were acknowledged, so nothing is computed twice); each victim's source, by target."""
    run.check_ok()
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    _assert_same_final_state(run, reference, 4)
    _assert_each_step_once(run, 4)
    recovered = run.of_kind("torchpass.recovered")
    assert recovered and all(r.get("recomputed_steps", 0) == 0 for r in recovered), recovered
    moves = [m for r in recovered for m in r.get("moves", [])]
    assert all(m["bytes"] > 0 and m["part"] == m["target"] for m in moves), moves
    return {m["target"]: m["source"] for m in moves}


def test_without_a_replica_a_tp_rank_is_rebuilt_from_its_peer_copy(base: Path, reference_pure: FinishedJob) -> None:
    """(1 x dp_shard 2 x tp 2) with peer copies: a SIGKILL at a random TP collective is rebuilt from the copy on the
    ring neighbour, which lives on the other node, and no step is computed twice. (A kill in the optimizer step,
    after the step's last collective, lets the survivors commit a step whose copy of the victim's state never
    exists: the job then rolls back one step in memory and recomputes it, bitwise equal still; that window is
    tests/unit/test_torchpass_fsdp_peercopy.py's.)"""
    step, layer = _point()
    phase = _draw.choice(["tpforward", "tpgather", "tpbackward"])
    victim = _draw.randrange(4)
    kill = f"{victim}:{step}:{phase}:{-1 if phase == 'tpgather' else layer}"
    print(f"kill {kill}")
    run = _run(base, "1x2x2-kill-" + kill.replace(":", "-"), mesh="1x2x2", kill=kill)
    sources = _check_pure_fault(run, reference_pure, kill)
    assert sources == {victim: PURE_RING_SUCCESSOR[victim]}, sources


def test_without_a_replica_a_node_crash_is_rebuilt_from_the_copies_on_the_other_node(
    base: Path, reference_pure: FinishedJob
) -> None:
    """Both TP ranks of node0 (slots 0 and 1) die in one step: nothing holds their state but the copies, and the
    ring put those on node1 (slots 2 and 3); two spares take them and the job ends bitwise equal."""
    step, layer = _point()
    kill = f"0:{step}:tpforward:{layer},1:{step}:tpforward:{layer}"
    run = _run(base, "1x2x2-node-crash", mesh="1x2x2", kill=kill, spares=2, together=True)
    assert _check_pure_fault(run, reference_pure, kill) == {0: 2, 1: 3}
