"""The GPU health watch's configuration: the ``[health]`` section of clockwork.toml (one documented dataclass).

The list-valued settings (XID numbers, per-signal action overrides) are strings in TOML like the other
comma-separated settings of the schema; they are parsed and checked here, when the section is built, so a bad
value fails the configuration with a message naming the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting
from clockwork.contracts.config.health_signals import SIGNALS
from clockwork.contracts.errors import ConfigError

#: What the policy may do about a signal; each action includes the ones before it.
ACTIONS = ("record", "warn", "drain", "migrate")


def parse_xids(key: str, text: str) -> frozenset[int]:
    """``"48, 79"`` -> {48, 79}; ConfigError naming ``[health] key`` and the bad item."""
    out = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or not 0 < int(item) < 1_000_000:
            raise ConfigError(f"[health] {key}: invalid XID {item!r} in {text!r} (expected comma-separated numbers)")
        out.add(int(item))
    return frozenset(out)


def parse_actions(text: str, known: tuple[str, ...]) -> dict[str, str]:
    """``"throttle.hw_slowdown=migrate, xid.31=warn"`` -> {signal: action}; ConfigError naming a bad item.

    ``known`` are the signal names of the catalogue; ``xid.N`` names any XID."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, eq, action = (p.strip() for p in item.partition("="))
        if not eq or not name:
            raise ConfigError(
                f"[health] actions: invalid item {item!r} (expected SIGNAL=ACTION, e.g. ecc.corrected=warn)"
            )
        xid = name.startswith("xid.") and name[4:].isdigit()
        if name not in known and not xid:
            raise ConfigError(
                f"[health] actions: unknown signal {name!r} in {item!r} (known: {', '.join(known)}, xid.N)"
            )
        if action not in ACTIONS:
            raise ConfigError(
                f"[health] actions: invalid action {action!r} for {name} (expected one of {', '.join(ACTIONS)})"
            )
        out[name] = action
    return out


@dataclass(frozen=True)
class HealthConfig:
    """GPU health watch in the node daemon: NVML readings, the policy's thresholds, proactive migration."""

    enabled: bool = setting(True, "Watch the node's GPUs inside the node daemon (a node without GPUs reports none).")
    source: str = setting(
        "nvml",
        "Where readings come from: 'nvml' (the driver, through nvidia-ml-py) or 'fault-file' (injected values "
        "from fault_file: tests and the sandbox only). Chosen by the daemon's own configuration, never by a job.",
        choices=("nvml", "fault-file"),
    )
    fault_file: str = setting(
        "",
        "TESTS ONLY: the JSON file of injected GPU values read when source = 'fault-file' ('{node}' is replaced "
        "by the node name; written by `clockwork sandbox fault gpu`). It must be owned by root or the daemon's "
        "user and not writable by others, or it is ignored.",
    )
    emulated_gpus: int = setting(1, "Number of GPUs the fault-file source presents (gpu0..gpuN-1).", min=1)
    interval_s: float = setting(1.0, "Seconds between two readings of every GPU.", min=0.05)
    raise_after: int = setting(
        2,
        "Readings in a row a level signal (temperature, throttling, NVLink errors) must be seen before it is "
        "raised: one hot sample does not move a rank. Counters and XID events are raised at once.",
        min=1,
    )
    clear_after: int = setting(3, "Readings in a row a raised level signal must be absent before it clears.", min=1)
    temp_warn_margin_c: float = setting(
        5.0, "Warn the job when a GPU is within this many degrees C of its own slowdown threshold.", min=0.0
    )
    temp_migrate_margin_c: float = setting(
        0.0,
        "Migrate the ranks of a GPU this many degrees C below its slowdown threshold (0 = at the threshold); "
        "at its shutdown threshold the node is drained as well.",
        min=0.0,
    )
    temp_hysteresis_c: float = setting(
        3.0,
        "A temperature signal clears only once the GPU is this many degrees C below the signal's threshold.",
        min=0.0,
    )
    ecc_corrected_warn: int = setting(
        100, "Volatile corrected ECC errors (since the last driver load) at which the job is warned.", min=1
    )
    nvlink_errors_warn: int = setting(
        100,
        "NVLink errors (CRC, replay and recovery, summed over the GPU's links) between two readings at which the "
        "job is warned.",
        min=1,
    )
    xid_migrate: str = setting(
        "48,64,74,79,94,95,119,120,140",
        "Critical XIDs that migrate the GPU's ranks at once and drain the node after the job leaves "
        "(48 double-bit ECC, 64 row remap failure, 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained "
        "ECC, 119/120 GSP, 140 unrecovered ECC).",
    )
    xid_warn: str = setting(
        "63,92", "XIDs that warn the job (63 row remapping pending, 92 high single-bit ECC rate); others are recorded."
    )
    xid_node: str = setting(
        "",
        "XIDs that are faults of the whole node, not of the GPU that reports them (e.g. the XIDs your GPUs raise "
        "for an NVSwitch or fabric-manager failure): every rank of the node moves together to one spare node, "
        "as `clockwork migrate --ranks-on` moves them. They also migrate (listed in xid_migrate or not).",
    )
    node_window_s: float = setting(
        10.0,
        "Every GPU of the node (2 or more) raising a migrate-level signal within this many seconds of each other is "
        "one node-level fault: the node's ranks move together instead of one GPU's at a time.",
        min=0.0,
    )
    nic_down_move_s: float = setting(
        0.0,
        "Seconds a fabric NIC of the node may stay down (LinkPass carries its traffic on the other rails) before "
        "the node's ranks move together to a spare node; 0 = never (a dead NIC is LinkPass's to ride out).",
        min=0.0,
    )
    hca_down_move_s: float = setting(
        1.0,
        "Seconds an HCA of the node (the RDMA device behind a fabric NIC LinkPass avoids: down, no live path, a Fleet "
        "Lens suspect) may stay unusable before the node's ranks move together, at their next step, into new "
        "processes whose NCCL_IB_HCA excludes it (NCCL's RDMA traffic does not follow LinkPass's routes); "
        "0 = never. A NIC without an HCA (no /sys/class/net/NIC/device/infiniband) never counts.",
        min=0.0,
    )
    xid_hold_s: float = setting(
        3600.0,
        "Seconds an XID signal stays raised after the last such XID (an event has no level to fall back from): "
        "the node stays drained that long unless the GPU's counters still show the fault.",
        min=0.0,
    )
    actions: str = setting(
        "",
        "Per-signal action overrides, 'SIGNAL=ACTION,...' (actions record, warn, drain, migrate; signals as "
        "`clockwork node gpus` names them, xid.N for one XID), e.g. 'throttle.hw_slowdown=migrate'.",
    )
    migrate_timeout_s: float = setting(
        5.0, "Seconds to wait for each coordinator replica when asking it to migrate a rank.", min=0.1
    )
    migrate_retry_s: float = setting(
        10.0,
        "Seconds before a refused or unanswered migration request is repeated (while the signal is still raised).",
        min=0.1,
    )
    node_move_wait_s: float = setting(
        60.0,
        "A whole-node move asks for one rank at a time: seconds to wait for each rank's move to complete (the "
        "coordinator says 'not now' until then) before the move counts as failed and is asked again.",
        min=0.1,
    )
    drain: bool = setting(
        True,
        "Let the health check drain the node (reason 'clockwork: gpuN ...') while a drain- or migrate-level signal "
        "is raised and no job's rank is left on that GPU; false: signals are only recorded, warned and migrated.",
    )
    history: int = setting(20, "Signal changes kept per GPU for `clockwork node gpus`.", min=1)

    def __post_init__(self) -> None:
        parse_xids("xid_migrate", self.xid_migrate)
        parse_xids("xid_warn", self.xid_warn)
        parse_xids("xid_node", self.xid_node)
        parse_actions(self.actions, tuple(SIGNALS))
        if self.source == "fault-file" and not self.fault_file:
            raise ConfigError("[health] fault_file: empty, but source = 'fault-file' needs the file to read")
