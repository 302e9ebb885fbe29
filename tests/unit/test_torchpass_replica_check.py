"""The runtime net's pieces that need no job (torchpass/rank/replica_check.py): the checksum, what is compared and how
it is named, the verdict on gathered tables, and the transfer check on a real state round trip.

The checksum is held to a plain reference (NumPy's wrapping 64-bit arithmetic over the same words) for sizes on
every path (small tensors summed together, large ones as a matrix, blocks, a padded last word), and to the cases
a checksum must tell apart: one flipped bit anywhere, two swapped elements, -0.0 against 0.0, NaN payloads, the
same bytes under another dtype or shape. The jobs that stop on a mismatch are test_torchpass_replica_net.py's.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpass.rank.replica_check as rc
from torchpass.rank.replica_check import (
    ReplicaMismatch,
    ReplicaNet,
    byte_checksums,
    checksums,
    digest,
    payload_checksums,
    state_table,
)
from torchpass.rank.state import (
    StateError,
    StateParts,
    apply_state,
    as_bytes,
    describe,
    destinations_for,
    payload_offsets,
)
from torchpass.rank.transfer_plan import ShardedReplicas

LOG = logging.LoggerAdapter(logging.getLogger("test.replica_check"), {})
MASK = (1 << 64) - 1
MIX = 0x9E3779B97F4A7C15


def _signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >= 1 << 63 else v


def reference(tensor: torch.Tensor) -> tuple[int, int]:
    """The checksum pair by the module docstring's definition, in NumPy (wrapping uint64 arithmetic)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 8)
    words = np.frombuffer(raw, dtype="<u8")
    index = np.arange(words.size, dtype=np.uint64)
    high = (words.view(np.int64) >> 32).view(np.uint64)  # arithmetic shift, as torch's >> on int64
    with np.errstate(over="ignore"):
        s = int(words.sum(dtype=np.uint64))
        w = int((words * index).sum(dtype=np.uint64))
        h = int((high * index).sum(dtype=np.uint64))
    layout = zlib.crc32(f"{tensor.dtype}:{','.join(str(d) for d in tensor.shape)}".encode())
    return _signed(s + layout * MIX), _signed(w + h * MIX)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 8 rows and a small-tensor limit of 2 rows, so that a few KiB cross every path's boundary."""
    monkeypatch.setattr(rc, "_BLOCK_ROWS", 8)
    monkeypatch.setattr(rc, "_BLOCK", rc._LANES * 8)
    monkeypatch.setattr(rc, "_SMALL", rc._LANES * 2)


@pytest.mark.parametrize("blocks", [False, True])
def test_checksums_match_the_reference_on_every_path(request: pytest.FixtureRequest, blocks: bool) -> None:
    if blocks:
        request.getfixturevalue("small_blocks")
    generator = torch.Generator().manual_seed(5)
    lanes = rc._LANES
    sizes = [0, 1, 3, 7, 8, 9, lanes - 1, lanes, 2 * lanes + 5, 8 * lanes, 8 * lanes + 3, 17 * lanes + 1]
    sizes += [64 * lanes, 64 * lanes + 7]
    tensors: list[torch.Tensor] = []
    for n in sizes:  # int64 words from all kinds of values, and other dtypes' byte counts
        tensors.append(torch.randint(-(1 << 62), 1 << 62, (n,), generator=generator, dtype=torch.int64))
        tensors.append(torch.randn(n, generator=generator).to(torch.bfloat16))
    tensors += [torch.randn(3, 5, generator=generator), torch.tensor(2.5), torch.zeros(0, 4)]
    assert checksums(tensors) == [reference(t) for t in tensors]


def test_equal_bytes_give_equal_sums_on_any_layout_in_memory() -> None:
    t = torch.randn(5000)
    a = checksums([t])[0]
    assert checksums([t.clone()]) == [a]
    unaligned = torch.empty(4 * 5000 + 4, dtype=torch.uint8)[4:]  # a byte string 4 bytes off an 8-byte boundary
    unaligned.copy_(as_bytes(t))
    assert byte_checksums([(unaligned, str(t.dtype), tuple(t.shape))]) == [a]
    transposed = torch.randn(40, 70)
    assert checksums([transposed.t()]) == checksums([transposed.t().contiguous()])
    alone, together = checksums([t]), checksums([torch.ones(3), t, torch.ones(7)])[1]  # batched with others
    assert alone == [together]


@pytest.mark.parametrize("n", [1, 2, 1000, 70_000])
def test_one_flipped_bit_anywhere_changes_the_sum(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=generator)
    expected = checksums([base])[0]
    positions = {0, n - 1, n // 2} | set(torch.randint(0, n, (6,), generator=generator).tolist())
    for element, bit in itertools.product(sorted(positions), (0, 1, 22, 23, 30, 31)):
        flipped = base.clone()
        flipped.view(torch.int32)[element] ^= 1 << bit if bit < 31 else -(1 << 31)
        assert checksums([flipped])[0] != expected, (element, bit)


def test_swapped_elements_are_caught_even_where_only_the_high_bits_differ() -> None:
    base = torch.randn(4096, dtype=torch.float64)
    expected = checksums([base])[0]
    for i, j in [(0, 1), (0, 2), (7, 1031), (100, 100 + 2048), (5, 4095)]:
        swapped = base.clone()
        swapped[i], swapped[j] = base[j], base[i]
        assert checksums([swapped])[0] != expected, (i, j)
        assert checksums([swapped])[0][0] == expected[0]  # the plain sum cannot see it: the weighted one does
    # Two 8-byte words that differ only in their top bit, an even distance apart: their difference (2**63) times
    # any even difference of weights vanishes modulo 2**64, so only the high halves' sum H catches this swap.
    words = torch.zeros(64, dtype=torch.int64)
    words[10] = 1 << 40
    words[12] = (1 << 40) - (1 << 63)
    swapped = words.clone()
    swapped[10], swapped[12] = words[12], words[10]
    assert checksums([swapped])[0] != checksums([words])[0]


def test_zero_signs_nan_payloads_dtypes_and_shapes_differ() -> None:
    assert checksums([torch.tensor([0.0])]) != checksums([torch.tensor([-0.0])])
    nan = torch.tensor([float("nan")])
    other = nan.clone()
    other.view(torch.int32)[0] |= 1  # another NaN payload: == can never tell, the bytes do
    assert checksums([nan]) != checksums([other])
    for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.uint8):
        t = torch.arange(13).to(dtype)
        changed = t.clone()
        changed[5] += 1
        assert checksums([t]) == checksums([t.clone()]) != checksums([changed]), dtype
    flags = torch.tensor([True, False, True])
    assert checksums([flags]) != checksums([torch.tensor([True, True, True])])
    as_float = torch.ones(4)
    assert checksums([as_float]) != checksums([as_float.view(torch.int32)])  # same bytes, another dtype
    assert checksums([as_float]) != checksums([as_float.view(2, 2)])  # same bytes, another shape
    assert checksums([torch.zeros(3)]) != checksums([torch.zeros(4)])  # trailing zero words count too


def test_the_digest_sees_a_changed_tensor_and_tensors_that_trade_places() -> None:
    pairs = checksums([torch.randn(10), torch.randn(20), torch.randn(30)])
    assert digest(pairs) == digest(list(pairs))
    assert digest(pairs) != digest([pairs[0], pairs[2], pairs[1]])
    assert digest(pairs) != digest([pairs[0], (pairs[1][0] + 1, pairs[1][1]), pairs[2]])


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_dtensor_counts_as_its_local_shard(world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(8, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert checksums([sharded]) == checksums([sharded.to_local()]) == checksums([full])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW([{"params": [model.embed.weight]}, {"params": list(model.norm.parameters())}], lr=0.1)
    out = model.head(model.norm(model.embed(torch.tensor([1, 2, 3]))))
    out.sum().backward()
    opt.step()
    return model, opt


def test_state_table_names_parameters_buffers_and_optimizer_state() -> None:
    model, opt = _trained()
    names, tensors = state_table(
        StateParts(model, [opt], {"extra": torch.optim.lr_scheduler.StepLR(opt, 2)}), buffers=True
    )
    assert names[:2] == ["model embed.weight", "model norm.weight"]
    assert "model norm.running_mean" in names and "model head.weight" in names  # tied: both names, as sent
    assert "optimizer 0 state of embed.weight: exp_avg" in names
    assert "optimizer 0 state of norm.bias: exp_avg_sq" in names
    assert "optimizer 0 state of norm.weight: step" in names
    meta, sent = describe(StateParts(model, [opt]), 3)
    assert len(tensors) == meta["core"] == len(sent)  # the same tensors a transfer sends first, in its order
    without, _ = state_table(StateParts(model, [opt]), buffers=False)
    assert not any("running" in n or "num_batches" in n for n in without)
    assert set(without) < set(names)


def test_a_payload_checksums_as_its_live_tensors() -> None:
    model, opt = _trained()
    parts = StateParts(model, [opt], {"sched": torch.optim.lr_scheduler.StepLR(opt, 2)})
    meta, tensors = describe(parts, 1)
    offsets, total = payload_offsets(meta["layout"])
    payload = torch.zeros(total, dtype=torch.uint8)
    for offset, tensor in zip(offsets, tensors, strict=True):
        flat = as_bytes(tensor.contiguous())
        payload[offset : offset + flat.numel()] = flat
    assert payload_checksums(payload, meta) == checksums(tensors[: meta["core"]])


def _mirror(parts: StateParts, meta: dict[str, Any], tensors: list[torch.Tensor]) -> StateParts:
    """A receiver's parts loaded with a state as :func:`torchpass.rank.state.recv_state` loads it (no process group)."""
    model, opt = _trained()
    with torch.no_grad():
        model.embed.weight.mul_(0.5)  # something else before the state lands
    target = StateParts(model, [opt])
    layout = [(d, tuple(s)) for d, s in meta["layout"]]
    destinations = destinations_for(target, meta, layout, torch.device("cpu"))
    with torch.no_grad():
        for dest, src in zip(destinations, tensors, strict=True):
            dest.copy_(src)
    apply_state(target, meta, destinations)
    return target


def test_a_received_state_is_checked_against_the_senders_checksums() -> None:
    model, opt = _trained()
    sender = StateParts(model, [opt])
    net = ReplicaNet(1, sender, LOG, None)
    meta, tensors = describe(sender, 4)
    meta.update(net.annex(meta, tensors))
    receiver = _mirror(sender, meta, tensors)
    net.verify(receiver, meta, "rank 0")  # equal: nothing happens
    with torch.no_grad():
        receiver.optimizers[0].state[receiver.model.norm.bias]["exp_avg"][1] += 1e-7  # type: ignore[union-attr]
    events: list[tuple[str, dict[str, Any]]] = []
    net.event_sink = lambda kind, fields: events.append((kind, fields))
    with pytest.raises(ReplicaMismatch, match=r"optimizer 0 state of norm\.bias: exp_avg") as caught:
        net.verify(receiver, meta, "rank 0")
    assert isinstance(caught.value, StateError)  # what the rejoiner turns into a fatal stop
    assert caught.value.fields == {"kind": "replica_mismatch", "step": 4, "tensor": caught.value.tensor}
    assert events and events[0][0] == "torchpass.replica_mismatch" and events[0][1]["check"] == "transfer"
    net.verify(receiver, {k: v for k, v in meta.items() if k != "checksums"}, "rank 0")  # none sent: not checked


def test_the_annex_is_computed_once_per_state() -> None:
    model, opt = _trained()
    net = ReplicaNet(1, StateParts(model, [opt]), LOG, None)
    meta, tensors = describe(StateParts(model, [opt]), 2)
    first = net.annex(meta, tensors)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    assert net.annex(meta, tensors) is first  # a second receiver of the same state
    net.forget()  # a new generation
    assert net.annex(meta, tensors) != first


def _verdict_of(
    net: ReplicaNet, monkeypatch: pytest.MonkeyPatch, tables: list[list[tuple[int, int]]]
) -> tuple[str, str]:
    """What the net concludes when the generation's members hold ``tables`` (this rank: slot 0's)."""
    calls = iter([[(len(t), *digest(t)) for t in tables], [(len(t), *(v for p in t for v in p)) for t in tables]])
    monkeypatch.setattr(rc, "_gather", lambda values, device: next(calls))
    monkeypatch.setattr(rc, "checksums", lambda tensors: tables[0])
    return net._compare(11, net.columns(len(tables)), torch.device("cpu"))


def test_the_verdict_names_the_slots_and_the_first_differing_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    net = ReplicaNet(1, StateParts(model, [opt]), LOG, None)
    names, _ = state_table(net.parts, buffers=False)
    same = [(i, 10 * i) for i in range(len(names))]
    odd = list(same)
    odd[3] = (99, 99)
    assert _verdict_of(net, monkeypatch, [same, same, same]) == ("", "")
    message, tensor = _verdict_of(net, monkeypatch, [same, odd, same])
    assert (
        tensor == names[3]
        and "after step 11" in message
        and "slots 0, 2 hold one state; slot 1 holds another" in message
    )
    # HSDP 2x2: only the holders of the same shard compare; shard 1 (slots 1 and 3) differs
    net.shape = ShardedReplicas(2, 2)
    other = [(i, 7) for i in range(len(names))]
    message, tensor = _verdict_of(net, monkeypatch, [same, other, same, odd])
    assert "the holders of shard 1 of the 2x2 mesh disagree" in message and tensor == names[0]
    assert "shard 0" not in message
    assert _verdict_of(net, monkeypatch, [same, other, same, other]) == ("", "")
    net.shape = ShardedReplicas(1, 4)
    assert net.columns(4) == []  # pure FSDP: nothing to compare


def test_a_state_that_cannot_be_checksummed_turns_the_check_off_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, opt = _trained()
    net = ReplicaNet(1, StateParts(model, [opt]), LOG, None)
    sent: list[list[int]] = []

    def gather(values: list[int], device: torch.device) -> list[tuple[int, ...]]:
        sent.append(values)
        return [tuple(values), (5, 1, 2)]  # this rank failed; its peer did not, and learns it from the gather

    def broken(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        raise RuntimeError("no bytes for a sparse tensor")

    monkeypatch.setattr(rc, "_gather", gather)
    monkeypatch.setattr(rc, "checksums", broken)
    assert net._compare(3, net.columns(2), torch.device("cpu")) == ("", "")
    assert sent == [[-1, 0, 0]] and not net.on  # every rank joined the gather, then turned the check off


def test_off_means_never_due_and_k_counts_like_snapshots() -> None:
    net = ReplicaNet(0, StateParts(), LOG, None)
    assert not net.on and not any(net.due(s) for s in range(10))
    net.every = 4
    assert [s for s in range(12) if net.due(s)] == [3, 7, 11]
