"""LinkPass's configuration: the ``[linkpass]`` section of clockwork.toml.

Defined here, not in clockworkd, because linkpass must not import clockworkd (dependency direction
linkpass <- clockworkd); clockworkd's schema includes this dataclass as one of its sections. Field
metadata follows the schema's convention: ``doc`` always, ``min``/``choices`` where they apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkPassConfig:
    """LinkPass: moves a dead or gray NIC's traffic to the node's other NICs, and back."""

    enabled: bool = field(default=True, metadata={"doc": "Run LinkPass inside the node daemon."})
    fabric_file: str = field(
        default="/etc/clockwork/fabric.json",
        metadata={
            "doc": 'JSON map of the fabric: {"nodes": {NAME: {"addr": NODE_ADDRESS, "nics": {NIC: ADDRESS}}}}. '
            "NIC names are rails: a node's nic0 talks to its peers' nic0. Missing file: LinkPass stays off "
            "and says why in `clockwork node status`."
        },
    )
    heartbeat_port: int = field(
        default=16901, metadata={"doc": "UDP port of the per-rail heartbeats (bound on each NIC address).", "min": 1}
    )
    heartbeat_ms: int = field(
        default=10,
        metadata={
            "doc": "Heartbeat interval, milliseconds: to each path peer on every rail, to each other node of the "
            "jobs running here on one rail in turn.",
            "min": 1,
        },
    )
    ring_neighbours: int = field(
        default=1,
        metadata={
            "doc": "Path peers on each side of this node in the fabric map's order (its rail neighbours: list nodes "
            "in rack order), heartbeated on every rail.",
            "min": 0,
        },
    )
    random_peers: int = field(
        default=2,
        metadata={
            "doc": "More path peers at pseudo-random ring offsets from the fabric map's fingerprint (the same on "
            "both ends), heartbeated on every rail. A node has at most 2 x (ring_neighbours + ceil(random_peers / "
            "2)) path peers whatever the fabric's size; enough to cover every node means all to all.",
            "min": 0,
        },
    )
    dead_after_ms: int = field(
        default=50,
        metadata={
            "doc": "A path (peer, rail) is dead after this long without a heartbeat from the peer, or without the "
            "peer saying it hears us (a one-way failure), milliseconds.",
            "min": 2,
        },
    )
    holddown_s: float = field(
        default=1.0,
        metadata={"doc": "A recovered path must stay healthy this long before traffic fails back.", "min": 0.0},
    )
    holddown_max_s: float = field(
        default=30.0,
        metadata={
            "doc": "Cap of the hold-down, which doubles each time a path fails again within a minute.",
            "min": 0.0,
        },
    )
    apply_sysctls: bool = field(
        default=True,
        metadata={"doc": "Set the sysctls failover depends on (below) when the daemon starts; off = leave them."},
    )
    sysctls: str = field(
        default="net.ipv4.conf.all.rp_filter=2,net.ipv4.conf.all.arp_ignore=1,net.ipv4.conf.all.arp_announce=2",
        metadata={
            "doc": "Comma-separated KEY=VALUE sysctls: loose reverse-path filtering (replies may arrive on another "
            "rail) and strict ARP (no NIC answers for another's address). Add net.ipv4.tcp_rto_min_us=20000 to "
            "shorten TCP's first retransmission after a failover where the kernel has it."
        },
    )
