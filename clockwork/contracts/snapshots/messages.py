"""The messages between a rank and its snapshot writer process: one JSON line each way per phase.

Typed here, on the torch-free side, so that the rank (:mod:`torchpass.snapshot`) builds and the writer
(:mod:`clockwork.contracts.snapshots.writer`) parses the same thing; a malformed line is a :class:`ValueError` with the
reason, never a ``KeyError`` deep in the writer.

Request (one line)::

    {"op": "write", "id": 7, "arena": "/proc/PID/fd/N", "arena_id": 1234, "folder": ".../step-0000000123",
     "rank": 0, "entries": [[name, offset, nbytes, dtype, shape], ...],
     "finalize": null | {"world_size": 4, "step": 123, "job": "42", "tensors": 310, "keep": 3,
                          "directory": "...", "timeout_s": 600, "mesh": null | [R, S], "extra": {...}}}

A request with ``"window": W`` (> 0) stages through an arena of only W bytes: the entries' offsets are their
places in the shard, which is written in pieces of W bytes (piece i: the shard's bytes [i W, (i + 1) W) from
the first entry's block on, at arena offset 0). For each piece the rank fills the arena, sends
``{"op": "piece", "id": 7, "index": i}`` and waits for ``{"id": 7, "phase": "piece", "ok": true, "index": i}``
before it fills the arena again (a failed shard answers ``phase: shard, ok: false`` instead, and no more pieces
are read). A state larger than the arena so never needs /dev/shm the size of the rank's share.

Answers: ``{"id": 7, "phase": "shard", "ok": true, "bytes": N, "seconds": S}`` and, on the finalizing rank,
``{"id": 7, "phase": "manifest", "ok": true, "seconds": S, "removed": [...]}``; ``ok: false`` with ``error``
when a phase failed; phase ``request`` answers a line that could not be parsed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entry", "FinalizeSpec", "Phase", "PieceReady", "WriteRequest", "WriterAnswer", "pieces"]


class Phase(enum.Enum):
    """What an answer is about."""

    REQUEST = "request"  # the request line itself was malformed
    SHARD = "shard"  # this rank's shard is durable (or failed)
    MANIFEST = "manifest"  # the finalizing rank wrote the manifest: the snapshot exists (or failed)
    PIECE = "piece"  # one window of a windowed shard is written: the rank may fill the arena again


@dataclass(frozen=True)
class Entry:
    """One named blob of the arena: its place there, and the framework's dtype and shape (kept as text)."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_wire(self) -> list[Any]:
        return [self.name, self.offset, self.nbytes, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, raw: Any) -> Entry:
        if not isinstance(raw, list | tuple) or len(raw) != 5:
            raise ValueError(f"an entry is [name, offset, nbytes, dtype, shape], got {raw!r:.200}")
        name, offset, nbytes, dtype, shape = raw
        entry = cls(str(name), int(offset), int(nbytes), str(dtype), tuple(int(v) for v in shape))
        if entry.offset < 0 or entry.nbytes < 0:
            raise ValueError(f"entry {entry.name}: negative offset or size")
        return entry


@dataclass(frozen=True)
class FinalizeSpec:
    """What the finalizing rank (slot 0) needs to write the manifest once every shard is durable."""

    world_size: int
    step: int
    job: str
    tensors: int
    keep: int
    directory: str
    timeout_s: float
    mesh: tuple[int, int] | None = None  # a sharded model's (replicas, shards): one state per shard
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> FinalizeSpec:
        return cls(
            world_size=int(raw["world_size"]),
            step=int(raw["step"]),
            job=str(raw.get("job", "")),
            tensors=int(raw["tensors"]),
            keep=int(raw["keep"]),
            directory=str(raw["directory"]),
            timeout_s=float(raw["timeout_s"]),
            mesh=_mesh(raw.get("mesh")),
            extra=dict(raw.get("extra") or {}),
        )


def _mesh(raw: Any) -> tuple[int, int] | None:
    if raw is None:
        return None
    if not isinstance(raw, list | tuple) or len(raw) != 2:
        raise ValueError(f"a mesh is [replicas, shards], got {raw!r:.100}")
    replicas, shards = int(raw[0]), int(raw[1])
    if replicas < 1 or shards < 1:
        raise ValueError(f"a mesh of {replicas}x{shards}")
    return replicas, shards


#: Pieces start on this boundary (the writer's direct-I/O block, the arena's entry alignment).
PIECE_ALIGN = 4096


def _window(raw: Any) -> int:
    window = int(raw or 0)
    if window < 0 or window % PIECE_ALIGN:
        raise ValueError(f"a window is a positive multiple of {PIECE_ALIGN} bytes, got {window}")
    return window


def pieces(entries: tuple[Entry, ...] | list[Entry], window: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each piece: the bytes from the first entry's block to the end of the last, cut every
    ``window`` bytes (0: one piece)."""
    if not entries:
        return []
    base = min(e.offset for e in entries) // PIECE_ALIGN * PIECE_ALIGN
    end = max(e.offset + e.nbytes for e in entries)
    if not window:
        return [(base, end)]
    return [(lo, min(end, lo + window)) for lo in range(base, max(end, base + 1), window)]


@dataclass(frozen=True)
class PieceReady:
    """The rank's word that the arena holds piece ``index`` of request ``id``."""

    id: int
    index: int

    def to_line(self) -> str:
        return json.dumps({"op": "piece", "id": self.id, "index": self.index})

    @classmethod
    def from_line(cls, line: str) -> PieceReady:
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict) or raw.get("op") != "piece":
                raise ValueError(f"not a piece line: {line[:200]!r}")
            return cls(int(raw["id"]), int(raw["index"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed piece line ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class WriteRequest:
    """Write this rank's shard of one snapshot from the arena (and, with ``finalize``, the manifest)."""

    id: int
    arena: str  # /proc/PID/fd/N of the rank's unlinked shared-memory file
    arena_id: int  # tells a new arena that reuses the same descriptor number from the one mapped before
    folder: str
    rank: int
    entries: tuple[Entry, ...]
    finalize: FinalizeSpec | None = None
    window: int = 0  # > 0: the arena holds W bytes, the shard comes in pieces (see the module docstring)

    def to_line(self) -> str:
        body: dict[str, Any] = {
            "op": "write",
            "id": self.id,
            "arena": self.arena,
            "arena_id": self.arena_id,
            "folder": self.folder,
            "rank": self.rank,
            "entries": [e.to_wire() for e in self.entries],
            "finalize": None if self.finalize is None else dataclasses.asdict(self.finalize),
        }
        if self.window:
            body["window"] = self.window
        return json.dumps(body)

    @classmethod
    def from_line(cls, line: str) -> WriteRequest:
        """Parse one request line; ValueError (with the reason) for anything malformed."""
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict) or raw.get("op") != "write":
                raise ValueError(f"not a write request: {line[:200]!r}")
            spec = raw.get("finalize")
            return cls(
                id=int(raw["id"]),
                arena=str(raw["arena"]),
                arena_id=int(raw.get("arena_id") or 0),
                folder=str(raw["folder"]),
                rank=int(raw["rank"]),
                entries=tuple(Entry.from_wire(e) for e in raw["entries"]),
                finalize=None if spec is None else FinalizeSpec.from_wire(spec),
                window=_window(raw.get("window")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed write request ({type(exc).__name__}: {exc})") from None

    def pieces(self) -> list[tuple[int, int]]:
        """The shard's pieces ``(start, end)`` in shard offsets (one, the whole, without a window)."""
        return pieces(self.entries, self.window)

    @property
    def phases(self) -> set[Phase]:
        """The answers this request gets."""
        return {Phase.SHARD, Phase.MANIFEST} if self.finalize is not None else {Phase.SHARD}


@dataclass(frozen=True)
class WriterAnswer:
    """One phase of one request done (``ok``) or failed (``error``)."""

    id: int | None
    phase: Phase
    ok: bool
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0
    removed: tuple[str, ...] = ()
    index: int = -1  # the piece (phase PIECE)

    def to_line(self) -> str:
        body: dict[str, Any] = {"id": self.id, "phase": self.phase.value, "ok": self.ok}
        if self.phase is Phase.PIECE:
            body["index"] = self.index
        if self.error:
            body["error"] = self.error
        if self.phase is Phase.SHARD and self.ok:
            body["bytes"] = self.bytes
        if self.ok:
            body["seconds"] = self.seconds
        if self.removed:
            body["removed"] = list(self.removed)
        return json.dumps(body)

    @classmethod
    def from_line(cls, line: str) -> WriterAnswer:
        """Parse one answer line; ValueError for anything malformed."""
        try:
            raw = json.loads(line)
            return cls(
                id=None if raw.get("id") is None else int(raw["id"]),
                phase=Phase(raw["phase"]),
                ok=bool(raw["ok"]),
                error=str(raw.get("error", "")),
                bytes=int(raw.get("bytes", 0)),
                seconds=float(raw.get("seconds", 0.0)),
                removed=tuple(str(p) for p in raw.get("removed", ())),
                index=int(raw.get("index", -1)),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed writer answer ({type(exc).__name__}: {exc}): {line[:200]!r}") from None
