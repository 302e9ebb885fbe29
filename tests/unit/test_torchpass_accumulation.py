"""Gradient accumulation in an unmodified DDP script (transparent mode): a failure inside a window redoes the
window, and the job ends bitwise equal per slot to the fault-free run.

This file is also the rank script (``torchpass run --local --transparent``: 2 ranks, 1 spare): the DDP example
pattern with an optimizer step every ``ACCUMULATE`` batches, the batches before it under ``ddp.no_sync()`` (their
gradients stay local and add up), the window counted with ``enumerate(loader)``. Faults (``CW_TEST_KILL``,
``slot:batch:phase``; ``batch`` counts batches across epochs from the loader's place, right on a replacement too):
SIGKILL in the forward pass or late in backward, at the first batch of a window (its gradients only local) or
at its last (during the all-reduce). The oracle: model and optimizer state of every slot equal to the
fault-free run's, and Adam stepped once per window.

``CW_TEST_SAMPLES=80`` makes a pass 10 batches, so its last window is cut short by the pass's end: its one batch
ends a step with no optimizer step, and its gradients (each rank's own, under ``no_sync``) carry over into the
next pass's first window. They are no part of the state, so a failure inside that window must stop the job with
the reason (it once ended silently different). ``CW_TEST_ZERO_AT_PASS=1`` zeroes the gradients at the start of
every pass, as many scripts do: nothing is carried then, and the job recovers bitwise.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve()
NPROC = 2
SAMPLES = 96
BATCH = 4
EPOCHS = 2
ACCUMULATE = 3
PER_EPOCH = SAMPLES // (BATCH * NPROC)  # 12 batches, 4 windows
WINDOWS = EPOCHS * PER_EPOCH // ACCUMULATE  # 8
RUN_TIMEOUT_S = 150


def _rank_main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = Path(os.environ["CW_TEST_DIR"])
    kills = {tuple(spec.split(":")) for spec in os.environ.get("CW_TEST_KILL", "").split(",") if spec}
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    (out / f"pid-slot{rank}-{os.getpid()}").write_text("")
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7)
    samples = int(os.environ.get("CW_TEST_SAMPLES") or SAMPLES)
    x = torch.randn(samples, 8, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    batch_no = 0

    def maybe_kill(phase: str) -> None:
        if (str(rank), str(batch_no), phase) not in kills:
            return
        try:
            os.close(os.open(out / f"killed-{rank}-{batch_no}-{phase}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # already done once: the replacement must not kill itself too
        os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(lambda *_: maybe_kill("forward"))
    model[0].weight.register_hook(lambda grad: maybe_kill("backward"))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        if os.environ.get("CW_TEST_ZERO_AT_PASS") == "1":
            opt.zero_grad()
        for i, (xb, yb) in enumerate(loader):
            batch_no = epoch * len(loader) + i
            last_of_window = (i + 1) % ACCUMULATE == 0
            with nullcontext() if last_of_window else ddp.no_sync():
                (nn.functional.mse_loss(ddp(xb), yb) / ACCUMULATE).backward()
            if last_of_window:
                opt.step()
                opt.zero_grad()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out / f"final-slot{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())


# ======================================================================================================
# The tests (run by pytest in the parent process)
# ======================================================================================================

# After the rank script: its processes must not need ``tests`` importable.
from tests.unit.local_jobs import FinishedJob as Run  # noqa: E402
from tests.unit.local_jobs import assert_bitwise_equal, load_final, local_command  # noqa: E402


def _run(base: Path, name: str, kill: str = "", **knobs: str) -> Run:
    out = base / name
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CW_TEST_")}
    env.update(CW_TEST_DIR=str(out), CW_TEST_KILL=kill, **knobs)
    cmd = local_command(out, SCRIPT, nproc=NPROC, spares=1, flags=["--transparent"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    return Run(out, proc.returncode, proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = _run(tmp_path_factory.mktemp("torchpass-accumulation"), "reference")
    run.check_ok()
    return run


def test_fault_free_run_steps_once_per_window(reference: Run) -> None:
    final = load_final(reference.out, 0)
    assert {int(s["step"]) for s in final["optim"]["state"].values()} == {WINDOWS}
    assert_bitwise_equal(load_final(reference.out, 1), final, "slot 1")
    assert "gradient accumulation" not in reference.output  # no warning: the windows are protected
    finished = reference.of_kind("torchpass.finished")
    assert finished and finished[-1]["committed"] == [WINDOWS - 1], finished  # a TorchPass step per window


def test_kills_inside_windows_redo_the_window_bitwise(reference: Run) -> None:
    """Two SIGKILLs at random batches of random windows (first batch: local gradients only; last: during the
    all-reduce), slot 0 among them; the seed is printed and CW_TEST_SEED replays it."""
    seed = int(os.environ.get("CW_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(seed)
    first = rng.randrange(1, WINDOWS // 2) * ACCUMULATE + rng.choice((0, ACCUMULATE - 1))
    second = rng.randrange(WINDOWS // 2 + 1, WINDOWS) * ACCUMULATE + rng.choice((0, ACCUMULATE - 1))
    slots = [0, rng.randrange(NPROC)]
    rng.shuffle(slots)
    kill = ",".join(
        f"{slot}:{batch}:{rng.choice(('forward', 'backward'))}"
        for slot, batch in zip(slots, (first, second), strict=True)
    )
    print(f"CW_TEST_SEED={seed}: kills {kill}")
    run = _run(reference.out.parent, "kills-" + kill.replace(":", "-").replace(",", "_"), kill)
    run.check_ok()
    assert len(list(run.out.glob("killed-*"))) == 2, f"seed {seed}: {kill}: the faults were not injected"
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(run.out, slot), load_final(reference.out, slot), f"seed {seed}: slot {slot}")


def test_a_failure_in_a_window_carried_over_a_pass_end_stops_the_job(reference: Run) -> None:
    """Passes of 10 batches, windows of 3: pass 0's last batch (9) commits a step with no optimizer step, and its
    gradients carry into pass 1's first window (batches 10-12). A SIGKILL there cannot be redone exactly (the dead
    rank's carried gradients are gone): the job stops and says why, where it once finished silently different."""
    base = reference.out.parent
    run = _run(base, "carried", "1:11:forward", CW_TEST_SAMPLES="80")
    assert (run.out / "killed-1-11-forward").exists(), "the fault was not injected"
    assert run.returncode != 0, "the job finished although carried gradients were lost"
    assert "committed without an optimizer step and left its gradients" in run.output, run.output[-4000:]
    assert "whole number of windows" in run.output


def test_a_failure_after_the_carried_gradients_were_zeroed_recovers_bitwise(reference: Run) -> None:
    """The same job zeroing its gradients at the start of every pass (nothing carried): the same SIGKILL is
    recovered, bitwise equal to its own fault-free run, and a fault in a window whose update used the carried
    gradients already (batch 14) is too, without them."""
    base = reference.out.parent
    clean = _run(base, "zeroed-reference", CW_TEST_SAMPLES="80", CW_TEST_ZERO_AT_PASS="1")
    clean.check_ok()
    faulted = _run(base, "zeroed", "1:11:forward,0:14:backward", CW_TEST_SAMPLES="80", CW_TEST_ZERO_AT_PASS="1")
    faulted.check_ok()
    assert len(list(faulted.out.glob("killed-*"))) == 2, "the faults were not injected"
    for slot in range(NPROC):
        assert_bitwise_equal(load_final(faulted.out, slot), load_final(clean.out, slot), f"slot {slot}")
