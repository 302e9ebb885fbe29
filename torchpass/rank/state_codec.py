"""The description of a captured state (:func:`torchpass.rank.state.describe`'s metadata) as msgpack, for the wire.

Why not pickle: the metadata of a transfer (:func:`torchpass.rank.state.send_state`) and of a peer copy crosses a
socket, and unpickling bytes from a socket runs whatever code they name. msgpack builds only plain values, and the
few Python types a state description holds besides them are carried as msgpack extension types that this module
alone builds back, each from a closed list:

==========  =====================================================================================
tuple       the optimizers' ``betas`` and other tuples stay tuples (a list would load, and then differ)
OrderedDict kept ordered and of its type
TensorRef   a tensor's place in the payload, and a ``DTensor``'s placements, global shape and stride
placement   ``Shard``, ``Replicate``, ``Partial`` and FSDP2+TP's strided shard (:mod:`torchpass.rank.torch_compat`)
ndarray     numpy arrays and scalars (a registered object's state may hold them), dtype and bytes
set         sets and frozensets
==========  =====================================================================================

Anything else (an arbitrary class in a registered object's ``state_dict``) is refused when the state is captured,
naming where it is, instead of travelling as code. Decoding checks every extension's shape and refuses the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import numpy as np
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from torchpass.rank.torch_compat import is_strided_shard, strided_shard

__all__ = ["MetaCodecError", "TensorRef", "decode_meta", "encode_meta"]

_TUPLE, _ORDERED, _TENSOR_REF, _PLACEMENT, _NDARRAY, _SET, _FROZENSET = range(1, 8)
_MAX_DEPTH = 64


class TensorRef(NamedTuple):
    """Stands in for a tensor inside a state description: its index in the payload, and for a ``DTensor`` (whose
    local shard is what the payload holds) its placements, global shape and stride."""

    position: int
    dtensor: tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...]] | None = None


class MetaCodecError(ValueError):
    """A state description that cannot travel as msgpack (an unsupported type), or bytes that are not one."""


def _placement(value: Placement) -> list[Any]:
    if is_strided_shard(value):
        dim, split_factor = value.dim, value.split_factor  # type: ignore[attr-defined]
        return ["strided_shard", int(dim), int(split_factor)]
    if isinstance(value, Shard):
        return ["shard", int(value.dim)]
    if isinstance(value, Replicate):
        return ["replicate"]
    if isinstance(value, Partial):
        return ["partial", str(value.reduce_op)]
    raise MetaCodecError(f"DTensor placement {value!r} is not one the peer-copy wire knows")


def _packer() -> Callable[[Any], bytes]:
    def default(value: Any) -> msgpack.ExtType:
        if isinstance(value, TensorRef):
            spec = None
            if value.dtensor is not None:
                placements, shape, stride = value.dtensor
                spec = [[_placement(p) for p in placements], list(shape), list(stride)]
            return msgpack.ExtType(_TENSOR_REF, pack([value.position, spec]))
        if isinstance(value, OrderedDict):
            return msgpack.ExtType(_ORDERED, pack([[k, v] for k, v in value.items()]))
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return msgpack.ExtType(_TUPLE, pack(list(value)))
        if isinstance(value, Placement):
            return msgpack.ExtType(_PLACEMENT, pack(_placement(value)))
        if isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
            if array.dtype.hasobject:
                raise MetaCodecError("a numpy array of Python objects cannot travel")
            dims = None if isinstance(value, np.generic) else list(array.shape)
            return msgpack.ExtType(_NDARRAY, pack([array.dtype.str, dims, np.ascontiguousarray(array).tobytes()]))
        if isinstance(value, set | frozenset):
            return msgpack.ExtType(_SET if isinstance(value, set) else _FROZENSET, pack(list(value)))
        raise MetaCodecError(f"{type(value).__module__}.{type(value).__qualname__} {_short(value)}")

    def pack(value: Any) -> bytes:
        return msgpack.packb(value, default=default, use_bin_type=True, strict_types=True)

    return pack


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_meta(meta: dict[str, Any]) -> bytes:
    """``meta`` as msgpack bytes; MetaCodecError naming the first value of a type that cannot travel."""
    try:
        return _packer()(meta)
    except MetaCodecError as exc:
        raise MetaCodecError(
            f"this rank's state cannot travel to its peers: it holds a {exc} (state_dicts may hold tensors, "
            "numbers, strings, bytes, None, lists, tuples, dicts, sets and numpy values)"
        ) from None
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int beyond 64 bits
        raise MetaCodecError(f"this rank's state cannot travel to its peers: {exc}") from None


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise MetaCodecError(f"malformed state description: {what}")


def _decode_placement(fields: Any) -> Placement:
    _expect(isinstance(fields, list) and bool(fields) and isinstance(fields[0], str), "a placement")
    kind, args = fields[0], fields[1:]
    if kind == "shard" and len(args) == 1 and type(args[0]) is int:
        return Shard(args[0])
    if kind == "replicate" and not args:
        return Replicate()
    if kind == "partial" and len(args) == 1 and isinstance(args[0], str):
        return Partial(args[0])
    if kind == "strided_shard" and len(args) == 2 and all(type(a) is int for a in args):
        return strided_shard(args[0], args[1])
    raise MetaCodecError(f"malformed state description: unknown placement {_short(fields)}")


def _ints(value: Any, what: str) -> tuple[int, ...]:
    _expect(isinstance(value, list) and all(type(v) is int for v in value), what)
    return tuple(value)


def _unpacker() -> Callable[[bytes], Any]:
    depth = [0]

    def ext_hook(code: int, data: bytes) -> Any:
        depth[0] += 1
        try:
            _expect(depth[0] <= _MAX_DEPTH, f"nested deeper than {_MAX_DEPTH}")
            return _ext(code, unpack(data))
        finally:
            depth[0] -= 1

    def unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=ext_hook)

    return unpack


def _ext(code: int, body: Any) -> Any:
    if code == _TUPLE:
        _expect(isinstance(body, list), "a tuple")
        return tuple(body)
    if code == _ORDERED:
        _expect(isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body), "an OrderedDict")
        return OrderedDict((k, v) for k, v in body)
    if code == _TENSOR_REF:
        _expect(isinstance(body, list) and len(body) == 2 and type(body[0]) is int, "a tensor reference")
        position, spec = body
        if spec is None:
            return TensorRef(position)
        _expect(isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], list), "a DTensor reference")
        placements = tuple(_decode_placement(p) for p in spec[0])
        return TensorRef(position, (placements, _ints(spec[1], "a shape"), _ints(spec[2], "a stride")))
    if code == _PLACEMENT:
        return _decode_placement(body)
    if code == _NDARRAY:
        _expect(isinstance(body, list) and len(body) == 3 and isinstance(body[0], str), "a numpy value")
        dtype_str, shape, raw = body
        _expect(isinstance(raw, bytes), "a numpy value's bytes")
        try:
            dtype = np.dtype(dtype_str)
        except TypeError:
            raise MetaCodecError(f"malformed state description: numpy dtype {_short(dtype_str)}") from None
        _expect(not dtype.hasobject, "a numpy value of Python objects")
        if shape is None:
            _expect(len(raw) == dtype.itemsize, "a numpy scalar's size")
            return np.frombuffer(raw, dtype=dtype)[0]
        dims = _ints(shape, "a numpy shape")
        _expect(len(raw) == int(np.prod(dims, dtype=np.int64)) * dtype.itemsize, "a numpy array's size")
        return np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
    if code in (_SET, _FROZENSET):
        _expect(isinstance(body, list), "a set")
        try:
            return set(body) if code == _SET else frozenset(body)
        except TypeError:
            raise MetaCodecError("malformed state description: a set of unhashable values") from None
    raise MetaCodecError(f"malformed state description: unknown extension type {code}")


def decode_meta(data: bytes) -> dict[str, Any]:
    """The state description ``data`` encodes; MetaCodecError for anything that is not one."""
    try:
        meta = _unpacker()(data)
    except MetaCodecError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, StackError, ...)
        raise MetaCodecError(f"not a msgpack state description: {type(exc).__name__}: {exc}") from None
    _expect(isinstance(meta, dict), "not a map")
    return meta
