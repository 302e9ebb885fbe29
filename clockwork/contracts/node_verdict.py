"""A node-silent verdict as the node daemon hands it to a job's TorchPass agents (wire format, pure).

Kept in a module of its own, with nothing but the typed record and its checked conversion, so that TorchPass
(which imports of Clockwork only ``clockwork.contracts``) reads the same type the daemon writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["NodeVerdict", "NodeVerdicts", "VerdictFormatError"]


class VerdictFormatError(ValueError):
    """A verdict record that does not have the expected fields and types."""


@dataclass(frozen=True)
class NodeVerdict:
    """``node`` is dead: silent on every rail, its kernel silent, and (where one exists) a second observer agrees.

    ``seq`` orders the verdicts of one daemon (a follower asks for those after the last it saw); ``last_heard`` is
    the wall-clock time of the node's last heartbeat (the evidence's start); ``silent_ms`` how long it had been
    silent at the verdict; ``confirmed_by`` the daemons that agreed (empty when no other daemon exists).
    """

    seq: int
    node: str
    last_heard: float
    silent_ms: float
    confirmed_by: tuple[str, ...]
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "node": self.node,
            "last_heard": self.last_heard,
            "silent_ms": self.silent_ms,
            "confirmed_by": list(self.confirmed_by),
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, doc: Any) -> NodeVerdict:
        """The verdict of a reply's record, or VerdictFormatError naming what is wrong."""
        if not isinstance(doc, dict):
            raise VerdictFormatError(f"a verdict is a map, got {type(doc).__name__}")
        seq, node, last_heard, silent_ms = doc.get("seq"), doc.get("node"), doc.get("last_heard"), doc.get("silent_ms")
        by, reason = doc.get("confirmed_by"), doc.get("reason")
        if type(seq) is not int or seq < 1:
            raise VerdictFormatError(f"verdict 'seq' must be a positive integer, got {seq!r}")
        if not isinstance(node, str) or not node:
            raise VerdictFormatError(f"verdict 'node' must be a node name, got {node!r}")
        for name, value in (("last_heard", last_heard), ("silent_ms", silent_ms)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise VerdictFormatError(f"verdict '{name}' must be a finite number, got {value!r}")
        if not isinstance(by, list) or not all(isinstance(b, str) for b in by):
            raise VerdictFormatError(f"verdict 'confirmed_by' must be a list of node names, got {by!r}")
        if not isinstance(reason, str):
            raise VerdictFormatError(f"verdict 'reason' must be a string, got {reason!r}")
        assert isinstance(last_heard, int | float) and isinstance(silent_ms, int | float)  # checked above
        return cls(seq, node, float(last_heard), float(silent_ms), tuple(by), reason)


@dataclass(frozen=True)
class NodeVerdicts:
    """One answer to ``node_verdicts``: the verdicts asked for, the daemon's newest verdict number, and whether its
    node watch runs at all (``state`` says why not)."""

    verdicts: list[NodeVerdict]
    seq: int
    enabled: bool
    state: str = ""
