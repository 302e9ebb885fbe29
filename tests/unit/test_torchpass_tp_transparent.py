"""Model-transparent mode for an unmodified torchtitan-shaped script (tensor parallelism inside a node, FSDP2 over
the rest): a SIGKILLed rank, or a whole TP group, is rebuilt at its coordinate and every slot ends bitwise equal
to the fault-free run.

The rank script is this file, executed directly: a plain PyTorch script that imports nothing from TorchPass
(``init_process_group``; ``init_device_mesh`` naming ``("dp_replicate", "dp_shard", "tp")``, or ``("dp_shard",
"tp")`` without replicas; ``parallelize_module`` of examples/llama_model.py's Llama-shaped model over
``mesh["tp"]`` with torchtitan's plan; ``fully_shard`` of each block and of the model over the data-parallel
slice; AdamW; a ``StepLR`` stepped per epoch; a ``DistributedSampler`` over the data-parallel ranks). Each test
launches it with ``python -m torchpass run --local --transparent`` (4 ranks, gloo on 127.0.0.1).

``CW_TEST_KILL`` (``slot:step:phase:layer``, comma separated; ``step`` is AdamW's own count, which moves with the
state) makes the slot SIGKILL itself, once (a marker file): ``tpforward``, in block ``layer``'s forward after its
RowwiseParallel ``w2`` computed its partial sum and before the all-reduce over the TP group; ``tpbackward``, in
the backward pass before block ``layer``'s attention input gradient is all-reduced over the TP group. With
``CW_TEST_KILL_TOGETHER=1`` the victims die as one crash: each waits at its point until all reached theirs.
Without replicas (``CW_TEST_MESH=1x2x2``) the script says it runs on node ``rank // 2`` (``SLURMD_NODENAME``,
what a Slurm step sets), so that the peer-copy ring puts each rank's copy on the other node.

``CW_TEST_UNMODIFIED`` names a script TorchPass must refuse at start: ``cp`` (a context-parallel dimension),
``tp-outer`` (tp not innermost), ``tp-mesh`` (parallelize_module over a mesh other than ``mesh["tp"]``),
``dp-mesh`` (fully_shard over the whole three-dimensional mesh).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
EXAMPLES = SCRIPT.parents[2] / "examples"
EPOCHS = 2
SAMPLES = 48
BATCH = 4
DEPTH = 2
RUN_TIMEOUT_S = 180


# ======================================================================================================
# The rank script: an unmodified torchtitan-shaped script (runs in each rank and spare process)
# ======================================================================================================


def _rank_main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DataLoader, DistributedSampler

    sys.path.insert(0, str(EXAMPLES))
    from llama_model import VOCAB, Model, make_dataset, tp_plan

    out = Path(os.environ["CW_TEST_DIR"])
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    unmodified = os.environ.get("CW_TEST_UNMODIFIED", "")
    replicas, shards, tp = (int(v) for v in os.environ.get("CW_TEST_MESH", "2x1x2").split("x"))

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    if replicas == 1:  # the node this rank stands for (two ranks per node): the peer-copy ring's input
        os.environ["SLURMD_NODENAME"] = f"node{rank // 2}"
    if unmodified == "cp":
        init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "cp", "tp"))
    if unmodified == "tp-outer":
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp_shard"))
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, shards, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_rank = mesh["dp_replicate"].get_local_rank() * shards + mesh["dp_shard"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (shards, tp), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh, dp_rank = mesh["dp_shard"], mesh["dp_shard"].get_local_rank()

    torch.manual_seed(0)
    model = Model(DEPTH)
    optimizer: Any = None
    first: Any = None  # the sharded parameter (inside forward and backward FSDP shows the unsharded ones)

    def step_no() -> int:
        state = optimizer.state.get(first) if optimizer is not None else None
        return int(state["step"]) if state else 0

    def maybe_kill(phase: str, layer: int) -> None:
        spec = (str(rank), str(step_no()), phase, str(layer))
        if spec not in kills:
            return
        try:
            os.close(os.open(out / ("killed-" + "-".join(spec)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # done once: the replacement must not kill itself too
        if os.environ.get("CW_TEST_KILL_TOGETHER") == "1":  # one crash of all victims: each waits for the rest
            deadline = time.monotonic() + 60.0
            while not all((out / ("killed-" + "-".join(k))).exists() for k in kills) and time.monotonic() < deadline:
                time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_backward_of(layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:  # arrives before wq's backward, whose input gradient is all-reduced over TP
                output.register_hook(lambda grad: maybe_kill("tpbackward", layer))

        return hook

    for index, block in enumerate(model.layers):  # before the plan's hooks: ahead of w2's all-reduce
        block.feed_forward.w2.register_forward_hook(lambda *_, i=index: maybe_kill("tpforward", i))
    parallelize_module(model, mesh["dp_shard"] if unmodified == "tp-mesh" else mesh["tp"], tp_plan(DEPTH))
    for index, block in enumerate(model.layers):  # after the plan's: on the local output wq's gradient reaches
        block.attention.wq.register_forward_hook(before_backward_of(index))
    shard_over = mesh if unmodified == "dp-mesh" else dp_mesh
    for block in model.layers:
        fully_shard(block, mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    first = next(iter(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    dataset = make_dataset(SAMPLES)
    sampler = DistributedSampler(dataset, num_replicas=replicas * shards, rank=dp_rank, seed=3, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for tokens, targets in loader:
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()

    def gathered(value: Any) -> Any:
        if hasattr(value, "full_tensor"):
            return value.full_tensor()
        if isinstance(value, dict):
            return {k: gathered(v) for k, v in value.items()}
        if isinstance(value, list):
            return [gathered(v) for v in value]
        return value

    wq: Any = model.layers[0].attention.wq.weight
    final = {
        "model": gathered(dict(model.state_dict())),
        "optim": gathered(optimizer.state_dict()),
        "sched": scheduler.state_dict(),
        "layout": (wq.device_mesh.mesh_dim_names, [str(p) for p in wq.placements], tuple(wq.to_local().shape)),
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

NPROC = 4
STEPS = EPOCHS * SAMPLES // (BATCH * 2)  # two data-parallel ranks in either mesh: 12
SEED = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
print(f"test_torchpass_tp_transparent: CW_TEST_SEED={SEED}")
_draw = random.Random(SEED)


def _run(
    base: Path, name: str, *, mesh: str = "2x1x2", kill: str = "", spares: int = 1, unmodified: str = ""
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_MESH=mesh, PYTHONWARNINGS="ignore")
    env["CW_TEST_KILL_TOGETHER"] = "1" if "," in kill else ""
    env["CW_TEST_UNMODIFIED"] = unmodified
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=spares, flags=["--transparent"])
    return run_logged(out, cmd, env, RUN_TIMEOUT_S)


def _kill_point(victims: list[int]) -> str:
    """The victims at one random step (not the first or last two), phase and block."""
    step, layer = _draw.randrange(2, STEPS - 2), _draw.randrange(DEPTH)
    phase = _draw.choice(["tpforward", "tpbackward"])
    return ",".join(f"{victim}:{step}:{phase}:{layer}" for victim in victims)


def _recovered_bitwise(run: FinishedJob, reference: FinishedJob, kill: str) -> dict[int, int]:
    """The faulted run finished, its faults injected, every slot bitwise equal to the reference's slot 0: the
    victims' sources, by target."""
    print(f"kill {kill}")
    run.check_ok()
    for spec in kill.split(","):
        assert (run.out / ("killed-" + spec.replace(":", "-"))).exists(), f"the fault {spec} was not injected"
    expected = load_final(reference.out, 0)
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")
    recovered = run.of_kind("torchpass.recovered")
    assert recovered, run.output[-4000:]
    moves = [m for r in recovered for m in r.get("moves", [])]
    assert all(m["bytes"] > 0 for m in moves), moves
    return {m["target"]: m["source"] for m in moves}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-tp-transparent")


@pytest.fixture(scope="module")
def reference(base: Path) -> FinishedJob:
    run = _run(base, "reference")
    run.check_ok()
    return run


@pytest.fixture(scope="module")
def reference_pure(base: Path) -> FinishedJob:
    run = _run(base, "reference-1x2x2", mesh="1x2x2")
    run.check_ok()
    return run


@pytest.mark.parametrize("name", ["reference", "reference_pure"])
def test_fault_free_run_is_the_scripts_own_layout(request: pytest.FixtureRequest, name: str) -> None:
    """Every slot gathers the same state after every batch trained once; the weights are cut as the script asked
    (wq: ColwiseParallel over tp, FSDP's dim-0 shard over the data-parallel slice), on the script's names."""
    run: FinishedJob = request.getfixturevalue(name)
    expected = load_final(run.out, 0)
    for slot in range(1, NPROC):
        assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")
    step = next(iter(expected["optim"]["state"].values()))["step"]
    assert int(step) == STEPS, f"AdamW took {int(step)} steps, the loader has {STEPS} batches"
    names, placements, local = expected["layout"]
    wanted = (("dp_replicate", "dp_shard", "tp"), (32, 64)) if name == "reference" else (("dp_shard", "tp"), (16, 64))
    assert (names, local) == wanted and placements[-1] == "S(0)", expected["layout"]
    assert "transparent mode:" not in run.output  # no start-up warning: the script is inside what it protects


def test_sigkill_in_a_tp_collective_rebuilds_the_rank_from_the_other_replica(
    base: Path, reference: FinishedJob
) -> None:
    """(dp_replicate 2 x tp 2): the victim's (shard, tp) state comes from its counterpart in the other replica."""
    victim = _draw.randrange(NPROC)
    kill = _kill_point([victim])
    run = _run(base, "kill-" + kill.replace(":", "-"), kill=kill)
    assert _recovered_bitwise(run, reference, kill) == {victim: victim ^ 2}


def test_without_a_replica_a_node_crash_is_rebuilt_from_the_peer_copies(
    base: Path, reference_pure: FinishedJob
) -> None:
    """(dp_shard 2 x tp 2), two ranks per node: both ranks of node0 die in one crash; their state exists only in
    the peer copies, which the ring put on node1 (slot 0's on slot 2, slot 1's on slot 3)."""
    kill = _kill_point([0, 1])
    run = _run(base, "node-crash", mesh="1x2x2", kill=kill, spares=2)
    assert _recovered_bitwise(run, reference_pure, kill) == {0: 2, 1: 3}


@pytest.mark.parametrize(
    ("unmodified", "why"),
    [
        ("cp", "names a context-parallel dimension: context parallelism is not protected"),
        ("tp-outer", "tensor-parallel dimension named tp innermost"),
        ("tp-mesh", "parallelize_module over a mesh other than mesh['tp']"),
        ("dp-mesh", "give it its data-parallel slice mesh['dp_replicate', 'dp_shard']"),
    ],
)
def test_what_transparent_mode_cannot_protect_is_refused_at_start(base: Path, unmodified: str, why: str) -> None:
    run = _run(base, f"refused-{unmodified}", spares=0, unmodified=unmodified)
    assert run.returncode != 0
    assert why in run.output, run.output[-3000:]
    assert not list(run.out.glob("final-slot*.pt")), "the script trained"
