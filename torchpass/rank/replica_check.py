"""The runtime net for silent divergence: replicas compare checksums of their state, and every transfer is checked.

Why: TorchPass promises a final state bitwise equal to the fault-free run, or a stop with the reason. The oracle
tests and the exactness fuzzer hold it to that on the scripts they know; a script nobody tried (a callback that
edits one rank's weights, an accumulation path a rollback misses, a torch release that keeps gradients somewhere
new) could still end a run silently different. Two invariants make such a difference visible while the job runs:

* **Replicas of the same state are bitwise equal at every committed step.** Every DDP rank (buffers too: at a
  commit every rank holds slot 0's, :mod:`torchpass.rank.buffers`), and under HSDP every rank holding the same shard
  (parameters and optimizer state; FSDP2 keeps buffers per rank, so they are left out). A recovery copies any
  replica, so replicas that differ make the next recovery inexact even without a fault, and one of them is
  already wrong. After every K-th committed step (``replica_check_every_steps``; step + 1 divisible by K, as
  snapshots count) each rank checksums its state and one ``all_gather`` of three integers per rank over the
  generation's group compares them; only on a mismatch does a second ``all_gather`` of the per-tensor checksums
  name the first differing tensor. The whole group, not HSDP's replicate groups: every rank gets the same
  tables, so every rank, of every shard, stops at the same step with the same reason (the job fails:
  :meth:`torchpass.rank.rejoin.CoordinatorLink.fatal`) instead of some ranks training on into a job being stopped.
* **A transfer copies bytes, so the receiver, once loaded, equals its source.** The sender puts its per-tensor
  checksums into the state's metadata (computed from the tensors it sends; a peer copy's from its payload when
  the copy was made, :mod:`torchpass.sharded.peer_copy`), and the receiver compares them with its own after loading.
  A mismatch stops the job the same way.

The checksum is bitwise and independent of the order of any reduction: a tensor's bytes, read as 64-bit words
(the last 1..7 bytes zero-padded into one more), give the wrapping sums S = sum(w_i), W = sum(i * w_i) and
H = sum(i * (w_i >> 32)) modulo 2**64. Integer addition modulo 2**64 is associative and commutative, so a GPU's
reduction order, a chunked sum and a CPU's all give the same numbers, and only equal bytes give equal sums: S
changes with any changed word (one flipped bit, -0.0 against 0.0, another NaN payload), W and H with swapped
words (H covers a swap of words that differ only in their high bits, whose difference W's weights can cancel:
a swap escapes both only in a tensor of more than 2**33 words).
A tensor's pair is (S + layout * M, W + H * M) modulo 2**64, ``layout`` a CRC of its dtype and shape and M an
odd constant. Large tensors are viewed as a matrix of 1024 columns, whose row and column sums give W without a
position vector, in blocks that bound the one temporary (the high halves) to 32 MiB; small ones are summed
together with ``index_add_``. Everything runs on the tensor's device, and one transfer per device brings the
pairs to the host.

The periodic check runs inside the commit, after the step's update: a failure of its collective follows the
rule of every collective after an update (the step commits, the rank recovers right after). Not compared:
registered objects (LR schedulers, user state, which may differ per rank by design), buffers under FSDP2, and
pure FSDP's shards, which have no replica (said once in the log; their transfers are still checked).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import nn

from torchpass.events import EventSink, emit
from torchpass.rank.state import StateError, StateParts, TensorRef, as_bytes, describe, local_tensor, payload_offsets
from torchpass.rank.step import StepLifecycle
from torchpass.rank.transfer_plan import ShardedReplicas

__all__ = [
    "EVENT",
    "ReplicaMismatch",
    "ReplicaNet",
    "byte_checksums",
    "checksums",
    "digest",
    "payload_checksums",
    "state_table",
]

EVENT = "torchpass.replica_mismatch"
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: folds the layout and the high halves' sum into the pair
_LANES = 1024  # columns of the matrix a large tensor is viewed as
_BLOCK_ROWS = 4096  # rows per block: 4 Mi words, 32 MiB, which bounds the temporary of the high halves
_BLOCK = _LANES * _BLOCK_ROWS
_SMALL = 64 * _LANES  # tensors of fewer words are summed together, in batches of at most one block
_LogAdapter = logging.LoggerAdapter  # type: ignore[type-arg]

Pair = tuple[int, int]


# ----- the checksum ------------------------------------------------------------------------------


def _signed(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _words(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A byte string as int64 words: its whole words (a view when aligned) and its last 1..7 bytes zero-padded into
    one more word (None when there are none). A function of the bytes alone, never of their alignment or dtype,
    so that a payload slice and the live tensor it was copied from give the same sums."""
    whole = flat.numel() // 8 * 8
    try:
        words = flat[:whole].view(torch.int64)
    except RuntimeError:  # not 8-byte aligned in its storage: an aligned copy
        words = flat[:whole].clone().view(torch.int64)
    if whole == flat.numel():
        return words, None
    pad = torch.zeros(8, dtype=torch.uint8, device=flat.device)
    pad[: flat.numel() - whole] = flat[whole:]
    return words, pad.view(torch.int64)


_aranges: dict[torch.device, torch.Tensor] = {}


def _arange(device: torch.device, n: int) -> torch.Tensor:
    """0 .. n-1 as int64 on ``device`` (n <= the block's rows), kept per device."""
    cached = _aranges.get(device)
    if cached is None:
        cached = _aranges[device] = torch.arange(max(_BLOCK_ROWS, _LANES), dtype=torch.int64, device=device)
    return cached[:n]


def _large(words: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """(S, W, H) of one large tensor's words: per block of the (rows x 1024) matrix, the row sums r and the column
    sums c give sum(i * w_i) = offset * S + 1024 * sum(j * r_j) + sum(k * c_k)."""
    device = words.device
    lanes = _arange(device, _LANES)
    full = words.numel() // _LANES * _LANES
    sums = torch.zeros(3, dtype=torch.int64, device=device)
    for start in range(0, full, _BLOCK):
        block = words[start : min(full, start + _BLOCK)].view(-1, _LANES)
        rows = _arange(device, block.shape[0])
        for k, matrix in ((1, block), (2, block >> 32)):
            r, c = matrix.sum(1), matrix.sum(0)
            total = r.sum()
            if k == 1:
                sums[0] += total
            sums[k] += total * start + (r * rows).sum() * _LANES + (c * lanes).sum()
    tail = words[full:] if extra is None else torch.cat([words[full:], extra])
    if tail.numel():
        position = lanes[: tail.numel()] + full
        sums[0] += tail.sum()
        sums[1] += (tail * position).sum()
        sums[2] += ((tail >> 32) * position).sum()
    return sums


def _small(batch: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """(S, W, H) of each of several small tensors' words, as a (len(batch), 3) tensor: one concatenation, each
    word's position within its own tensor, and three ``index_add_`` by tensor."""
    device = batch[0][0].device
    pieces = [w for words, extra in batch for w in ((words,) if extra is None else (words, extra))]
    counts = [words.numel() + (extra is not None) for words, extra in batch]
    flat = torch.cat(pieces)
    owner = torch.repeat_interleave(  # output_size: no device sync to learn it
        torch.arange(len(batch), device=device),
        torch.tensor(counts, dtype=torch.int64, device=device),
        output_size=flat.numel(),
    )
    starts = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.int64, device=device)
    position = torch.arange(flat.numel(), dtype=torch.int64, device=device) - starts[owner]
    out = [torch.zeros(len(batch), dtype=torch.int64, device=device) for _ in range(3)]
    out[0].index_add_(0, owner, flat)
    out[1].index_add_(0, owner, flat * position)
    out[2].index_add_(0, owner, (flat >> 32) * position)
    return torch.stack(out, dim=1)


def _batches(items: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> Iterator[list[Any]]:
    """``items`` cut into batches of at most one block of words."""
    batch: list[Any] = []
    words = 0
    for item in items:
        size = item[1].numel() + 1
        if batch and words + size > _BLOCK:
            yield batch
            batch, words = [], 0
        batch.append(item)
        words += size
    if batch:
        yield batch


def byte_checksums(items: Sequence[tuple[torch.Tensor, str, tuple[int, ...]]]) -> list[Pair]:
    """The checksum pair of each byte string (a flat uint8 tensor on any device) with the dtype and shape whose
    bytes it holds (see the module docstring); one transfer to the host per device."""
    raw: list[torch.Tensor | None] = [None] * len(items)
    small: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = defaultdict(list)
    for i, (flat, _, _) in enumerate(items):
        words, extra = _words(flat)
        if words.numel() >= _SMALL:
            raw[i] = _large(words, extra)
        else:
            small[flat.device].append((i, words, extra))
    for group in small.values():
        for batch in _batches(group):
            table = _small([(words, extra) for _, words, extra in batch])
            for row, (i, _, _) in enumerate(batch):
                raw[i] = table[row]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, sums in enumerate(raw):
        assert sums is not None
        by_device[sums.device].append((i, sums))
    values: list[list[int]] = [[] for _ in items]
    for found in by_device.values():
        for (i, _), row in zip(found, torch.stack([sums for _, sums in found]).tolist(), strict=True):
            values[i] = row
    out = []
    for (_, dtype, shape), (s, w, h) in zip(items, values, strict=True):
        layout = zlib.crc32(f"{dtype}:{','.join(str(int(d)) for d in shape)}".encode())
        out.append((_signed(s + layout * _MIX), _signed(w + h * _MIX)))
    return out


def checksums(tensors: Sequence[torch.Tensor]) -> list[Pair]:
    """The checksum pair of each tensor (of a ``DTensor``, its local shard's), computed on its device."""
    items = []
    for tensor in tensors:
        local = local_tensor(tensor).detach()
        items.append((as_bytes(local.contiguous()), str(local.dtype), tuple(local.shape)))
    return byte_checksums(items)


def payload_checksums(payload: torch.Tensor, meta: dict[str, Any]) -> list[Pair]:
    """The checksums of a captured state's compared tensors (the first ``meta["core"]``: model and optimizers)
    from its payload, laid out as :func:`torchpass.rank.state.payload_offsets` lays it out: what a sender would put in
    the metadata had it sent the live tensors."""
    layout = [(str(name), tuple(shape)) for name, shape in meta["layout"]]
    offsets, _ = payload_offsets(layout)
    items = []
    for (name, shape), offset in zip(layout[: meta["core"]], offsets, strict=False):
        itemsize = getattr(torch, name.removeprefix("torch.")).itemsize
        items.append((payload[offset : offset + math.prod(shape) * itemsize], name, shape))
    return byte_checksums(items)


def digest(pairs: Sequence[Pair]) -> Pair:
    """One pair for a whole table: each tensor's pair times an odd weight of its place (a single differing tensor
    always changes it; tensors that trade places do too)."""
    a = b = 0
    for i, (x, y) in enumerate(pairs):
        a += (2 * i + 1) * x
        b += (2 * i + 1) * y
    return _signed(a), _signed(b)


# ----- what is compared ---------------------------------------------------------------------------


def _refs(obj: Any, path: tuple[Any, ...]) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """(payload position, path) of every :class:`TensorRef` inside a stripped state."""
    if isinstance(obj, TensorRef):
        yield obj.position, path
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _refs(value, (*path, key))
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield from _refs(value, (*path, index))


def _optimizer_tensor(index: int, path: tuple[Any, ...], params: dict[int, str]) -> str:
    """``optimizer 0 state of blocks.0.up.weight: exp_avg`` (or the path, for anything else)."""
    if len(path) >= 3 and path[0] == "state" and isinstance(path[1], int):
        return f"optimizer {index} state of {params.get(path[1], f'parameter #{path[1]}')}: " + ".".join(
            str(p) for p in path[2:]
        )
    return f"optimizer {index} " + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _parameter_names(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """The optimizer's state_dict ids (its parameters numbered across its groups, in order) -> their names."""
    names: dict[int, str] = {}
    if model is not None:
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: names.get(id(p), f"parameter #{i}") for i, p in enumerate(ordered)}


def state_table(parts: StateParts, *, buffers: bool) -> tuple[list[str], list[torch.Tensor]]:
    """The tensors the net compares, named, in the order a state is sent (:func:`torchpass.rank.state.describe`, which
    walks them): the model's state_dict (without its buffers unless ``buffers``), then every optimizer's state.
    Registered objects are left out: their state may differ per rank by design."""
    core = StateParts(model=parts.model, optimizers=parts.optimizers, mesh=parts.mesh, label=parts.label)
    meta, tensors = describe(core, -1)
    names = [""] * len(tensors)
    skip: set[int] = set()
    model = parts.model
    own = set() if buffers or model is None else {name for name, _ in model.named_buffers(remove_duplicate=False)}
    for i, (name, _, _) in enumerate(meta["model"]):
        names[i] = f"model {name}"
        if name in own:
            skip.add(i)
    for index, (optimizer, state) in enumerate(zip(parts.optimizers, meta["optim"], strict=True)):
        params = _parameter_names(model, optimizer)
        for position, path in _refs(state, ()):
            names[position] = _optimizer_tensor(index, path, params)
    keep = [i for i in range(len(tensors)) if i not in skip]
    return [names[i] for i in keep], [tensors[i] for i in keep]


def _first_difference(a: Sequence[Pair], b: Sequence[Pair]) -> int | None:
    """The first index where two tables differ (a missing entry counts), or None."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or tuple(a[i]) != tuple(b[i]):
            return i
    return None


def _slots(slots: Sequence[int]) -> str:
    return ("slot " if len(slots) == 1 else "slots ") + ", ".join(str(s) for s in slots)


# ----- the net ------------------------------------------------------------------------------------


class ReplicaMismatch(StateError):
    """A receiver's state differs from what its source sent, or replicas differ: the job must stop."""

    def __init__(self, message: str, *, step: int, tensor: str) -> None:
        super().__init__(message)
        self.step = step
        self.tensor = tensor

    @property
    def fields(self) -> dict[str, Any]:
        """What the coordinator's ``fatal`` request carries besides the message (its event's fields)."""
        return {"kind": "replica_mismatch", "step": self.step, "tensor": self.tensor}


class FatalLink(Protocol):
    """How a rank stops the job (:class:`torchpass.rank.rejoin.CoordinatorLink`)."""

    def fatal(self, message: str, **fields: Any) -> NoReturn:
        """Tell the coordinator the job cannot go on, and raise."""
        ...


class NetHost(Protocol):
    """What the periodic check needs from the rank (:class:`torchpass.rank.context.Context` provides it)."""

    world_size: int

    @property
    def device(self) -> torch.device:
        """Where the generation's collectives run."""
        ...

    @property
    def lifecycle(self) -> StepLifecycle:
        """The step being committed (a failed check is a failure after its update)."""
        ...

    @property
    def link(self) -> FatalLink:
        """Where a mismatch stops the job."""
        ...


class ReplicaNet:
    """One rank's net: the periodic comparison of replicas (:meth:`after_commit`) and the check of every state it
    sends (:meth:`annex`) or receives (:meth:`verify`). ``every`` = 0 turns both off."""

    def __init__(self, every: int, parts: StateParts, log: _LogAdapter, event_sink: EventSink | None) -> None:
        self.every = every
        self.parts = parts
        self.log = log
        self.event_sink = event_sink
        self.shape: ShardedReplicas | None = None  # a sharded model's mesh; None: every slot is a replica (DDP)
        self.buffers = False  # DDP broadcasting buffers: every rank holds slot 0's at a commit, so they compare
        self.checks = 0  # periodic checks run
        self.check_s = 0.0  # their time, in all (checksums and collectives)
        self.checksum_s = 0.0  # of which computing this rank's checksums
        self.check_bytes = 0  # bytes read by the last one
        self._said_pure = False
        self._annexes: dict[tuple[str, int], dict[str, Any]] = {}

    @property
    def on(self) -> bool:
        """Whether the net is on (``replica_check_every_steps`` > 0)."""
        return self.every > 0

    def due(self, step: int) -> bool:
        """Whether replicas compare after ``step`` commits (every K-th step, as snapshots count)."""
        return self.every > 0 and (step + 1) % self.every == 0

    def columns(self, world_size: int) -> list[list[int]]:
        """The sets of slots that hold the same state: every slot (DDP), each shard's holders (HSDP), none (pure
        FSDP)."""
        if self.shape is None:
            return [list(range(world_size))]
        if self.shape.replicas == 1:
            return []
        return [self.shape.column(s) for s in range(self.shape.shards)]

    # ----- replicas, every K steps ----------------------------------------------------------

    def after_commit(self, step: int, host: NetHost) -> None:
        """After ``step`` committed (its update is in): compare the replicas when due. A mismatch stops the job on
        every rank at this step; a collective that fails makes the rank recover right after the commit."""
        if not self.due(step) or host.world_size < 2:
            return
        columns = self.columns(host.world_size)
        if not columns:
            if not self._said_pure:
                self._said_pure = True
                self.log.info("replica check: pure FSDP has no replica of any shard; only transfers are checked")
            return
        lifecycle = host.lifecycle
        if lifecycle.failed_after_update or lifecycle.stale():
            return  # this rank recovers right after the commit; its peers' check fails when its group goes
        started = time.perf_counter()
        try:
            message, tensor = self._compare(step, columns, host.device)
        except Exception as exc:
            lifecycle.fail_after_update(f"the replica check of step {step} failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self.checks += 1
            self.check_s += time.perf_counter() - started
        if not message and self.checks == 1:
            self.log.info(
                "replica check after step %d: the replicas agree (%.1f MiB compared in %.1f ms; every %d steps)",
                step,
                self.check_bytes / (1 << 20),
                1000 * self.check_s,
                self.every,
            )
        if message:
            emit(self.event_sink, self.log, EVENT, check="replicas", step=step, tensor=tensor, reason=message)
            host.link.fatal(message, kind="replica_mismatch", step=step, tensor=tensor)

    def _compare(self, step: int, columns: list[list[int]], device: torch.device) -> tuple[str, str]:
        """("", "") when every column agrees; else the reason and the first differing tensor's name."""
        started = time.perf_counter()
        names: list[str] = []
        pairs: list[Pair] = []
        failure = ""
        try:
            names, tensors = state_table(self.parts, buffers=self.shape is None and self.buffers)
            self.check_bytes = sum(local_tensor(t).numel() * t.element_size() for t in tensors)
            pairs = checksums(tensors)
        except Exception as exc:  # not a collective's failure: said to every rank, so that none waits for it
            failure = f"{type(exc).__name__}: {exc}"
        self.checksum_s += time.perf_counter() - started
        rows = _gather([-1, 0, 0] if failure else [len(pairs), *digest(pairs)], device)
        unable = [slot for slot, row in enumerate(rows) if row[0] < 0]
        if unable:  # the same script on every rank: it fails alike everywhere, and would at every check
            self.every = 0
            self.log.warning(
                "replica check turned off: %s could not checksum its state%s",
                _slots(unable),
                f" ({failure})" if failure else "",
            )
            return "", ""
        bad = [column for column in columns if len({rows[slot] for slot in column}) > 1]
        if not bad:
            return "", ""
        longest = max(row[0] for row in rows)
        mine = [v for pair in pairs for v in pair] + [0] * (2 * (longest - len(pairs)))
        tables = [
            [(row[1 + 2 * i], row[2 + 2 * i]) for i in range(count[0])]
            for row, count in zip(_gather([len(pairs), *mine], device), rows, strict=True)
        ]
        return self._verdict(step, bad, rows, tables, names)

    def _verdict(
        self,
        step: int,
        bad: list[list[int]],
        rows: list[tuple[int, ...]],
        tables: list[list[Pair]],
        names: list[str],
    ) -> tuple[str, str]:
        column = bad[0]
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for slot in column:
            groups[rows[slot]].append(slot)
        split = sorted(groups.values(), key=lambda slots: (-len(slots), slots))
        first = min(
            (i for slot in column[1:] if (i := _first_difference(tables[column[0]], tables[slot])) is not None),
            default=0,
        )
        tensor = names[first] if first < len(names) else f"tensor #{first + 1}"
        counts = sorted({len(tables[slot]) for slot in column})
        if len(counts) > 1:
            tensor += f" (the replicas hold {' and '.join(str(c) for c in counts)} tensors)"
        what = (
            "the DDP replicas"
            if self.shape is None
            else f"the holders of {self.shape.part_name(self.shape.coordinate(column[0])[1])}"
        )
        hold = [f"{_slots(slots)} hold{'s' if len(slots) == 1 else ''}" for slots in split]
        others = "".join(
            f"; the holders of {self.shape.part_name(self.shape.coordinate(c[0])[1])} differ too"
            for c in bad[1:]
            if self.shape is not None
        )
        message = (
            f"replica check after step {step}: {what} disagree ({hold[0]} one state; "
            f"{'; '.join(h + ' another' for h in hold[1:])}); the first tensor that differs: {tensor}{others}. "
            "Replicas of a state must be "
            "bitwise equal at every committed step (a recovery copies any of them), so the job stops instead of "
            "training on: a script that changes one rank's weights or optimizer state outside the optimizer step "
            "causes this; otherwise it is a defect (of TorchPass or the framework): report it with this message. "
            "replica_check_every_steps = 0 turns the check off (docs/user-guide.md, 'The runtime net')"
        )
        return message, tensor

    # ----- transfers --------------------------------------------------------------------------

    def annex(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
        """What a sender adds to a state's metadata (:func:`torchpass.rank.state.send_state`): the checksums of the
        compared tensors it sends (computed once per state, whatever the number of receivers)."""
        key = (str(meta["label"]), int(meta["committed"]))
        annex = self._annexes.get(key)
        if annex is None:
            started, sent = time.perf_counter(), tensors[: meta["core"]]
            annex = self._annexes[key] = {"checksums": checksums(sent)}
            self.log.info(
                "transfer check: checksums of the state sent (%s) in %.1f ms", _mib(sent), 1000 * _since(started)
            )
        return annex

    def forget(self) -> None:
        """A new generation forms: states sent from now on may differ from those sent before."""
        self._annexes.clear()

    def checker(self, parts: StateParts, source: str) -> Callable[[dict[str, Any]], None]:
        """What a receiver runs once a state from ``source`` is loaded into ``parts`` (:meth:`verify`)."""
        return lambda meta: self.verify(parts, meta, source)

    def verify(self, parts: StateParts, meta: dict[str, Any], source: str) -> None:
        """The loaded state against the checksums its sender computed; :class:`ReplicaMismatch` when they differ."""
        sent = meta.get("checksums")
        if sent is None:
            self.log.info("the state from %s carries no checksums: not checked", source)
            return
        started = time.perf_counter()
        names, tensors = state_table(parts, buffers=True)
        first = _first_difference(sent, checksums(tensors))
        if first is None:
            self.log.info(
                "transfer check: the state from %s equals what was sent (%s checked in %.1f ms)",
                source,
                _mib(tensors),
                1000 * _since(started),
            )
            return
        step = int(meta["committed"])
        tensor = names[first] if first < len(names) else f"tensor #{first + 1}"
        if len(sent) != len(tensors):
            tensor += f" (sent {len(sent)} tensors, loaded {len(tensors)})"
        message = (
            f"state transfer check: the state of step {step} from {source}, once loaded, differs from what was sent "
            "(its checksums, taken from the tensors sent or when the copy was made): the first tensor that differs: "
            f"{tensor}. A transfer copies bytes, so the receiver must equal its source; the job stops rather than "
            "training on with a corrupted rank (a registered object whose load_state_dict changes the model or the "
            "optimizer does this; otherwise it is a defect: report it with this message)"
        )
        emit(self.event_sink, self.log, EVENT, check="transfer", step=step, tensor=tensor, source=source)
        raise ReplicaMismatch(message, step=step, tensor=tensor)


def _mib(tensors: Sequence[torch.Tensor]) -> str:
    return f"{sum(t.numel() * t.element_size() for t in tensors) / (1 << 20):.1f} MiB"


def _since(started: float) -> float:
    return time.perf_counter() - started


def _gather(values: list[int], device: torch.device) -> list[tuple[int, ...]]:
    """Every member's ``values`` (the same length on each), by rank, over the generation's group."""
    row = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return [tuple(r) for r in torch.stack(rows).tolist()]
