"""The pieces of TorchPass's sharded training that need no job: the mesh's proxy groups and their guard, the
plan of what gets ``fully_shard``, and the step-lifecycle rules the proxies follow. One process, a one-rank gloo
group at most; the multi-rank behaviour is the oracle's (test_torchpass_fsdp.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.sharded.fsdp import LifecycleGuard, ShardPlan, sharded_modules
from torchpass.sharded.shard_mesh import MeshGroups


class _Guard:
    """A scripted guard: inside a step or not, collectives admitted or not; what failed is recorded."""

    def __init__(self, protecting: bool = True, admit: bool = True) -> None:
        self.in_step, self.admitted, self.failures = protecting, admit, []  # type: ignore[var-annotated]

    def protecting(self) -> bool:
        return self.in_step

    def admit(self) -> bool:
        return self.admitted

    def failed(self, error: BaseException | str) -> None:
        self.failures.append(str(error))

    def cut_off(self) -> bool:
        return False


class _Broken(dist.ProcessGroup):
    """A one-rank group whose collectives fail: at launch, when they complete, or (a work without a future, as
    gloo's reduce-scatter gives) when waited for."""

    def __init__(self, how: str) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]
        self.how = how

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if self.how == "launch":
            raise RuntimeError("Connection closed by peer")
        return _FailedWork(self.how == "future")


class _FailedWork(dist.Work):
    """A collective that was launched and then failed (a peer died mid-way), as gloo's work reports it."""

    def __init__(self, has_future: bool) -> None:
        super().__init__()
        self.has_future = has_future

    def get_future(self) -> torch.futures.Future[Any]:
        if not self.has_future:
            raise RuntimeError("Work::getFuture not implemented.")
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_exception(RuntimeError("peer died mid-collective"))
        return future

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("peer died mid-collective")

    def is_completed(self) -> bool:
        return True  # a failed work is done (c10d's finish with an error)


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_mesh_exists_before_any_process_group_and_names_its_dimensions() -> None:
    hsdp = MeshGroups(ShardedReplicas(2, 3), 4, "cpu")  # slot 4 = replica 1, shard 1
    assert hsdp.mesh.mesh_dim_names == ("replicate", "shard") and tuple(hsdp.mesh.shape) == (2, 3)
    assert hsdp.mesh.get_coordinate() == (1, 1)
    assert (hsdp.proxies["replicate"].rank(), hsdp.proxies["shard"].rank()) == (1, 1)
    fsdp = MeshGroups(ShardedReplicas(1, 4), 2, "cpu", flat=True)
    assert fsdp.mesh.mesh_dim_names == ("shard",) and fsdp.mesh.get_coordinate() == (2,)
    with pytest.raises(RuntimeError, match="does not exist yet"):
        fsdp.current("shard")
    with pytest.raises(ValueError, match="outside"):
        MeshGroups(ShardedReplicas(1, 2), 2, "cpu")


def test_proxies_forward_to_the_generation_bound_last(world: None) -> None:
    groups = MeshGroups(ShardedReplicas(1, 1), 0, "cpu", flat=True)
    groups.bind(0)
    first = groups.current("shard")
    t = torch.ones(3)
    dist.all_reduce(t, group=groups.mesh.get_group("shard"))  # outside a step: plain
    assert torch.equal(t, torch.ones(3))
    dist.destroy_process_group()
    groups.unbind()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups.bind(1)
    assert groups.current("shard") is not first and groups.generation == 1
    # DTensor's functional collectives find the proxy by name after the rebuild (destroy cleared c10d's registry)
    out = torch.distributed._functional_collectives.all_reduce(torch.full((2,), 3.0), "sum", (groups.mesh, 0))
    assert torch.equal(out, torch.full((2,), 3.0))


def test_a_refused_or_failed_collective_in_a_step_never_raises(world: None) -> None:
    guard = _Guard(admit=False)
    groups = MeshGroups(ShardedReplicas(1, 1), 0, "cpu", flat=True)
    groups.guard = guard
    groups.bind(0)
    proxy = groups.mesh.get_group("shard")
    out = torch.full((4,), 7.0)
    dist.all_gather_into_tensor(out, torch.ones(4), group=proxy)  # refused: not run, output zeroed
    assert torch.equal(out, torch.zeros(4)) and not guard.failures
    guard.admitted = True
    for how in ("launch", "future", "wait"):
        groups.bind(0, lambda ranks, h=how: _Broken(h))  # type: ignore[misc]
        t = torch.ones(2)
        dist.all_reduce(t, group=proxy)  # the failure is the guard's, not the caller's
        assert torch.equal(t, torch.ones(2))
    assert len(guard.failures) == 3 and "Connection closed" in guard.failures[0], guard.failures
    assert "mid-collective" in guard.failures[1] and "mid-collective" in guard.failures[2], guard.failures
    guard.in_step = False  # outside a step a failure is the caller's, as in torch (c10d's logging wrapper, which
    with pytest.raises((RuntimeError, ValueError)):  # looks the group up in its own books, may re-raise it)
        dist.all_reduce(torch.ones(2), group=proxy)
    assert len(guard.failures) == 3


class _Lifecycle:
    """The StepLifecycle attributes the guard reads (torchpass.rank.step)."""

    def __init__(self) -> None:
        self.step, self.updated, self.failed_after_update, self.abandoned, self.newer = 3, False, "", "", False

    def stale(self) -> bool:
        return self.newer

    def collective_allowed(self) -> bool:
        return not self.abandoned and not self.newer

    def abandon(self, error: Any) -> None:
        self.abandoned = str(error)

    def fail_after_update(self, reason: str) -> None:
        self.failed_after_update = self.failed_after_update or reason


def test_the_guard_abandons_before_the_update_and_defers_after_it() -> None:
    lifecycle = _Lifecycle()
    guard = LifecycleGuard(lifecycle)  # type: ignore[arg-type]
    assert guard.protecting() and guard.admit()
    guard.failed(RuntimeError("peer gone"))
    assert lifecycle.abandoned == "peer gone" and not guard.admit()
    lifecycle = _Lifecycle()
    lifecycle.updated = True  # the optimizer stepped: the step can no longer be abandoned
    guard = LifecycleGuard(lifecycle)  # type: ignore[arg-type]
    guard.failed("RuntimeError: late")
    assert not lifecycle.abandoned and lifecycle.failed_after_update == "RuntimeError: late" and not guard.admit()
    lifecycle = _Lifecycle()
    lifecycle.updated, lifecycle.newer = True, True
    assert not LifecycleGuard(lifecycle).admit() and lifecycle.failed_after_update  # type: ignore[arg-type]
    lifecycle.step = -1
    assert not LifecycleGuard(lifecycle).protecting()  # type: ignore[arg-type]


class _Channel:
    """What a StepLifecycle reads from the control channel (torchpass.rank.step.StepChannel)."""

    latest_gen, urgent_gen, cut_off_gen, step, collective = 0, 0, 0, -1, None


def test_a_failed_commit_check_abandons_the_step_once_with_its_reason() -> None:
    """peer_copy_sync's vote is a commit check: it sees a failure after the update, and when it fails the step is
    abandoned (redone) instead of committed; the checks run once per step."""
    import logging

    from torchpass.rank.state import StateParts
    from torchpass.rank.step import StepLifecycle

    lifecycle = StepLifecycle(_Channel(), StateParts(), lambda: 0, logging.LoggerAdapter(logging.getLogger()), None)
    seen: list[tuple[int, str]] = []
    verdicts = iter(["", "a peer copy of step 5 was not acknowledged by the neighbours"])
    lifecycle.commit_checks.append(lambda step, failed: seen.append((step, failed)) or next(verdicts))
    lifecycle.begin(4, seed=0, slot=0, python=False, numpy=False)
    lifecycle.check_commit()
    lifecycle.check_commit()
    assert seen == [(4, "")] and not lifecycle.abandoned
    lifecycle.begin(5, seed=0, slot=0, python=False, numpy=False)
    lifecycle.fail_after_update("RuntimeError: late")
    lifecycle.check_commit()
    assert seen[-1] == (5, "RuntimeError: late") and lifecycle.abandoned
    assert lifecycle.reason == "a peer copy of step 5 was not acknowledged by the neighbours"
    assert not lifecycle.failed_after_update  # abandoned, not committed: nothing is left to recover after a commit
    lifecycle.check_commit()
    assert len(seen) == 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


def test_what_is_sharded_deepest_first() -> None:
    model = nn.Sequential(_Block(), _Block(), nn.Linear(4, 2))
    names = [name for name, _ in sharded_modules(model, _Block)]
    assert names == ["1", "0"]
    linear = [name for name, _ in sharded_modules(model, nn.Linear)]
    assert linear.index("0.mlp.0") < linear.index("2") and set(linear) == {
        "0.attn", "0.mlp.0", "0.mlp.1", "1.attn", "1.mlp.0", "1.mlp.1", "2",
    }  # fmt: skip
    assert [n for n, _ in sharded_modules(model, lambda name, m: name.endswith("mlp"))] == ["1.mlp", "0.mlp"]
    assert [n for n, _ in sharded_modules(model, [model[0].mlp, model[0]])] == ["0.mlp", "0"]
    assert sharded_modules(model, None) == []
    with pytest.raises(ValueError, match="not submodules"):
        sharded_modules(model, [nn.Linear(1, 1)])
    with pytest.raises(TypeError, match="mesh_shape"):
        ShardPlan(ShardedReplicas(1, 2), None, {"mesh": object()})


def test_nccl_mesh_subgroups_are_non_blocking_and_members_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NCCL path's seam (no GPU here): the mesh's subgroups are created with non-blocking communicators, so the
    abort of every group when a newer generation is announced reaches them, and a rank outside one gets None."""
    from types import SimpleNamespace

    from torchpass.config import TorchPassConfig
    from torchpass.rank.backends import NcclBackend

    class Options:
        def __init__(self) -> None:
            self.config = SimpleNamespace(blocking=1)
            self._timeout = None

    made: list[dict[str, Any]] = []
    member = dist.ProcessGroup(0, 1)  # type: ignore[call-arg]

    def new_group(ranks: list[int], **kwargs: Any) -> Any:
        made.append({"ranks": ranks, **kwargs})
        return member if 0 in ranks else dist.GroupMember.NON_GROUP_MEMBER

    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(dist, "new_group", new_group)
    backend = NcclBackend(TorchPassConfig(collective_timeout_s=7), local_rank=0)
    assert backend.new_subgroup([0, 1]) is member and backend.new_subgroup([2, 3]) is None
    options = made[0]["pg_options"]
    assert options.config.blocking == 0 and options._timeout.total_seconds() == 7
    assert made[0]["timeout"].total_seconds() == 7


def test_cut_off_callbacks_run_once_for_the_waits_of_superseded_generations() -> None:
    """``when_cut_off`` (DDP's pending bucket all-reduces): the control thread's ``cut_off_waits(N)`` runs the
    callbacks registered under generations older than N, once; a cancelled one never runs; one registered under
    a generation already cut off runs at once."""
    import logging

    from torchpass.rank.state import StateParts
    from torchpass.rank.step import StepLifecycle

    generation = [3]
    lifecycle = StepLifecycle(
        _Channel(), StateParts(), lambda: generation[0], logging.LoggerAdapter(logging.getLogger()), None
    )
    ran: list[str] = []
    lifecycle.when_cut_off(lambda: ran.append("pending"))
    cancel = lifecycle.when_cut_off(lambda: ran.append("ended by itself"))
    cancel()
    lifecycle.cut_off_waits(3)  # generation 3 is the current one: nothing of it is cut off
    assert ran == []
    lifecycle.cut_off_waits(4)
    lifecycle.cut_off_waits(5)
    assert ran == ["pending"]
    lifecycle.when_cut_off(lambda: ran.append("late"))  # still in generation 3, which is gone
    assert ran == ["pending", "late"]
    generation[0] = 5
    lifecycle.when_cut_off(lambda: ran.append("generation 5"))
    lifecycle.cut_off_waits(5)
    assert ran == ["pending", "late"]
    lifecycle.cut_off_waits(6)
    assert ran == ["pending", "late", "generation 5"]
