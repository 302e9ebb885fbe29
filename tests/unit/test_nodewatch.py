"""The node watch's rules (pure, fake clock) and its wire pieces: when a silent peer is a dead node, and when not."""

from __future__ import annotations

import pytest

from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockwork.contracts.errors import ConfigError
from clockwork.contracts.node_verdict import NodeVerdict, VerdictFormatError
from clockworkd.nodewatch.echo import checksum, echo_request, parse_echo_reply
from clockworkd.nodewatch.judge import Answer, Judge, Outcome, PeerView, outcome_of

TICK = 0.01
CFG = NodeWatchConfig()  # silent after 100 ms, kernel probed from 30 ms
WALL0 = 1_000_000.0


class Fabric:
    """A fake fabric seen from node1: when each peer was last heard, and whose kernel answers."""

    def __init__(self, peers: tuple[str, ...] = ("node2", "node3")) -> None:
        self.now = 100.0
        self.judge = Judge(CFG, "node1", TICK)
        self.heard = {p: self.now for p in peers}
        self.alive_kernels = set(peers)
        self.nic_usable = True
        self.asked: list[tuple[str, list[str]]] = []
        self.verdicts: list[NodeVerdict] = []
        self.silent: set[str] = set()  # daemons that stopped sending heartbeats

    def run(self, seconds: float, stall_at: float | None = None, stall_s: float = 0.0) -> None:
        """Tick for ``seconds``: live daemons heard every tick, echoes answered by live kernels."""
        end = self.now + seconds
        stalled = False
        while self.now < end:
            self.now += TICK
            if stall_at is not None and not stalled and self.now >= stall_at:
                stalled = True
                self.now += stall_s  # this daemon's loop did not run meanwhile
            for peer in self.heard:
                if peer not in self.silent:
                    self.heard[peer] = self.now
            step = self.judge.tick(self.now, WALL0 + self.now, self.heard, self.nic_usable)
            for peer in step.echo:
                if peer in self.alive_kernels:
                    self.judge.echo_reply(peer, self.now + 0.0001)
            self.asked += step.ask
            self.verdicts += step.verdicts


def test_a_dead_node_is_suspected_probed_and_a_second_observer_asked() -> None:
    fabric = Fabric()
    fabric.run(1.0)  # the kernels answered the first echo check
    fabric.silent.add("node2")
    fabric.alive_kernels.discard("node2")
    fabric.run(0.2)
    assert fabric.asked == [("node2", ["node3"])], "asked exactly once, the only other daemon"
    assert not fabric.verdicts
    view = PeerView("node3", "node2", heard_ms=120.0, echo_ms=None, trusted=True)
    outcome, detail = outcome_of(CFG, view)
    assert outcome is Outcome.CONFIRMED, detail
    verdict = fabric.judge.answer(Answer("node2", outcome, "node3", detail), fabric.now, WALL0 + fabric.now)
    assert verdict is not None and verdict.node == "node2" and verdict.confirmed_by == ("node3",)
    assert verdict.silent_ms >= CFG.silent_after_ms
    assert "silent on every rail" in verdict.reason
    assert fabric.judge.counters["verdicts"] == 1
    # heard again: the verdict is withdrawn
    fabric.silent.clear()
    fabric.run(0.05)
    assert not fabric.judge.verdicts and fabric.judge.counters["cleared"] == 1


def test_a_stopped_node_whose_kernel_answers_is_never_judged() -> None:
    fabric = Fabric()
    fabric.run(1.0)
    fabric.silent.add("node2")  # daemon and processes SIGSTOPped: the kernel still answers
    fabric.run(1.0)
    assert not fabric.asked and not fabric.verdicts
    assert fabric.judge.counters["suspected"] == 1 and fabric.judge.counters["kernel_answered"] == 1
    assert "kernel answered" in fabric.judge.status(fabric.now)["suspects"]["node2"]["state"]


def test_a_peer_whose_kernel_never_answered_echo_is_never_judged() -> None:
    fabric = Fabric()
    fabric.alive_kernels.discard("node2")  # echo filtered on that node: starved and dead look the same
    fabric.run(1.0)
    fabric.silent.add("node2")
    fabric.run(1.0)
    assert not fabric.asked and not fabric.verdicts
    assert "never answered" in fabric.judge.status(fabric.now)["suspects"]["node2"]["state"]


def test_no_verdict_while_this_node_has_no_usable_nic_or_hears_nobody() -> None:
    fabric = Fabric()
    fabric.run(1.0)
    fabric.nic_usable = False
    fabric.silent.add("node2")
    fabric.alive_kernels.discard("node2")
    fabric.run(0.5)
    assert not fabric.asked
    fabric.nic_usable = True
    fabric.silent.add("node3")  # everybody silent at once: this node is cut off
    fabric.alive_kernels.discard("node3")
    fabric.run(0.5)
    assert not fabric.asked and not fabric.verdicts
    assert "cut off" in fabric.judge.status(fabric.now)["suspects"]["node2"]["state"]


def test_a_stall_of_this_daemon_postpones_the_verdict_by_a_clean_window() -> None:
    fabric = Fabric()
    fabric.run(1.0)
    fabric.silent.add("node2")
    fabric.alive_kernels.discard("node2")
    stall_at = fabric.now + 0.02
    fabric.run(0.06, stall_at=stall_at, stall_s=1.0)  # this daemon stopped for 1 s right after the silence began
    assert not fabric.asked, "judged right after its own stall"
    assert "stalled" in fabric.judge.local_fault(fabric.now)
    fabric.run(CFG.silent_after_ms / 1000 + 0.02)
    assert [suspect for suspect, _ in fabric.asked] == ["node2"], "asked once it listened for a clean window"


def test_a_two_node_fabric_decides_alone() -> None:
    fabric = Fabric(peers=("node2",))
    fabric.run(1.0)
    fabric.silent.add("node2")
    fabric.alive_kernels.discard("node2")
    fabric.run(0.2)
    assert not fabric.asked
    assert [v.node for v in fabric.verdicts] == ["node2"] and fabric.verdicts[0].confirmed_by == ()


def test_a_veto_holds_the_verdict_and_the_question_is_asked_again_later() -> None:
    fabric = Fabric()
    fabric.run(1.0)
    fabric.silent.add("node2")
    fabric.alive_kernels.discard("node2")
    fabric.run(0.12)
    assert len(fabric.asked) == 1
    heard = PeerView("node3", "node2", heard_ms=5.0, echo_ms=None, trusted=True)
    outcome, detail = outcome_of(CFG, heard)
    assert outcome is Outcome.VETOED
    assert fabric.judge.answer(Answer("node2", outcome, "node3", detail), fabric.now, WALL0) is None
    fabric.run(CFG.silent_after_ms / 1000 / 2)
    assert len(fabric.asked) == 1, "asked again before the veto's window passed"
    fabric.run(CFG.silent_after_ms / 1000)
    assert len(fabric.asked) == 2


@pytest.mark.parametrize(
    ("view", "outcome"),
    [
        (PeerView("o", "n", heard_ms=200.0, echo_ms=None, trusted=True), Outcome.CONFIRMED),
        (PeerView("o", "n", heard_ms=200.0, echo_ms=300.0, trusted=True), Outcome.CONFIRMED),
        (PeerView("o", "n", heard_ms=10.0, echo_ms=None, trusted=True), Outcome.VETOED),
        (PeerView("o", "n", heard_ms=200.0, echo_ms=5.0, trusted=True), Outcome.VETOED),
        (PeerView("o", "n", heard_ms=200.0, echo_ms=None, trusted=False, why="stalled"), Outcome.NO_ANSWER),
        (PeerView("o", "n", heard_ms=None, echo_ms=None, trusted=True), Outcome.NO_ANSWER),
    ],
)
def test_what_a_second_observers_view_means(view: PeerView, outcome: Outcome) -> None:
    assert outcome_of(CFG, view)[0] is outcome
    assert PeerView.from_wire(view.to_wire()) == view


def test_probe_after_must_be_below_silent_after() -> None:
    with pytest.raises(ConfigError, match="probe_after_ms"):
        NodeWatchConfig(silent_after_ms=50, probe_after_ms=50)


def test_echo_request_and_reply() -> None:
    request = echo_request(0x1234, 7)
    assert checksum(request) == 0, "a packet with its checksum sums to zero"
    ip_header = bytes([0x45]) + bytes(19)
    reply = bytes([0]) + request[1:]  # type 0: what the peer's kernel sends back
    assert parse_echo_reply(ip_header + reply, 0x1234)
    assert not parse_echo_reply(ip_header + reply, 0x4321)
    assert not parse_echo_reply(ip_header + request, 0x1234), "an echo request is not an answer"
    assert not parse_echo_reply(ip_header[:10], 0x1234)


def test_verdict_wire_format() -> None:
    verdict = NodeVerdict(3, "node2", 1.5e9, 112.0, ("node3",), "node node2 silent on every rail")
    assert NodeVerdict.from_wire(verdict.to_wire()) == verdict
    for broken in ({**verdict.to_wire(), "seq": 0}, {**verdict.to_wire(), "silent_ms": "x"}, [], {"seq": 1}):
        with pytest.raises(VerdictFormatError):
            NodeVerdict.from_wire(broken)
