"""Gradient accumulation in an unmodified FSDP2 script (transparent mode): a failure inside an accumulation window
redoes the window from its first micro-batch, and the job ends bitwise equal per slot to the fault-free run.

The defect this guards against (issue 40): FSDP2 keeps a micro-batch's gradients outside the parameters while
``set_requires_gradient_sync(False)`` holds them back (``FSDPParam``'s unsharded gradient, reduce-scattered only
with the window's last micro-batch). ``zero_grad`` never reaches them, so a survivor whose window was abandoned
after such a micro-batch carried them into the redone window, and the reduce-scatter summed them in: every rank
ended equal to every other and different from the fault-free run, with exit code 0.

The rank script is this file, executed directly: a plain FSDP2 script of the shape users write (tied input and
output embeddings, ``fully_shard`` on each block and on the model, AdamW with two parameter groups, a LambdaLR
stepped once per optimizer step, ``clip_grad_norm_``, ``ACCUMULATE`` micro-batches per optimizer step, the
first ones under ``set_requires_gradient_sync(False)``, counted with ``enumerate(loader)``). It imports nothing
from TorchPass. ``CW_TEST_KILL`` is ``slot:step:micro:phase``: that slot SIGKILLs itself in micro-batch ``micro``
of optimizer step ``step`` (AdamW's count, which moves with the state), in its forward pass (``forward``) or in
the backward pass of its first block (``backward``); a marker file makes it happen once. ``CW_TEST_MESH``
(``RxS``) is the mesh. ``CW_TEST_SAMPLES`` sizes the data set (144: passes of 9 batches, so each pass ends with
a micro-batch whose gradients FSDP2 holds back for the next pass's first window).
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
SAMPLES = 128
BATCH = 4
ACCUMULATE = 2
EPOCHS = 2
STEPS = EPOCHS * SAMPLES // (BATCH * NPROC * ACCUMULATE)  # 8 optimizer steps
VOCAB, WIDTH, CONTEXT = 24, 16, 6
RUN_TIMEOUT_S = 150


def _rank_main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = Path(os.environ["CW_TEST_DIR"])
    kill = os.environ.get("CW_TEST_KILL", "")

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = int(os.environ.get("CW_TEST_MESH", "2x2").split("x")[0])
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.relu(self.up(h)))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied input and output embeddings

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    torch.manual_seed(1234)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for _, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for _, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    first = next(iter(model.parameters()))
    micro = [0]

    def step_no() -> int:
        state = opt.state.get(first)
        return int(state["step"]) if state else 0

    def maybe_kill(phase: str) -> None:
        if kill != f"{rank}:{step_no()}:{micro[0]}:{phase}":
            return
        try:
            os.close(os.open(out / f"killed-{kill.replace(':', '-')}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # done once: the replacement must not kill itself too
        os.kill(os.getpid(), signal.SIGKILL)

    model.blocks[0].register_forward_pre_hook(lambda *_: maybe_kill("forward"))
    model.blocks[0].register_full_backward_hook(lambda *_: maybe_kill("backward"))

    generator = torch.Generator().manual_seed(7)
    samples = int(os.environ.get("CW_TEST_SAMPLES") or SAMPLES)
    tokens = torch.randint(0, VOCAB, (samples, CONTEXT + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            micro[0] = i % ACCUMULATE
            last = micro[0] == ACCUMULATE - 1
            model.set_requires_gradient_sync(last)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / ACCUMULATE
            loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                opt.step()
                sched.step()
                opt.zero_grad()

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
print(f"test_torchpass_fsdp_accumulation: CW_TEST_SEED={SEED}")


def _run(base: Path, name: str, *, mesh: str, kill: str = "", samples: int = SAMPLES) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_KILL=kill, CW_TEST_MESH=mesh, CW_TEST_SAMPLES=str(samples))
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=1, flags=["--transparent"])
    return run_logged(out, cmd, env, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-fsdp-accumulation")


_references: dict[str, FinishedJob] = {}


def _reference(base: Path, mesh: str) -> FinishedJob:
    """The fault-free run of ``mesh``: every slot equal, AdamW stepped once per window."""
    if mesh not in _references:
        run = _run(base, f"reference-{mesh}", mesh=mesh)
        run.check_ok()
        expected = load_final(run.out, 0)
        steps = {int(s["step"]) for s in expected["optim"]["state"].values()}
        assert steps == {STEPS}, f"AdamW took {steps} steps, the loader has {STEPS} windows"
        for slot in range(1, NPROC):
            assert_bitwise_equal(load_final(run.out, slot), expected, f"slot {slot}")
        _references[mesh] = run
    return _references[mesh]


@pytest.mark.parametrize(
    ("mesh", "slot", "step", "micro", "phase"),
    [
        # The defect's moment: the shard-group peer of the killed slot fails in the all-gather of the first
        # micro-batch's backward, finishes that backward (its unsharded gradients accumulate) and redoes the window.
        ("2x2", 1, 3, 0, "backward"),
        ("1x4", 2, 4, 0, "backward"),
        # The second micro-batch's forward: the first one's gradients are held back on every survivor.
        ("2x2", 3, 5, 1, "forward"),
        ("2x2", 1, 3, 0, "forward"),
        ("1x4", 0, 2, 0, "forward"),
    ],
)
def test_killed_inside_an_accumulation_window_ends_bitwise_equal(
    base: Path, mesh: str, slot: int, step: int, micro: int, phase: str
) -> None:
    reference = _reference(base, mesh)
    kill = f"{slot}:{step}:{micro}:{phase}"
    run = _run(base, f"kill-{mesh}-{kill.replace(':', '-')}", mesh=mesh, kill=kill)
    run.check_ok()
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    assert run.of_kind("torchpass.recovered"), "no recovery was recorded"
    for other in range(NPROC):
        assert_bitwise_equal(load_final(run.out, other), load_final(reference.out, other), f"slot {other}")


def test_killed_at_a_random_moment_of_a_window_ends_bitwise_equal(base: Path) -> None:
    draw = random.Random(SEED)
    mesh = draw.choice(["2x2", "1x4"])
    kill = f"{draw.randrange(NPROC)}:{draw.randrange(1, STEPS - 1)}:{draw.randrange(ACCUMULATE)}:"
    kill += draw.choice(["forward", "backward"])
    print(f"mesh {mesh}, kill {kill}")
    reference = _reference(base, mesh)
    run = _run(base, f"random-{mesh}", mesh=mesh, kill=kill)
    run.check_ok()
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    for other in range(NPROC):
        assert_bitwise_equal(load_final(run.out, other), load_final(reference.out, other), f"slot {other}")


def test_a_failure_while_fsdp_holds_back_a_passes_last_micro_batch_stops_the_job(base: Path) -> None:
    """Passes of 9 batches: each ends with one micro-batch under ``set_requires_gradient_sync(False)``, whose
    gradients FSDP2 holds back and sums into the next pass's first window (whatever the script zeroes). Those of a
    lost rank cannot be rebuilt, so a SIGKILL in that window stops the job with the reason."""
    kill = "1:4:1:forward"  # AdamW's 5th update, pass 1's second micro-batch
    run = _run(base, "held-back-at-pass-end", mesh="2x2", kill=kill, samples=144)
    assert (run.out / f"killed-{kill.replace(':', '-')}").exists(), "the fault was not injected"
    assert run.returncode != 0, "the job finished although held-back gradients were lost"
    assert "committed without an optimizer step and left its gradients" in run.output, run.output[-4000:]
