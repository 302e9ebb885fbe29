"""The value types of Fleet Lens: names of NICs and links, path statistics, verdicts and suspects.

Naming is plain text so that events, metrics and the CLI all show the same strings:

- a NIC is ``"NODE/NIC"`` (``"node3/nic1"``);
- a *directed* link is ``"A>B"`` where each end is a NIC or a switch name: ``"node3/nic1>rail1"`` is
  node3's nic1 sending into its switch port (uplink), ``"rail1>node3/nic1"`` the switch sending to
  it (downlink), ``"leaf0>spine1"`` a link between switches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

NicId = str
LinkId = str

UPLINK = "uplink"  # NIC -> switch port (the node's transmit side)
DOWNLINK = "downlink"  # switch port -> NIC (the node's receive side)
BOTH = "both"
INTER_SWITCH = "inter-switch"


def nic_id(node: str, nic: str) -> NicId:
    return f"{node}/{nic}"


def split_nic(nic: NicId) -> tuple[str, str]:
    node, _, name = nic.partition("/")
    return node, name


def link_id(src: str, dst: str) -> LinkId:
    return f"{src}>{dst}"


def split_link(link: LinkId) -> tuple[str, str]:
    src, _, dst = link.partition(">")
    return src, dst


@dataclass(frozen=True)
class PathStats:
    """One directed NIC pair over the last window, as its receiver measured it.

    One-way delays are corrected by the clock offset between the two nodes when one is known
    (``owd_*`` None otherwise); ``loss`` is the share of the sender's probes in the window that
    never arrived.
    """

    src: NicId
    dst: NicId
    window_s: float
    sent: int
    received: int
    loss: float
    owd_min_us: float | None = None
    owd_p50_us: float | None = None
    owd_p99_us: float | None = None
    jitter_us: float | None = None  # mean absolute difference of consecutive one-way delays
    rate_mbps: float | None = None  # from the last probe train's dispersion, when trains run
    rtt_min_us: float | None = None  # round trip from echoes (no clock sync needed): min and median
    rtt_p50_us: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)  # flat: a copy of the fields (asdict's deep copy costs 10x)


@dataclass(frozen=True)
class PathVerdict:
    """Whether one directed path is healthy now, against its own baseline, and why not."""

    src: NicId
    dst: NicId
    bad: bool
    reasons: tuple[str, ...] = ()  # e.g. ("loss 3.1% (baseline 0.0%)",)
    kinds: tuple[str, ...] = ()  # subset of: loss, delay, jitter, rate, dead
    score: float = 0.0  # 0 healthy .. 1 dead; how far outside its baseline the path is

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "reasons": list(self.reasons), "kinds": list(self.kinds)}


@dataclass(frozen=True)
class Suspect:
    """One link (or switch port) that the bad paths point to."""

    link: str  # physical link, e.g. "node3/nic1 <-> rail1" or "leaf0 <-> spine1"
    links: tuple[LinkId, ...]  # the directed links found faulty (one, or both directions)
    switch: str  # the switch whose port is involved (the upper end for inter-switch links)
    port: str  # that switch's port name
    nic: NicId | None  # the node NIC on the link, None for inter-switch links
    direction: str  # UPLINK, DOWNLINK, BOTH or INTER_SWITCH
    kinds: tuple[str, ...]  # what is wrong: loss, delay, jitter, rate, dead
    confidence: float  # 0..1
    evidence: dict[str, Any] = field(default_factory=dict)  # bad/good path counts, example paths

    @property
    def key(self) -> str:
        """Identity of a suspect across evaluations (raise once, clear once)."""
        return self.link

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["links"] = list(self.links)
        d["kinds"] = list(self.kinds)
        return d
