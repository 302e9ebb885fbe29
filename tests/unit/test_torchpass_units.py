"""TorchPass's pieces, one at a time: per-step RNG, step-indexed data, the state format, rollback, gloo abort.

The in-process tests run a one-rank job (``tp.init()`` without a launcher starts its own coordinator), which
is enough to exercise an abandoned step end to end: rollback, recovery into a new generation, redo with the
same batch and the same dropout masks. The gloo abort test uses two real processes, one of them frozen with
SIGSTOP: the situation (a silent peer) where only an abort, not a closed socket, frees the survivor.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchpass as tp
from torchpass.rank.data import StepLoader, batch_source
from torchpass.rank.rng import reseed, step_seed
from torchpass.rank.state import StateParts, TensorRef, _chunks, _fill, _overlaps, _strip, describe, payload_offsets
from torchpass.rank_env import ENV_COORDINATOR, LaunchEnv

# ----- RNG and data position --------------------------------------------------------------------


def test_step_seed_is_stable_and_distinct() -> None:
    assert step_seed(0, 1, 2) == step_seed(0, 1, 2)
    seeds = {step_seed(s, r, k) for s in range(3) for r in range(4) for k in range(50)}
    assert len(seeds) == 3 * 4 * 50
    assert all(0 <= v < 2**63 for v in seeds)
    reseed(5, 2, 9)
    a = (torch.rand(3), random.random())
    reseed(5, 2, 9)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_step_loader_shards_every_global_batch_and_reshuffles_per_epoch() -> None:
    data = TensorDataset(torch.arange(100).float())
    loader = StepLoader(data, batch_size=4, seed=1)
    world = 3
    per_epoch = loader.steps_per_epoch(world)
    assert per_epoch == 100 // 12
    for step in range(per_epoch):
        shards = [loader.indices(step, slot, world) for slot in range(world)]
        assert all(len(s) == 4 for s in shards)
        assert len(set().union(*map(set, shards))) == 12  # disjoint shares of one global batch
    epoch0 = [i for step in range(per_epoch) for slot in range(world) for i in loader.indices(step, slot, world)]
    assert len(set(epoch0)) == len(epoch0)
    assert loader.indices(per_epoch, 0, world) != loader.indices(0, 0, world)  # epoch 1 is reshuffled
    assert loader.indices(5, 2, world) == StepLoader(data, batch_size=4, seed=1).indices(5, 2, world)
    (batch,) = loader.batch(3, 1, world)
    assert batch.tolist() == [float(i) for i in loader.indices(3, 1, world)]


def test_step_loader_with_workers_resumes_at_any_step() -> None:
    data = TensorDataset(torch.arange(64).float())
    loader = StepLoader(data, batch_size=4, seed=2, num_workers=1)
    sequence = [loader.batch(step, 0, 2)[0].tolist() for step in (0, 1, 2, 5, 6, 1)]
    direct = [[float(i) for i in loader.indices(step, 0, 2)] for step in (0, 1, 2, 5, 6, 1)]
    assert sequence == direct


def test_batch_source_accepts_the_documented_shapes() -> None:
    assert batch_source(None, lambda: 0, 1)(3) is None
    assert batch_source(lambda s: s * 2, lambda: 0, 1)(3) == 6
    assert batch_source(["a", "b"], lambda: 0, 1)(1) == "b"
    with pytest.raises(TypeError, match="StepLoader"):
        batch_source(torch.utils.data.DataLoader(TensorDataset(torch.zeros(2))), lambda: 0, 1)


# ----- the state format -------------------------------------------------------------------------


def test_strip_and_fill_round_trip_nested_state() -> None:
    state = {"a": torch.ones(2), "b": [torch.zeros(1), 3, ("x", torch.arange(3))], "c": OrderedDict(k=torch.eye(2))}
    tensors: list[torch.Tensor] = []
    stripped = _strip(state, tensors)
    assert len(tensors) == 4 and stripped["a"] == TensorRef(0) and isinstance(stripped["c"], OrderedDict)
    back = _fill(stripped, tensors)
    assert torch.equal(back["b"][2][1], torch.arange(3)) and back["b"][1] == 3


def test_payload_layout_is_aligned_and_chunks_cover_it() -> None:
    layout = [("torch.float32", (3,)), ("torch.int64", ()), ("torch.bool", (5,)), ("torch.float16", (7, 2))]
    offsets, total = payload_offsets(layout)
    assert offsets == [0, 64, 128, 192] and total == 256
    sizes = [12, 8, 5, 28]
    covered: dict[int, int] = {}
    for lo, hi in _chunks(total, 50):
        for i, a, b in _overlaps(offsets, sizes, lo, hi):
            covered[i] = covered.get(i, 0) + (b - a)
    assert covered == dict(enumerate(sizes))


def test_describe_lists_model_optimizer_and_registered_state() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    meta, tensors = describe(StateParts(model, [opt], {"sched": torch.optim.lr_scheduler.StepLR(opt, 3)}), 7)
    assert meta["committed"] == 7
    assert [name for name, _, _ in meta["model"]] == list(model.state_dict())
    assert len(tensors) == len(model.state_dict()) + 4 * 3  # 4 parameters: exp_avg, exp_avg_sq, step
    assert "sched" in meta["extra"]


# ----- an abandoned step, end to end in a one-rank job -------------------------------------------


class _Tally:
    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = state["samples"]


def _one_rank_run(abandon_at: int | None) -> tuple[list[tuple[int, float]], dict[str, Any]]:
    ctx = tp.init(broken_grace_s=0.01, heartbeat_interval_s=0.2, log_level="warning")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
        ddp = ctx.wrap_model(model)
        opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        sched = ctx.register("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        tally = ctx.register("tally", _Tally())
        data = [torch.randn(5, 6, generator=torch.Generator().manual_seed(s)) for s in range(6)]
        seen: list[tuple[int, float]] = []
        for step, batch in ctx.steps(data, 6):
            loss = ddp(batch).square().mean()
            seen.append((step, loss.item()))
            loss.backward()
            if step == abandon_at and sum(1 for s, _ in seen if s == step) == 1:
                ctx.abandon_step("injected by the test")  # as the DDP hook does when a peer dies
            opt.step()
            opt.zero_grad()
            sched.step()
            tally.samples += len(batch)
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        state["tally"] = tally.samples
        state["generation"] = ctx.generation
        return seen, state
    finally:
        ctx.close()


def test_abandoned_step_is_rolled_back_and_redone_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_COORDINATOR, raising=False)
    clean, clean_state = _one_rank_run(None)
    faulted, faulted_state = _one_rank_run(3)
    assert [s for s, _ in faulted] == [0, 1, 2, 3, 3, 4, 5]  # step 3 yielded again, nothing else
    assert faulted[3] == faulted[4] == clean[3]  # same batch, same dropout mask, same state: same loss
    assert faulted_state.pop("generation") == 1 and clean_state.pop("generation") == 0
    assert faulted_state["tally"] == clean_state["tally"] == 30
    for part in ("model", "sched"):
        assert faulted_state[part].keys() == clean_state[part].keys()
    for name, tensor in clean_state["model"].items():
        assert torch.equal(tensor, faulted_state["model"][name]), name  # BatchNorm statistics included
    for index, slots in clean_state["opt"]["state"].items():
        assert torch.equal(slots["momentum_buffer"], faulted_state["opt"]["state"][index]["momentum_buffer"])
    assert clean_state["opt"]["param_groups"] == faulted_state["opt"]["param_groups"]  # the LR too
    assert clean_state["sched"] == faulted_state["sched"]


def test_launch_environment_contract() -> None:
    env = LaunchEnv("tcp://127.0.0.1:5", "w3", "slot:2", 4, "10.0.0.1", "77", True)
    assert LaunchEnv.from_environ(env.to_environ()) == env
    assert env.initial_slot == 2
    assert LaunchEnv.from_environ({}) is None


def test_a_launched_rank_prints_whole_lines_under_pythonunbuffered() -> None:
    """The launchers start ranks with PYTHONUNBUFFERED (nothing lost when one is killed). Unbuffered, a
    ``print`` is two writes (text, then newline) and the ranks sharing the launcher's stdout tear each other's
    lines; after ``whole_lines_on_shared_output`` (run by ``init`` in every launched rank) a line goes out
    whole at its newline. The raw ``os.write`` in between shows which of the two happened."""
    script = textwrap.dedent(
        """
        import os, sys
        from torchpass.rank.output import whole_lines_on_shared_output
        def line():
            print("part", end="")
            os.write(1, b"|raw|")
            print("-end")
        line()
        whole_lines_on_shared_output()
        line()
        print("on stderr", end="", file=sys.stderr)
        os.write(2, b"|raw|")
        print(file=sys.stderr)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == ["part|raw|-end", "|raw|part-end"], done.stdout
    assert done.stderr.endswith("|raw|on stderr\n"), done.stderr


# ----- aborting a gloo collective stuck on a silent peer -------------------------------------------

ABORT_WAIT_S = 180  # how long the test waits for rank 0: a quarter of the collective timeout below
_ABORT_SCRIPT = textwrap.dedent(
    """
    import datetime, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    from torchpass.rank.backends import GlooBackend
    from torchpass.config import TorchPassConfig

    rank, port, collective_timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=datetime.timedelta(seconds=20))
    backend = GlooBackend(TorchPassConfig(collective_timeout_s=collective_timeout_s))
    backend.form_group(dist.PrefixStore("g0", store), rank, 2, 0, {port})
    data = torch.ones(1000)
    dist.all_reduce(data)
    backend.abort(superseded_by=0)  # a push of the generation just formed (it raced with forming it): no abort
    dist.all_reduce(data)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent: alive, sockets open, never answers
    threading.Timer(0.5, backend.abort, args=(1,)).start()
    started = time.monotonic()
    try:
        dist.all_reduce(data)
        print("no error")
    except RuntimeError:
        print(f"aborted after {time.monotonic() - started:.2f} s")
    backend.destroy()
    """
)


def test_gloo_abort_frees_a_collective_blocked_on_a_silent_peer(tmp_path: Path) -> None:
    import socket

    script = tmp_path / "abort.py"
    script.write_text(_ABORT_SCRIPT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    peers = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(4 * ABORT_WAIT_S)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out, _ = peers[0].communicate(timeout=ABORT_WAIT_S)
    finally:
        for peer in peers:  # rank 1 is stopped; rank 0 is still running only if the abort failed
            peer.send_signal(signal.SIGKILL)
            peer.wait()
    # Within ABORT_WAIT_S, a quarter of the collective timeout: the abort freed it, not the timeout.
    assert "aborted after" in out, out


_BUCKETS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    from torch import nn
    from torchpass.rank.ddp import TorchPassDDP

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)

    class Reversed(nn.Module):  # registered c, b, a but used a -> b -> c: gradients get ready c, b, a
        def __init__(self):
            super().__init__()
            self.c, self.b, self.a = nn.Linear(8, 4), nn.Linear(8, 8), nn.Linear(4, 8)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    class Guard:
        world_size = 1
        def collective_allowed(self): return True
        def abandon_step(self, error): raise AssertionError(error)
        def when_cut_off(self, callback): return lambda: None
        def stage_buffers(self): pass
        def take_staged_buffers(self): pass
        def local_group(self): return dist.group.WORLD

    out = {}
    for kind in ("plain", "torchpass"):
        model = Reversed()
        ddp = (nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001) if kind == "plain"
               else TorchPassDDP(model, Guard(), bucket_cap_mb=0.0001))
        before = ddp._get_ddp_logging_data()["bucket_sizes"]
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
        data = ddp._get_ddp_logging_data()
        out[kind] = {"rebuilt": data["has_rebuilt_buckets"], "before": before, "after": data["bucket_sizes"],
                     "unused": ddp.find_unused_parameters}
    # Default caps: three 1 MiB layers (weights of 262,144 floats) must not share one bucket.
    big = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512))
    out["default_caps"] = TorchPassDDP(big, Guard())._get_ddp_logging_data()["bucket_sizes"]
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads must not meet the interpreter's teardown (an abort, not a test result)
    """
)


def test_ddp_wrapper_keeps_the_construction_time_buckets(tmp_path: Path) -> None:
    """Plain DDP re-buckets in gradient-ready order after its first step; TorchPass's must not (a newcomer's
    first step would not line up with the survivors'), and it needs no graph traversal for that."""
    import json

    script = tmp_path / "buckets.py"
    script.write_text(_BUCKETS_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "pg")], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["plain"]["rebuilt"] == 1, result  # the situation exists: plain DDP does re-bucket
    assert result["torchpass"]["rebuilt"] == 0, result
    assert result["torchpass"]["after"] == result["torchpass"]["before"], result
    assert result["torchpass"]["unused"] is False, result
    # Cut by size from the start (one bucket for the whole model would leave no overlap with backward).
    assert len(result["torchpass"]["before"].split(",")) > 1, result
    assert len(result["default_caps"].split(",")) > 1, result  # DDP logs the sizes as "s1, s2, ..."


_AVERAGES_SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys, torch, torch.distributed as dist
    from torch import nn
    from torchpass.rank.ddp import TorchPassDDP
    from torchpass.rank.torch_compat import FixedBuckets

    rank, world = int(sys.argv[2]), 3
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))

    class Guard:
        world_size = world
        abandoned = None
        def collective_allowed(self): return True
        def abandon_step(self, error): self.abandoned = self.abandoned or str(error)
        def when_cut_off(self, callback): return lambda: None
        def stage_buffers(self): pass
        def take_staged_buffers(self): pass
        def local_group(self): raise AssertionError("CPU gradients need no private group")

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))  # one bucket in both forms

    plain, guard = nn.parallel.DistributedDataParallel(model()), Guard()
    plain.reducer = FixedBuckets(plain.reducer)  # a rebuilt bucket orders the elements, and so the sums, anew
    wrapped = TorchPassDDP(model(), guard)
    equal = []
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(5, 16)
        for ddp in (plain, wrapped):
            ddp.zero_grad()
            ddp(x).pow(2).sum().backward()
        equal.append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.parameters())))
    dist.barrier()
    if rank == 2:
        os._exit(0)  # a peer dies between two steps
    before = [p.grad.clone() for p in wrapped.parameters()]
    wrapped.zero_grad()
    wrapped(torch.ones(5, 16)).sum().backward()  # must return, not raise
    local = [p.grad.clone() for p in wrapped.parameters()]
    print(json.dumps({"equal": equal, "abandoned": guard.abandoned,
                      "changed": any(not torch.equal(a, b) for a, b in zip(before, local))}), flush=True)
    os._exit(0)  # gloo's threads must not meet the interpreter's teardown
    """
)


def _gloo_ranks(tmp_path: Path, script_text: str, world: int) -> list[tuple[int, str]]:
    """Run ``script_text`` as ``world`` gloo ranks over a file store in ``tmp_path``: (exit status, stdout) each."""
    script = tmp_path / "ranks.py"
    script.write_text(script_text)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "pg"), str(r)], env=env, stdout=subprocess.PIPE)
        for r in range(world)
    ]
    outputs = [rank.communicate(timeout=120)[0].decode() for rank in ranks]
    return [(rank.returncode, out) for rank, out in zip(ranks, outputs, strict=True)]


def test_ddp_wrapper_averages_as_plain_ddp_and_abandons_instead_of_raising(tmp_path: Path) -> None:
    """On the CPU TorchPass's DDP averages through DDP's own path (each gradient scaled by 1/world as it is
    copied into its bucket): bitwise plain DDP's gradients at the same bucket layout, over 3 ranks, where
    scaling before and after the sum round differently. A peer that dies makes the next backward abandon
    the step, not raise."""
    import json

    ranks = _gloo_ranks(tmp_path, _AVERAGES_SCRIPT, 3)
    outputs = [out for _, out in ranks]
    for r in (0, 1):
        assert ranks[r][0] == 0, outputs[r]
        result = json.loads(outputs[r].strip().splitlines()[-1])
        assert result["equal"] == [True, True, True], result
        assert result["abandoned"], result
        assert result["changed"], result  # the backward did run: its local gradients are in place


_CUT_OFF_SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys, threading, time, torch, torch.distributed as dist
    from pathlib import Path
    from torch import nn
    from torchpass.rank.ddp import TorchPassDDP

    rank, released = int(sys.argv[2]), Path(sys.argv[1] + ".released")
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))

    class Guard:
        world_size = 2
        abandoned = None
        callbacks = []
        def collective_allowed(self): return True
        def abandon_step(self, error): self.abandoned = self.abandoned or str(error)
        def when_cut_off(self, callback):
            self.callbacks.append(callback)
            return lambda: self.callbacks.remove(callback) if callback in self.callbacks else None
        def stage_buffers(self): pass
        def take_staged_buffers(self): pass
        def local_group(self): raise AssertionError("CPU gradients need no private group")

    torch.manual_seed(0)
    guard = Guard()
    ddp = TorchPassDDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3)), guard)
    ddp(torch.ones(4, 16)).sum().backward()  # a normal step: every bucket's wait ended and was cancelled
    normal = {"abandoned": guard.abandoned, "left": len(guard.callbacks)}
    dist.barrier()
    if rank == 1:  # alive but silent from now on: rank 0's all-reduce stays pending, as behind gloo's lost send
        while not released.exists():
            time.sleep(0.05)
        os._exit(0)
    # What the control thread does once it aborted the group for a newer generation.
    fire = lambda: [callback() for callback in list(guard.callbacks)]
    threading.Timer(0.5, fire).start()
    ddp(torch.ones(4, 16)).sum().backward()  # returns once given up, long before the group's 20 s timeout
    print(json.dumps({"normal": normal, "abandoned": guard.abandoned}), flush=True)
    released.touch()
    os._exit(0)
    """
)


def test_ddp_gives_up_a_pending_gradient_all_reduce_once_its_group_is_cut_off(tmp_path: Path) -> None:
    """Seen in a soak: a survivor's backward waited out the whole collective timeout (30 s) for a gloo send that
    gloo never fails after its peer died. Once the control thread has aborted the generation's group
    (``when_cut_off``), each pending bucket's all-reduce is given up: backward returns and the step is abandoned
    with that reason, not gloo's timeout; a wait that ended by itself leaves no callback behind."""
    import json

    ranks = _gloo_ranks(tmp_path, _CUT_OFF_SCRIPT, 2)
    outputs = [out for _, out in ranks]
    assert ranks[0][0] == 0 and ranks[1][0] == 0, outputs
    result = json.loads(outputs[0].strip().splitlines()[-1])
    assert result["normal"] == {"abandoned": None, "left": 0}, result
    assert result["abandoned"] == "a gradient all-reduce given up: its group was aborted for a newer generation"


def test_example_script_trains_alone() -> None:
    """examples/train_torchpass.py runs as a one-rank job without a launcher (its own coordinator)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train_torchpass.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    done = subprocess.run(
        [sys.executable, str(example), "--steps", "6"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 0 loss" in done.stdout and "slot 0: final weights sha256 " in done.stdout
