"""The runtime net in real jobs (``torchpass run --local``, gloo on 127.0.0.1): a divergence a script makes on one
rank stops the job with the reason, a corrupted transfer stops it too, and with a check after every step a
fault-free and a faulted job end bitwise equal without a false alarm.

This file is also the rank script, in one of two shapes (``CW_TEST_MODE``):

* ``aware``: a model-aware script (``tp.init``, ``ctx.wrap_model`` or ``ctx.wrap_fsdp`` on ``CW_TEST_LAYOUT``:
  ``ddp`` or ``RxS``, AdamW, ``ctx.steps``);
* ``transparent``: a plain FSDP2 script run unmodified (``init_process_group``, ``init_device_mesh`` of
  ``CW_TEST_LAYOUT``, ``fully_shard``, AdamW, a ``DataLoader`` over a ``DistributedSampler``).

What it does wrong on purpose, with nothing of TorchPass's changed (no seam): ``CW_TEST_DIVERGE=slot:step`` makes
that slot add 1e-7 to its copy of one weight under ``torch.no_grad()`` right after its optimizer step of that step,
as a buggy callback editing one rank's weights would; ``CW_TEST_MEDDLE=1`` (aware) registers an object whose
``load_state_dict`` nudges that weight in a replacement, which then ends different from the state it received.
``CW_TEST_KILL=slot:step`` SIGKILLs that slot in the forward pass of that step, once.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve()
STEPS = 16
RUN_TIMEOUT_S = 150


def _weight(model: Any) -> Any:
    """The local tensor of the weight the script nudges (a DTensor's local shard under FSDP)."""
    weight = model.get_submodule("blocks.0.up").weight
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _model() -> Any:
    """Two residual blocks and a head, the same initial weights on every rank."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.relu(self.up(h)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 4)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(1234)
    return Net()


def _kill_once(out: Path, kill: str, slot: int, step: int) -> None:
    if kill != f"{slot}:{step}":
        return
    try:
        os.close(os.open(out / f"killed-{slot}-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # the replacement must not kill itself too
    os.kill(os.getpid(), signal.SIGKILL)


def _gathered(value: Any) -> Any:
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_gathered(v) for v in value]
    return value


def _aware_main(out: Path, layout: str, diverge: str, kill: str) -> int:
    import torch
    from torch import nn

    import torchpass as tp

    ctx = tp.init()
    model = _model()
    if layout == "ddp":
        wrapped = ctx.wrap_model(model)
    else:
        replicas, shards = (int(v) for v in layout.split("x"))
        wrapped = ctx.wrap_fsdp(model, mesh_shape=(replicas, shards), shard=nn.Linear)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))

    class Meddler:
        """A registered object whose load_state_dict also changes the model in a replacement process (as one that
        refreshes something from the process's own state might): the replacement then differs from its source once
        it has loaded the state it received (the script's fault, which the transfer check must catch)."""

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            if ctx.is_replacement:
                with torch.no_grad():
                    _weight(model).add_(1e-7)

    if os.environ.get("CW_TEST_MEDDLE") == "1":
        ctx.register("meddler", Meddler())
    model.register_forward_pre_hook(lambda *_: _kill_once(out, kill, ctx.slot, ctx.step))

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * step + ctx.slot)
        return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)

    for step, (x, y) in ctx.steps(data, STEPS):
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
        if diverge == f"{ctx.slot}:{step}":
            with torch.no_grad():
                _weight(model).add_(1e-7)  # the script's own mistake: one rank's copy of a weight edited
    final = {"model": _gathered(dict(model.state_dict())), "optim": _gathered(opt.state_dict())}
    torch.save(final, out / f"final-slot{ctx.slot}.pt")
    return 0


def _transparent_main(out: Path, layout: str, diverge: str, kill: str) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    replicas, shards = (int(v) for v in layout.split("x"))
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(128, 8, generator=generator), torch.randn(128, 4, generator=generator))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            step = epoch * len(loader) + i
            _kill_once(out, kill, rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if diverge == f"{rank}:{step}":
                with torch.no_grad():
                    _weight(model).add_(1e-7)
    final = {"model": _gathered(dict(model.state_dict())), "optim": _gathered(opt.state_dict())}
    torch.save(final, out / f"final-slot{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    _args = (Path(os.environ["CW_TEST_DIR"]), os.environ.get("CW_TEST_LAYOUT", "ddp"))
    _faults = (os.environ.get("CW_TEST_DIVERGE", ""), os.environ.get("CW_TEST_KILL", ""))
    _main = _transparent_main if os.environ.get("CW_TEST_MODE") == "transparent" else _aware_main
    sys.exit(_main(*_args, *_faults))


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

from tests.unit.local_jobs import FinishedJob, assert_bitwise_equal, load_final, local_command, run_logged  # noqa: E402

ACCUMULATION_SCRIPT = SCRIPT.with_name("test_torchpass_fsdp_accumulation.py")  # issue 40's regression script
STATEFUL_SCRIPT = SCRIPT.with_name("test_torchpass_stateful.py")  # BatchNorm under DDP: buffers compared too


def _run(
    base: Path,
    name: str,
    *,
    mode: str = "aware",
    layout: str = "ddp",
    nproc: int = 3,
    every: int | None = None,
    diverge: str = "",
    kill: str = "",
    meddle: bool = False,
    script: Path = SCRIPT,
    extra_env: dict[str, str] | None = None,
) -> FinishedJob:
    out = base / name
    out.mkdir()
    env = dict(os.environ, CW_TEST_DIR=str(out), CW_TEST_MODE=mode, CW_TEST_LAYOUT=layout, CW_TEST_DIVERGE=diverge)
    env.update(CW_TEST_KILL=kill, CW_TEST_MEDDLE="1" if meddle else "", PYTHONWARNINGS="ignore")
    env.update(extra_env or {})
    settings = [f"replica_check_every_steps={every}"] if every is not None else []
    flags = ["--transparent"] if mode == "transparent" else []
    cmd = local_command(out, script, nproc=nproc, spares=1, flags=flags, settings=settings)
    return run_logged(out, cmd, env, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchpass-replica-net")


def _assert_stopped(run: FinishedJob, *, check: str, step: int | set[int], tensor: str, slots: str = "") -> str:
    """The job failed, the coordinator recorded the mismatch (step, tensor) and failed the job with its reason."""
    assert run.returncode != 0, run.output[-4000:]
    mismatches = run.of_kind("torchpass.replica_mismatch")
    assert len(mismatches) == 1, f"{mismatches}\n{run.output[-4000:]}"
    steps = step if isinstance(step, set) else {step}
    assert mismatches[0]["step"] in steps and mismatches[0]["tensor"] == tensor, mismatches
    reason = run.of_kind("torchpass.failed")[-1]["reason"]
    assert check in reason and tensor in reason and slots in reason, reason
    assert run.logged("torchpass.replica_mismatch"), "no rank logged the mismatch"
    print(reason)
    return reason


def test_ddp_divergence_stops_the_job_at_the_next_check(base: Path) -> None:
    run = _run(base, "ddp-diverge", every=4, diverge="2:5")
    _assert_stopped(
        run,
        check="replica check after step 7: the DDP replicas disagree",
        step=7,
        tensor="model blocks.0.up.weight",
        slots="slots 0, 1 hold one state; slot 2 holds another",
    )
    assert not (run.out / "final-slot0.pt").exists(), "a rank trained on to the end"


def test_hsdp_divergence_in_an_unmodified_fsdp2_script_stops_the_job(base: Path) -> None:
    run = _run(base, "hsdp-diverge", mode="transparent", layout="2x2", nproc=4, every=1, diverge="1:3")
    _assert_stopped(
        run,
        check="replica check after step 3: the holders of shard 1 of the 2x2 mesh disagree",
        step=3,
        tensor="model blocks.0.up.weight",
    )


def test_hsdp_divergence_in_a_model_aware_script_stops_the_job(base: Path) -> None:
    run = _run(base, "hsdp-aware-diverge", layout="2x2", nproc=4, every=2, diverge="2:4")
    _assert_stopped(run, check="holders of shard 0 of the 2x2 mesh", step=5, tensor="model blocks.0.up.weight")


def test_a_rank_that_loads_a_state_differently_from_its_source_stops_the_job(base: Path) -> None:
    # Default K (no periodic check in 16 steps): the transfer to slot 1's replacement is what is checked.
    run = _run(base, "ddp-meddle", kill="1:6", meddle=True)
    reason = _assert_stopped(run, check="state transfer check", step=5, tensor="model blocks.0.up.weight")
    assert "from rank" in reason


def test_pure_fsdp_newcomer_is_checked_against_its_neighbours_copy(base: Path) -> None:
    # A 1x4 mesh has no replica: the periodic check is skipped (said once), and the newcomer's shard comes from a
    # neighbour's peer copy, whose checksums were taken when the copy was made.
    # (A copy of step 5 may still be streaming when slot 2 dies in step 6: the job then rolls back to step 4.)
    run = _run(base, "fsdp-meddle", layout="1x4", nproc=4, every=1, kill="2:6", meddle=True)
    reason = _assert_stopped(run, check="state transfer check", step={4, 5}, tensor="model blocks.0.up.weight")
    assert "pure FSDP has no replica" in run.output, run.output[-3000:]
    assert "from rank" in reason


def _reference_and_faulted(base: Path, name: str, **kw: Any) -> tuple[FinishedJob, FinishedJob]:
    kill = kw.pop("kill")
    reference = _run(base, f"{name}-reference", **kw)
    reference.check_ok()
    faulted = _run(base, f"{name}-killed", kill=kill, **kw)
    faulted.check_ok()
    assert faulted.of_kind("torchpass.recovered"), "no recovery was recorded"
    for run in (reference, faulted):
        assert not run.of_kind("torchpass.replica_mismatch") and "replicas agree" in run.output, run.output[-3000:]
    return reference, faulted


def test_no_false_alarm_with_a_check_after_every_step_ddp(base: Path) -> None:
    reference, faulted = _reference_and_faulted(base, "ddp-k1", every=1, kill="1:6")
    for slot in range(3):
        assert_bitwise_equal(load_final(faulted.out, slot), load_final(reference.out, slot), f"slot {slot}")
    assert_bitwise_equal(load_final(reference.out, 1), load_final(reference.out, 0), "replicas")


def test_no_false_alarm_with_a_check_after_every_step_hsdp_accumulation(base: Path) -> None:
    # The regression script of the accumulation defect (issue 40), unmodified, killed inside a window.
    common: dict[str, Any] = {"mode": "transparent", "nproc": 4, "every": 1, "script": ACCUMULATION_SCRIPT}
    env = {"CW_TEST_MESH": "2x2"}
    reference = _run(base, "hsdp-acc-k1-reference", extra_env=env, **common)
    reference.check_ok()
    faulted = _run(base, "hsdp-acc-k1-killed", extra_env={**env, "CW_TEST_KILL": "1:3:0:backward"}, **common)
    faulted.check_ok()
    assert (faulted.out / "killed-1-3-0-backward").exists(), "the fault was not injected"
    for run in (reference, faulted):
        assert not run.of_kind("torchpass.replica_mismatch") and "replicas agree" in run.output, run.output[-3000:]
    for slot in range(4):
        assert_bitwise_equal(load_final(faulted.out, slot), load_final(reference.out, slot), f"slot {slot}")


def test_no_false_alarm_with_batchnorm_buffers_compared_after_every_step(base: Path) -> None:
    # An unmodified DDP script with BatchNorm (its statistics are compared: every rank holds slot 0's at a commit),
    # slot 2 and then slot 0, whose buffers every forward starts from, killed.
    common: dict[str, Any] = {"mode": "transparent", "every": 1, "script": STATEFUL_SCRIPT}
    reference = _run(base, "batchnorm-k1-reference", **common)
    reference.check_ok()
    faulted = _run(base, "batchnorm-k1-killed", kill="2:7:backward,0:15:forward", **common)
    faulted.check_ok()
    assert len(list(faulted.out.glob("killed-*"))) == 2, "the faults were not injected"
    for run in (reference, faulted):
        assert not run.of_kind("torchpass.replica_mismatch") and "replicas agree" in run.output, run.output[-3000:]
    for slot in range(3):
        assert_bitwise_equal(load_final(faulted.out, slot), load_final(reference.out, slot), f"slot {slot}")
