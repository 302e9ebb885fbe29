"""Fleet Audit's configuration: the ``[audit]`` section of clockwork.toml (one documented dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting


@dataclass(frozen=True)
class AuditConfig:
    """Fleet Audit (`clockwork audit`): what is measured on every node and link, and where pass ends."""

    probe_count: int = setting(300, "UDP probes sent on every same-rail NIC pair for loss and round trip.", min=10)
    probe_interval_ms: float = setting(2.0, "Interval between two probes of one NIC pair, milliseconds.", min=0.1)
    max_loss_pct: float = setting(
        0.5, "A link direction whose typical path loses more than this share of probes fails, percent.", min=0.0
    )
    mtu: int = setting(
        0,
        "MTU every fabric NIC and every path must carry, bytes; 0 = the MTU most NICs of the rail have.",
        min=0,
    )
    mtu_probes: int = setting(3, "Full-size frames (don't-fragment) sent per NIC pair to check the path MTU.", min=1)
    bandwidth_s: float = setting(0.5, "Length of each link's bulk TCP transfer, seconds.", min=0.05)
    min_bandwidth_fraction: float = setting(
        0.25,
        "A link direction whose typical transfer reaches less than this fraction of its rail's median fails.",
        min=0.0,
    )
    min_bandwidth_gbps: float = setting(
        0.0, "Absolute floor for every link direction, Gbit/s (0 = only the comparison with the rail).", min=0.0
    )
    all_pairs_max_nodes: int = setting(
        8,
        "Up to this many nodes every ordered NIC pair gets a transfer; above it, each NIC sends to its two ring "
        "neighbours (every link still carries two transfers each way).",
        min=2,
    )
    drill: bool = setting(True, "Run a LinkPass drill on every NIC: take it down, time the failover, bring it back.")
    max_failover_ms: float = setting(1000.0, "A drill whose traffic took longer than this to move fails, ms.", min=1.0)
    drill_timeout_s: float = setting(
        5.0,
        "How long a drill waits for the failover and for the fail-back, seconds (a fail-back LinkPass still "
        "holds down, as it damps flaps, passes).",
        min=0.5,
    )
    max_clock_uncertainty_us: float = setting(
        100.0, "A node whose Fleet Lens clock offset is less certain than this fails the clock check, µs.", min=0.0
    )
    worker_start_timeout_s: float = setting(
        120.0, "How long the audit waits for every node's worker to start (srun included), seconds.", min=1.0
    )
    step_timeout_s: float = setting(60.0, "How long one measurement on one node may take, seconds.", min=1.0)
