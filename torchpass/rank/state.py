"""The training state that moves between ranks, and how it travels.

What moves: the model's ``state_dict`` (parameters and buffers), every wrapped optimizer's ``state_dict``
(moment buffers, step counts, hyper-parameters), every registered object's ``state_dict`` (LR scheduler,
grad scaler, user state) and the committed step, which is also the data position (batches are indexed by
step). RNG state does not move: every rank reseeds at each step boundary from (seed, slot, step), so a
replacement draws exactly what the rank it replaces would have drawn (see :mod:`torchpass.rank.rng`).

How it travels, from one healthy replica to one receiver, over the generation's process group with
point-to-point sends (so several receivers can be fed by several sources in parallel):

1. a header (two int64: metadata length, payload length);
2. the metadata: a description of the state with every tensor replaced by :class:`TensorRef`, plus each
   tensor's dtype and shape (so a brand-new spare, whose optimizer has no state yet, knows what to allocate), as
   msgpack (:mod:`torchpass.rank.state_codec`): never pickle, whose bytes from a socket run whatever code they name,
   even between the ranks of one job;
3. the payload: every tensor's bytes, back to back in a deterministic order (model tensors in ``state_dict``
   order, then optimizers', then registered objects'), each aligned to 64 bytes and sent in chunks of at
   most ``transfer_chunk_mb``. Model tensors are received straight into the live parameters.

Every byte is copied, never recomputed: the receiver ends bitwise equal to the source.

Sharded state (FSDP2: parameters and optimizer state are ``DTensor``s) travels as each tensor's local shard,
with the ``DTensor``'s placements, global shape and stride in the metadata: a receiver holding the same shard
of the same mesh takes the parameters' shards straight into its live parameters and rebuilds the optimizer
state as ``DTensor``s over its own mesh (:attr:`StateParts.mesh`). :attr:`StateParts.label` names which part
of the state a rank holds (e.g. shard 1 of a 2x2 mesh); a receiver refuses a state labelled otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchpass.rank.state_codec import MetaCodecError, TensorRef, decode_meta, encode_meta

__all__ = [
    "StateError",
    "StateParts",
    "TensorRef",
    "apply_state",
    "as_bytes",
    "describe",
    "destinations_for",
    "load_payload",
    "local_tensor",
    "payload_offsets",
    "recv_state",
    "send_payload",
    "send_state",
]

ALIGN = 64
FORMAT_VERSION = 1


class StateError(RuntimeError):
    """A state problem retrying cannot fix: the receiver's model or optimizers do not match the sender's (a
    different script or model), or an object refused its own state_dict. Transport errors are not this."""


@dataclass
class StateParts:
    """The objects whose state a rank sends or receives (what the user wrapped and registered)."""

    model: nn.Module | None = None
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # name -> object with state_dict/load_state_dict
    mesh: Any = None  # a sharded model's DeviceMesh: received DTensor state is rebuilt over it
    label: str = ""  # which part of the training state this is ("" = all of it; e.g. "shard 1 of 2x2")


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor moved into ``tensors`` and replaced by a :class:`TensorRef`."""
    if isinstance(obj, DTensor):
        tensors.append(obj.to_local().detach())
        return TensorRef(len(tensors) - 1, (tuple(obj.placements), tuple(obj.shape), tuple(obj.stride())))
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return TensorRef(len(tensors) - 1)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _strip(v, tensors)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, TensorRef):
        items = [_strip(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _fill(obj: Any, tensors: Sequence[torch.Tensor], mesh: Any = None) -> Any:
    """Inverse of :func:`_strip` (``DTensor``s are rebuilt over ``mesh``)."""
    if isinstance(obj, TensorRef):
        local = tensors[obj.position]
        if obj.dtensor is None:
            return local
        if mesh is None:
            raise StateError("the sender's state is sharded (DTensors) and this rank's model is not")
        placements, shape, stride = obj.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _fill(v, tensors, mesh)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _fill(v, tensors, mesh) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors, mesh) for v in obj]
    if isinstance(obj, tuple):
        items = [_fill(v, tensors, mesh) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _fill_optimizer(optimizer: torch.optim.Optimizer, state: Any, tensors: Sequence[torch.Tensor], mesh: Any) -> Any:
    """:func:`_fill` of an optimizer's state dict, each parameter's state rebuilt over that parameter's own mesh.

    Why per parameter: under tensor parallelism beside FSDP the parameters do not share one mesh (a TP-sharded
    weight's DTensor spans (replicate, shard, tp), a norm's weight only (replicate, shard)), and DTensor refuses
    an update between a gradient and a state on different meshes. The state dict numbers parameters in the order
    of the optimizer's param groups."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        return _fill(state, tensors, mesh)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    meshes = {i: p.device_mesh for i, p in enumerate(params) if isinstance(p, DTensor)}
    filled = {k: _fill(v, tensors, mesh) for k, v in state.items() if k != "state"}
    filled["state"] = {k: _fill(v, tensors, meshes.get(k, mesh)) for k, v in state["state"].items()}
    return filled


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as it travels: a ``DTensor``'s local shard (a view of the live parameter), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def update_only_tensors(parts: StateParts) -> set[int]:
    """data_ptrs of the tensors only an optimizer step changes (parameters and optimizer state; of a ``DTensor``,
    its local shard's): copies of the committed state (snapshots, peer copies) take them while the next forward
    and backward pass run, and the next optimizer step waits for that."""
    ptrs: set[int] = set()
    if parts.model is not None:
        ptrs.update(local_tensor(p).data_ptr() for p in parts.model.parameters())
    for optimizer in parts.optimizers:
        for state in optimizer.state.values():
            ptrs.update(local_tensor(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    return ptrs


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StateError(f"unknown dtype {name!r} in received state")
    return dtype


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def payload_offsets(layout: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Aligned byte offset of each tensor in the payload, and the payload's length."""
    offsets, position = [], 0
    for dtype_name, shape in layout:
        offsets.append(position)
        size = _nbytes(shape, _dtype(dtype_name))
        position += (size + ALIGN - 1) // ALIGN * ALIGN
    return offsets, position


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a 0-d tensor counts as one element)."""
    return tensor.reshape(-1).view(torch.uint8)


def _chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    start = 0
    while start < total:
        yield start, min(total, start + chunk)
        start += chunk


def _overlaps(offsets: Sequence[int], sizes: Sequence[int], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(tensor index, from, to) of the payload byte ranges inside [lo, hi)."""
    for i, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        a, b = max(lo, off), min(hi, off + size)
        if a < b:
            yield i, a, b


def describe(parts: StateParts, committed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The metadata and the tensors (in payload order) of this rank's state."""
    try:
        return _describe(parts, committed)
    except Exception as exc:
        raise StateError(f"cannot capture this rank's state: {type(exc).__name__}: {exc}") from exc


def _describe(parts: StateParts, committed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    model_entries: list[tuple[str, tuple[int, ...], str]] = []
    if parts.model is not None:
        for name, tensor in parts.model.state_dict().items():
            local = local_tensor(tensor).detach()
            model_entries.append((name, tuple(local.shape), str(local.dtype)))
            tensors.append(local)
    optim = [_strip(opt.state_dict(), tensors) for opt in parts.optimizers]
    # The model's and the optimizers' tensors come first (what torchpass.rank.replica_check compares).
    core = len(tensors)
    extra = {name: _strip(obj.state_dict(), tensors) for name, obj in parts.extra.items()}
    meta = {
        "version": FORMAT_VERSION,
        "committed": committed,
        "label": parts.label,
        "model": model_entries,
        "optim": optim,
        "extra": extra,
        "core": core,
        "layout": [(str(t.dtype), tuple(t.shape)) for t in tensors],
    }
    return meta, tensors


def send_state(
    parts: StateParts,
    committed: int,
    dst: int,
    device: torch.device,
    chunk_bytes: int,
    annex: Callable[[dict[str, Any], list[torch.Tensor]], Mapping[str, Any]] | None = None,
) -> int:
    """Send this rank's state to rank ``dst`` of the current group; returns the payload bytes sent. ``annex(meta,
    tensors)`` adds to the metadata (the sender's checksums: :meth:`torchpass.rank.replica_check.ReplicaNet.annex`)."""
    meta, tensors = describe(parts, committed)
    if annex is not None:
        meta.update(annex(meta, tensors))
    try:
        blob = encode_meta(meta)
    except MetaCodecError as exc:
        raise StateError(str(exc)) from None
    offsets, total = payload_offsets(meta["layout"])
    dist.send(torch.tensor([len(blob), total], dtype=torch.int64, device=device), dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst)
    sources = [as_bytes(t.contiguous()) for t in tensors]
    sizes = [s.numel() for s in sources]
    for lo, hi in _chunks(total, chunk_bytes):
        buf = torch.zeros(hi - lo, dtype=torch.uint8, device=device)
        for i, a, b in _overlaps(offsets, sizes, lo, hi):
            buf[a - lo : b - lo].copy_(sources[i][a - offsets[i] : b - offsets[i]])
        dist.send(buf, dst)
    return total


def send_payload(blob: bytes, payload: torch.Tensor, dst: int, device: torch.device, chunk_bytes: int) -> int:
    """Send a state captured earlier (its metadata as msgpack and its payload, laid out as :func:`send_state` lays
    it out, e.g. a peer copy in host memory) to rank ``dst``, on the same wire; returns the payload bytes."""
    total = int(payload.numel())
    dist.send(torch.tensor([len(blob), total], dtype=torch.int64, device=device), dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst)
    for lo, hi in _chunks(total, chunk_bytes):
        dist.send(payload[lo:hi].to(device) if payload.device != device else payload[lo:hi].contiguous(), dst)
    return total


def load_payload(
    parts: StateParts,
    meta: dict[str, Any],
    payload: torch.Tensor,
    device: torch.device,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Load a state captured earlier (``meta`` and its payload) into ``parts``: model tensors in place, the rest
    as fresh tensors (never views of ``payload``, which is reused); returns the payload bytes. ``check(meta)``
    runs once it is loaded (the net's comparison with the checksums taken when it was captured)."""
    layout = [(name, tuple(shape)) for name, shape in meta["layout"]]
    offsets, total = payload_offsets(layout)
    if total != payload.numel():
        raise StateError(f"a captured payload of {payload.numel()} bytes does not match its layout ({total})")
    destinations = destinations_for(parts, meta, layout, device)
    with torch.no_grad():
        for offset, target in zip(offsets, destinations, strict=True):
            flat = as_bytes(target)
            flat.copy_(payload[offset : offset + flat.numel()])
    apply_state(parts, meta, destinations)
    if check is not None:
        check(meta)
    return total


def recv_state(
    parts: StateParts,
    src: int,
    device: torch.device,
    chunk_bytes: int,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[int, int]:
    """Receive a state from rank ``src`` into ``parts``; returns (committed step, payload bytes). ``check(meta)``
    runs once it is loaded (the net's comparison with the sender's checksums; it raises a :class:`StateError`).

    Raises :class:`StateError` when the model or optimizers differ from the sender's, and whatever
    the process group raises when the sender dies: the caller must then treat this rank's state as lost.
    """
    header = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(header, src)
    blob_len, total = (int(v) for v in header.tolist())
    blob = torch.empty(blob_len, dtype=torch.uint8, device=device)
    dist.recv(blob, src)
    try:
        meta = decode_meta(blob.cpu().numpy().tobytes())
    except MetaCodecError as exc:
        raise StateError(f"the state description from rank {src} is unreadable: {exc}") from None
    if meta.get("version") != FORMAT_VERSION:
        raise StateError(f"state format {meta.get('version')} from rank {src}, expected {FORMAT_VERSION}")
    layout = [(name, tuple(shape)) for name, shape in meta["layout"]]
    offsets, expected_total = payload_offsets(layout)
    if expected_total != total:
        raise StateError(f"payload of {total} bytes does not match its layout ({expected_total})")
    destinations = destinations_for(parts, meta, layout, device)
    targets = [as_bytes(d) for d in destinations]
    sizes = [t.numel() for t in targets]
    for lo, hi in _chunks(total, chunk_bytes):
        buf = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        dist.recv(buf, src)
        for i, a, b in _overlaps(offsets, sizes, lo, hi):
            targets[i][a - offsets[i] : b - offsets[i]].copy_(buf[a - lo : b - lo])
    apply_state(parts, meta, destinations)
    if check is not None:
        check(meta)
    return int(meta["committed"]), total


def destinations_for(
    parts: StateParts, meta: dict[str, Any], layout: list[tuple[str, tuple[int, ...]]], device: torch.device
) -> list[torch.Tensor]:
    """Where each received tensor goes: the live model tensors first, fresh tensors for the rest."""
    out: list[torch.Tensor] = []
    model_entries = meta["model"]
    if meta.get("label", "") != parts.label:
        raise StateError(
            f"received {meta.get('label') or 'the whole state'}, this rank holds {parts.label or 'it all'}"
        )
    if parts.model is not None:
        local = {name: local_tensor(tensor) for name, tensor in parts.model.state_dict().items()}
        names = [name for name, _, _ in model_entries]
        if names != list(local):
            missing = sorted(set(names) ^ set(local))[:5]
            raise StateError(f"model state differs from the sender's (e.g. {missing})")
        for name, shape, dtype_name in model_entries:
            tensor = local[name]
            if tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != dtype_name:
                raise StateError(
                    f"model tensor {name}: here {tuple(tensor.shape)} {tensor.dtype}, sent {tuple(shape)} {dtype_name}"
                )
            if not tensor.is_contiguous():
                raise StateError(f"model tensor {name} is not contiguous; cannot receive in place")
            out.append(tensor)
    elif model_entries:
        raise StateError("the sender has a model and this rank wrapped none")
    if len(meta["optim"]) != len(parts.optimizers):
        raise StateError(f"sender has {len(meta['optim'])} optimizer(s), this rank {len(parts.optimizers)}")
    if set(meta["extra"]) != set(parts.extra):
        raise StateError(f"registered state: sender {sorted(meta['extra'])}, here {sorted(parts.extra)}")
    for dtype_name, shape in layout[len(out) :]:
        out.append(torch.empty(shape, dtype=_dtype(dtype_name), device=device))
    return out


def apply_state(parts: StateParts, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    """Load the optimizers' and registered objects' state from ``meta`` with ``tensors`` in place of its
    :class:`TensorRef` s (model tensors were received in place already)."""
    try:
        for optimizer, state in zip(parts.optimizers, meta["optim"], strict=True):
            optimizer.load_state_dict(_fill_optimizer(optimizer, state, tensors, parts.mesh))
        for name, state in meta["extra"].items():
            parts.extra[name].load_state_dict(_fill(state, tensors, parts.mesh))
    except StateError:
        raise
    except Exception as exc:
        raise StateError(f"cannot load the received state: {type(exc).__name__}: {exc}") from exc
