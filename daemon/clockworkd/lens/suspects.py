"""Suspect links over time: when Lens raises one, updates it, clears it, who announces it, and LinkPass's part.

Why apart from the localization: tomography names the links that explain the bad paths of one evaluation,
and one evaluation is noisy. A suspect is raised only after ``raise_after`` evaluations in a row that find it
and cleared after ``clear_after`` without it, so one unlucky window neither raises nor clears anything. Every
daemon tracks every suspect (each holds the whole picture), but only the daemon whose node owns the link
records ``lens.suspect``/``lens.clear``, so each shows up once; and every daemon hands its own paths through a
suspect NIC to LinkPass as gray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from clockwork.contracts.config.lens import LensConfig
from clockwork.contracts.lens_model import Suspect, split_nic

log = logging.getLogger("clockwork.lens")

Emit = Callable[[str, dict[str, Any]], None]
GRAY_KINDS = frozenset({"loss", "delay", "jitter", "rate"})  # what LinkPass cannot see by itself


class GrayTarget(Protocol):
    """Where suspect NIC paths go (LinkPass)."""

    def set_gray(self, peer: str, rail: str, reason: str | None) -> bool: ...


@dataclass
class SuspectState:
    """One suspect between evaluations: how many in a row found it or not, and when and how it was raised."""

    suspect: Suspect
    seen: int = 0  # evaluations in a row it was found
    missing: int = 0  # evaluations in a row it was not
    raised: bool = False
    raised_at: float = 0.0  # monotonic
    raised_wall: float = 0.0  # unix time (what reports show)
    announced: tuple[str, tuple[str, ...]] = ("", ())  # direction and kinds last announced


class LinkSuspects:
    """One node's suspects: ``track`` after each localization, ``raised`` for the snapshot.

    ``peers_alive``: the other nodes heard from lately; the lowest-named of them and this node announces a
    suspect that names no NIC (a switch link), so that exactly one daemon does.
    """

    def __init__(
        self,
        cfg: LensConfig,
        node: str,
        nodes: list[str],
        emit: Emit,
        gray: GrayTarget | None,
        peers_alive: Callable[[], list[str]],
    ) -> None:
        self.cfg = cfg
        self.me = node
        self.nodes = nodes
        self.emit = emit
        self.gray = gray
        self.peers_alive = peers_alive
        self.states: dict[str, SuspectState] = {}

    def raised(self) -> list[dict[str, Any]]:
        """The suspects raised now, as the snapshot shows them (with the unix time each was raised)."""
        return [{**st.suspect.to_dict(), "since": st.raised_wall} for st in self.states.values() if st.raised]

    def _owner(self, suspect: Suspect) -> str:
        if suspect.nic is not None:
            return split_nic(suspect.nic)[0]
        return min([*self.peers_alive(), self.me])

    def track(self, found: list[Suspect], now: float) -> None:
        """One evaluation's localization: count each suspect in or out, raise, update and clear."""
        keys = {s.key for s in found}
        for s in found:
            state = self.states.get(s.key)
            if state is None:
                state = self.states[s.key] = SuspectState(s)
            state.suspect, state.seen, state.missing = s, state.seen + 1, 0
            if not state.raised and state.seen >= self.cfg.raise_after:
                state.raised, state.raised_at, state.raised_wall = True, now, time.time()
                state.announced = (s.direction, s.kinds)
                self._announce("lens.suspect", s, now)
            elif state.raised and state.announced != (s.direction, s.kinds):
                # More evidence changed the picture (one direction became both, loss became dead): say so.
                state.announced = (s.direction, s.kinds)
                self._announce("lens.suspect", s, now, update=True)
        for key in list(self.states):
            if key in keys:
                continue
            state = self.states[key]
            state.seen, state.missing = 0, state.missing + 1
            if state.missing >= self.cfg.clear_after:
                del self.states[key]
                if state.raised:
                    self._announce("lens.clear", state.suspect, now, lasted_s=round(now - state.raised_at, 3))

    def _announce(self, kind: str, s: Suspect, now: float, **extra: Any) -> None:
        fields = {**s.to_dict(), **extra, "by": self.me}
        level = logging.WARNING if kind == "lens.suspect" else logging.INFO
        log.log(
            level,
            "lens on %s: %s %s (%s, %s, confidence %.2f)",
            self.me,
            kind,
            s.link,
            s.direction,
            ",".join(s.kinds),
            s.confidence,
        )
        if self._owner(s) == self.me:
            self.emit(kind, fields)
        self._hand_to_linkpass(s, kind == "lens.suspect")

    def _hand_to_linkpass(self, s: Suspect, gray: bool) -> None:
        """This node's paths through a suspect NIC become gray in LinkPass (and normal again on clear).

        Only gray kinds (loss, delay, jitter, rate) are handed over: a dead path is LinkPass's own
        business, seen faster by its heartbeats, and holding it gray until Lens clears would only
        delay the fail-back.
        """
        if self.gray is None or not self.cfg.linkpass_handoff or s.nic is None:
            return
        if gray and ("dead" in s.kinds or not set(s.kinds) & GRAY_KINDS):
            return
        node, rail = split_nic(s.nic)
        reason = f"lens suspect {s.link} ({','.join(s.kinds)})" if gray else None
        targets = [p for p in self.nodes if p != self.me] if node == self.me else [node]
        for peer in targets:
            self.gray.set_gray(peer, rail, reason)
