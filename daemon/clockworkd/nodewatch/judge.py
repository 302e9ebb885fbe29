"""The node-silent decision, pure: what the evidence says about each peer, and what to do next.

The evidence, per peer, at each tick of the daemon's loop:

* **the daemon's silence**: when LinkPass last received one of the peer's heartbeats, on any rail (every
  ``heartbeat_ms``, 10 ms: on every rail from a path peer, on one rail in turn from a job's node). One silent
  rail is LinkPass's business (a dead NIC, a flapping link, a partitioned rail: the other rails still carry
  heartbeats); only silence on *every* rail counts here;
* **the kernel's silence**: from ``probe_after_ms`` of silence on, an ICMP echo to the peer's address on every
  rail at each tick. A node whose daemon and training processes are stopped, starved or swapped out still
  answers from its kernel; a crashed or powered-off node, or one whose links are all dark, does not. A verdict
  needs ``silent_after_ms - probe_after_ms`` of unanswered echoes, and the peer must have answered an echo
  before (else the two cannot be told apart and no verdict is made about it);
* **no local explanation**: this node has a usable fabric NIC, its own loop ran at least every
  ``max_own_gap_ms`` over the last ``silent_after_ms`` (a stalled observer did not listen), and it still hears
  some other peer (a node that hears nobody is cut off itself);
* **a second observer**: where another daemon is heard, it is asked what it hears of the peer (``node_view``);
  its own recent heartbeat or echo reply from the peer vetoes the verdict (only this node lost the peer: a
  partition, LinkPass's and TorchPass's business), its silence confirms it. Where no other daemon exists (two
  nodes) this node decides alone.

Everything takes ``now`` (monotonic seconds) and, for the verdict's record, ``wall`` (time.time()) from the
caller, so the rules are unit-tested with a fake clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockwork.contracts.node_verdict import NodeVerdict

__all__ = ["Answer", "Judge", "Outcome", "PeerView", "Step", "outcome_of"]

#: At most this many other daemons are asked about one suspect, one after the other.
MAX_OBSERVERS = 3


class Outcome(enum.Enum):
    """What a second observer's view means for a suspect."""

    CONFIRMED = "confirmed"  # it does not hear the suspect either
    VETOED = "vetoed"  # it heard the suspect (or its kernel) recently: no verdict
    NO_ANSWER = "no_answer"  # no answer, or no usable view: ask again later


@dataclass(frozen=True)
class PeerView:
    """What one daemon hears of ``node`` (the ``node_view`` op's answer to another daemon)."""

    observer: str
    node: str
    heard_ms: float | None  # since its last heartbeat on any rail; None: never heard
    echo_ms: float | None  # since its kernel last answered an echo in its current silence; None: not once
    trusted: bool  # the observer's own evidence is sound (a usable NIC, its loop not stalled)
    why: str = ""  # why it is not

    def to_wire(self) -> dict[str, Any]:
        return {
            "observer": self.observer,
            "node": self.node,
            "heard_ms": self.heard_ms,
            "echo_ms": self.echo_ms,
            "trusted": self.trusted,
            "why": self.why,
        }

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> PeerView:
        def ms(value: Any) -> float | None:
            return None if value is None else float(value)

        return cls(
            str(doc["observer"]),
            str(doc["node"]),
            ms(doc["heard_ms"]),
            ms(doc["echo_ms"]),
            bool(doc["trusted"]),
            str(doc.get("why", "")),
        )


@dataclass(frozen=True)
class Answer:
    """The result of asking other daemons about ``node``: the first definite outcome, or NO_ANSWER."""

    node: str
    outcome: Outcome
    observer: str
    detail: str


def outcome_of(cfg: NodeWatchConfig, view: PeerView) -> tuple[Outcome, str]:
    """What ``view`` says about its node: it confirms silence only when it, too, heard nothing for half the
    verdict's silence (its ticks and ours are not in phase) and saw no echo answered within the echo window."""
    who = f"{view.observer} on {view.node}"
    if not view.trusted:
        return Outcome.NO_ANSWER, f"{who}: cannot judge ({view.why})"
    if view.heard_ms is None:
        return Outcome.NO_ANSWER, f"{who}: never heard it"
    if view.heard_ms < cfg.silent_after_ms / 2:
        return Outcome.VETOED, f"{who}: heard it {view.heard_ms:.0f} ms ago"
    window = cfg.silent_after_ms - cfg.probe_after_ms
    if view.echo_ms is not None and view.echo_ms < window:
        return Outcome.VETOED, f"{who}: its kernel answered an echo {view.echo_ms:.0f} ms ago"
    return Outcome.CONFIRMED, f"{who}: silent for {view.heard_ms:.0f} ms"


@dataclass
class _Episode:
    """One peer's current silence (from its last heartbeat) while it lasts."""

    since: float
    probing_since: float | None = None
    echo_reply: float | None = None  # the kernel's last answer during this silence
    kernel_counted: bool = False
    asking: bool = False
    next_ask: float = 0.0
    held: str = ""  # why no verdict yet, for status
    verdict: NodeVerdict | None = None


@dataclass
class Step:
    """What the node watch does after a tick."""

    echo: list[str] = field(default_factory=list)  # peers whose kernel is probed now (on every rail)
    ask: list[tuple[str, list[str]]] = field(default_factory=list)  # (suspect, other daemons to ask, in order)
    verdicts: list[NodeVerdict] = field(default_factory=list)  # decided alone (no other daemon exists)
    cleared: list[str] = field(default_factory=list)  # peers heard again after a verdict


class Judge:
    """The node watch's decisions for one node (``me``); see the module docstring for the rules."""

    def __init__(self, cfg: NodeWatchConfig, me: str, interval_s: float) -> None:
        self.cfg = cfg
        self.me = me
        self.interval = interval_s
        self.silent = cfg.silent_after_ms / 1000
        self.probe = cfg.probe_after_ms / 1000
        self.window = self.silent - self.probe
        self.max_gap = cfg.max_own_gap_ms / 1000
        self.episodes: dict[str, _Episode] = {}
        self.verdicts: dict[str, NodeVerdict] = {}  # active: node -> its verdict, until it is heard again
        self.seq = 0
        self.last_heard: dict[str, float] = {}
        # node -> the other nodes of the jobs it runs with here: asked first as second observers, since only they
        # heartbeat it (a daemon hears only its path peers and its own jobs' nodes, see linkpass.peers)
        self.mates: dict[str, set[str]] = {}
        self.nic_usable = False
        self.echo_ok: dict[str, float] = {}  # peer -> its kernel's last echo answer (ever)
        self.echo_checked: dict[str, float] = {}
        self._last_tick: float | None = None
        self._clean_since: float | None = None  # this node's own evidence sound since (usable NIC, loop running)
        self._last_fault = "the daemon just started"
        self.counters = {
            "suspected": 0,
            "kernel_answered": 0,
            "held_local": 0,
            "asked": 0,
            "confirmed": 0,
            "vetoed": 0,
            "no_answer": 0,
            "verdicts": 0,
            "cleared": 0,
        }

    # ----- evidence ----------------------------------------------------------------------------

    def echo_reply(self, peer: str, now: float) -> None:
        """``peer``'s kernel answered an echo (on any rail)."""
        self.echo_ok[peer] = now
        episode = self.episodes.get(peer)
        if episode is not None and episode.verdict is None:
            episode.echo_reply = now
            if not episode.kernel_counted:
                episode.kernel_counted = True
                self.counters["kernel_answered"] += 1

    def local_fault(self, now: float) -> str:
        """Why this node's own evidence cannot be trusted now ('' when it can): it needs a usable NIC and its own
        loop running, without a break, for a whole ``silent_after_ms`` (an observer that was cut off or stopped
        did not listen, whatever it missed)."""
        if not self.nic_usable:
            return "no usable fabric NIC on this node"
        if self._last_tick is not None and now - self._last_tick > self.max_gap:
            return f"this daemon's loop has not run for {1000 * (now - self._last_tick):.0f} ms"
        if self._clean_since is None or now - self._clean_since < self.silent:
            clean = 0.0 if self._clean_since is None else 1000 * (now - self._clean_since)
            return f"this node listened cleanly for {clean:.0f} ms only (before: {self._last_fault})"
        return ""

    def _note_own_health(self, now: float, nic_usable: bool) -> None:
        fault = ""
        if not nic_usable:
            fault = "no usable fabric NIC on this node"
        elif self._last_tick is not None and now - self._last_tick > self.max_gap:
            fault = f"this daemon's loop stalled {1000 * (now - self._last_tick):.0f} ms"
        if fault:
            self._last_fault = fault
            self._clean_since = now if nic_usable else None  # a stall is over once the loop runs again
        elif self._clean_since is None:
            self._clean_since = now
        self._last_tick = now
        self.nic_usable = nic_usable

    def view(self, node: str, now: float) -> PeerView:
        """What this node hears of ``node`` (answered to another daemon that suspects it)."""
        heard = self.last_heard.get(node)
        episode = self.episodes.get(node)
        echo = episode.echo_reply if episode is not None else None
        fault = self.local_fault(now)
        return PeerView(
            self.me,
            node,
            None if heard is None else round(1000 * (now - heard), 1),
            None if echo is None else round(1000 * (now - echo), 1),
            not fault,
            fault,
        )

    # ----- the tick ---------------------------------------------------------------------------

    def tick(self, now: float, wall: float, last_heard: Mapping[str, float], nic_usable: bool) -> Step:
        """Judge every peer ever heard (``last_heard``: peer -> its last heartbeat on any rail, monotonic)."""
        self._note_own_health(now, nic_usable)
        self.last_heard = dict(last_heard)
        step = Step()
        fault = self.local_fault(now)
        for peer, heard in sorted(last_heard.items()):
            silence = now - heard
            episode = self.episodes.get(peer)
            if silence < self.probe:
                if episode is not None:
                    del self.episodes[peer]
                    if self.verdicts.pop(peer, None) is not None:
                        self.counters["cleared"] += 1
                        step.cleared.append(peer)
                if now - self.echo_checked.get(peer, -1e18) >= self.cfg.echo_check_s:
                    self.echo_checked[peer] = now
                    step.echo.append(peer)  # does its kernel answer echo at all?
                continue
            if episode is None or (episode.since != heard and episode.verdict is None):
                episode = self.episodes[peer] = _Episode(since=heard)
                self.counters["suspected"] += 1
            if episode.verdict is not None:
                continue
            step.echo.append(peer)
            if episode.probing_since is None:
                episode.probing_since = now
            if silence < self.silent:
                episode.held = "silent, not long enough yet"
                continue
            episode.held = self._hold(peer, episode, now, fault)
            if episode.held:
                continue
            others = [p for p in last_heard if p != peer and p not in self.verdicts]
            mates = self.mates.get(peer, set())
            fresh = sorted(
                (p for p in others if now - last_heard[p] < self.silent / 2), key=lambda p: (p not in mates, p)
            )
            if not others:
                step.verdicts.append(self._decide(peer, episode, now, wall, ()))
            elif not fresh:
                episode.held = "no other peer heard either: this node is cut off"
                self.counters["held_local"] += 1
            elif not episode.asking and now >= episode.next_ask:
                episode.asking = True
                episode.held = f"asking {', '.join(fresh[:MAX_OBSERVERS])}"
                self.counters["asked"] += 1
                step.ask.append((peer, fresh[:MAX_OBSERVERS]))
        return step

    def _hold(self, peer: str, episode: _Episode, now: float, fault: str) -> str:
        """Why ``peer``'s silence is not (yet) a verdict, apart from asking a second observer ('' when none)."""
        if fault:
            self.counters["held_local"] += 1
            return fault
        if episode.echo_reply is not None and now - episode.echo_reply < self.window:
            return f"its kernel answered an echo {1000 * (now - episode.echo_reply):.0f} ms ago (starved, not dead)"
        if episode.probing_since is None or now - episode.probing_since < self.window:
            return "its kernel not probed long enough yet"
        last_ok = self.echo_ok.get(peer)
        if last_ok is None or now - last_ok > 3 * self.cfg.echo_check_s + self.silent:
            return "its kernel never answered an ICMP echo: a starved node cannot be told from a dead one"
        return ""

    def answer(self, answer: Answer, now: float, wall: float) -> NodeVerdict | None:
        """Another daemon's view of a suspect arrived: the verdict, when it confirms and the silence goes on."""
        episode = self.episodes.get(answer.node)
        if episode is None or episode.verdict is not None or not episode.asking:
            return None
        episode.asking = False
        if answer.outcome is Outcome.CONFIRMED:
            self.counters["confirmed"] += 1
            return self._decide(answer.node, episode, now, wall, (answer.observer,))
        if answer.outcome is Outcome.VETOED:
            self.counters["vetoed"] += 1
            episode.next_ask = now + self.silent
        else:
            self.counters["no_answer"] += 1
            episode.next_ask = now + self.cfg.confirm_timeout_ms / 1000
        episode.held = answer.detail
        return None

    def _decide(self, peer: str, episode: _Episode, now: float, wall: float, by: tuple[str, ...]) -> NodeVerdict:
        self.seq += 1
        self.counters["verdicts"] += 1
        silent_ms = round(1000 * (now - episode.since), 1)
        rails = "every rail"
        confirmed = f", confirmed by {', '.join(by)}" if by else " (no other daemon to ask)"
        verdict = NodeVerdict(
            seq=self.seq,
            node=peer,
            last_heard=wall - (now - episode.since),
            silent_ms=silent_ms,
            confirmed_by=by,
            reason=(
                f"node {peer} silent on {rails} for {silent_ms:.0f} ms and its kernel silent to ICMP echo "
                f"(seen by {self.me}{confirmed})"
            ),
        )
        episode.verdict = verdict
        episode.held = ""
        self.verdicts[peer] = verdict
        return verdict

    # ----- reporting --------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        return {
            "local_fault": self.local_fault(now),
            "suspects": {
                peer: {
                    "silent_ms": round(1000 * (now - e.since), 1),
                    "kernel_answered_ms": None if e.echo_reply is None else round(1000 * (now - e.echo_reply), 1),
                    "state": "verdict" if e.verdict is not None else (e.held or "watching"),
                }
                for peer, e in sorted(self.episodes.items())
            },
            "in_force": [v.to_wire() for v in sorted(self.verdicts.values(), key=lambda v: v.seq)],
            "echo_answered": sorted(self.echo_ok),
            **self.counters,
        }
