"""Fleet Lens's configuration: the ``[lens]`` section of clockwork.toml (one documented dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting


@dataclass(frozen=True)
class LensConfig:
    """Fleet Lens: NIC-pair probing, clock sync, one-way delays, gray-failure localization."""

    enabled: bool = setting(True, "Run Fleet Lens inside the node daemon.")
    port: int = setting(16902, "UDP port of the probes, bound on every fabric NIC address.", min=1)
    interval_ms: float = setting(10.0, "Probe interval from every NIC to each of its peer NICs, milliseconds.", min=1.0)
    peers_per_nic: int = setting(
        16,
        "Peer NICs each NIC probes on a large cluster (all same-rail peers when there are no more than this); "
        "chosen so every link lies on two probed paths that differ elsewhere.",
        min=1,
    )
    probe_budget_per_s: float = setting(
        4000.0,
        "Probes a second one node may send, all its NICs together (0 = no budget). Over it, each NIC probes fewer "
        "peers (down to 2, what singling out a link needs) and then less often than interval_ms; every link stays "
        "covered. The same on every node: the busiest node sets the pace.",
        min=0.0,
    )
    topology_file: str = setting(
        "",
        'Topology (JSON or TOML): {"nics": {"NODE/NIC": {"switch": S, "port": P}}, "links": [[LEAF, SPINE]]}; '
        "NICs it does not name hang on one switch per rail. Empty = inferred per rail from LinkPass's fabric map.",
    )
    pair_every: int = setting(
        1,
        "Every Nth tick, one probe of each NIC (to the next peer in turn) is a coded pair (two back to back); "
        "pairs whose receive spacing matches their send spacing were not queued and feed the clock sync. "
        "0 = no pairs (no clock sync).",
        min=0,
    )
    window_s: float = setting(
        2.0, "Sliding window of the path statistics (loss, one-way delay percentiles, jitter), seconds.", min=0.2
    )
    evaluate_ms: float = setting(500.0, "How often paths are judged and the suspects recomputed, milliseconds.", min=10)
    summary_ms: float = setting(
        1000.0,
        "How often each daemon tells the others what it measured (verdicts, delay envelopes), ms; a path that "
        "turns bad, changes or heals is told at once, at the evaluation that finds it.",
        min=10,
    )
    loss_min_lost: int = setting(
        2, "A path is lossy when at least this many probes of the window were lost (and above its baseline).", min=1
    )
    delay_rise_us: float = setting(
        500.0, "A path is slow when its median one-way delay rose this much above its baseline, microseconds.", min=1
    )
    jitter_rise_us: float = setting(
        300.0, "A path is jittery when its jitter rose this much above its baseline, microseconds.", min=1
    )
    train_interval_ms: float = setting(
        250.0,
        "Each NIC sends a probe train (train_bytes back to back) to its next peer this often; the receive "
        "dispersion gives the path's rate, which reveals a degraded (rate-limited) link (two slow trains in a "
        "row make a path slow). 0 = no trains.",
        min=0,
    )
    train_bytes: int = setting(65536, "Bytes in one probe train (packets of 1400 bytes).", min=2800)
    rate_drop: float = setting(
        0.1, "A path is rate-limited when its train rate falls below this share of its baseline.", min=0.0
    )
    raise_after: int = setting(2, "Evaluations in a row a suspect must be found before it is raised.", min=1)
    clear_after: int = setting(3, "Evaluations in a row a suspect must be absent before it is cleared.", min=1)
    clock_floor_us: float = setting(
        4.0,
        "Added (in quadrature) to every reported clock uncertainty: what software timestamps leave that no fit "
        "can see (send-path delays that differ between nodes). Measured on the sandbox by bench/clocksync.py.",
        min=0.0,
    )
    reference_node: str = setting("", "The cluster's reference clock; empty = the first node name in sort order.")
    linkpass_handoff: bool = setting(
        True, "Hand suspect NIC paths to LinkPass as gray failures (traffic moves off them until they clear)."
    )
    drain_suspect_nodes: bool = setting(
        False,
        "Let the health check drain a node whose own NIC link is a suspect (reason 'clockwork: lens ...'); when "
        "false, Lens only reports.",
    )
    metrics_port: int = setting(
        9464, "Port of the daemon's Prometheus /metrics endpoint (bound on metrics_addr); 0 = no endpoint.", min=0
    )
    metrics_addr: str = setting("127.0.0.1", "Address the Prometheus endpoint binds to.")
    history_file: str = setting(
        "{state_dir}/lens-history.h5",
        "Per-minute HDF5 history for post-mortems; '{state_dir}' is the daemon's state folder. Empty = none.",
    )
    history_max_mb: float = setting(64.0, "Size at which the history file rotates (one older file is kept).", min=0.1)
    clock_seam_file: str = setting(
        "",
        "TESTS ONLY: JSON of synthetic per-node clock offsets and drifts applied to this daemon's timestamps, "
        "for emulated nodes that share one real clock. Empty = the real clock.",
    )
