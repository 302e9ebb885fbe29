"""The GPU health policy: readings -> raised and cleared signals, each with its action, with hysteresis.

Three kinds of signal:

* level signals (temperature tiers, throttling, NVLink error rate) are raised after ``raise_after`` readings in
  a row and cleared after ``clear_after`` readings without them; a temperature tier stays present until the GPU
  is ``temp_hysteresis_c`` below its threshold, so a GPU hovering at a threshold does not flap, and only the
  highest temperature tier is present at a time;
* state signals (ECC counts, pending rows, recovery action, lost GPU) are raised at the first reading that
  shows them (a counter that moved is a fact, not noise) and cleared after ``clear_after`` readings without;
* XID events (``xid.N``) are raised at once and cleared ``xid_hold_s`` after the last such XID.

Most faults are one GPU's: the watch moves that GPU's rank. :meth:`Policy.node_fault` says when a fault is the
whole node's, so that the watch moves every rank of the node together (a whole-node migration, as
``clockwork migrate --ranks-on`` does) and the node's ranks land on one spare node instead of scattering:

* a node signal raised at ``migrate`` (:data:`~clockwork.contracts.config.health_signals.NODE_SIGNALS`: the NVLink
  fabric, that is the NVSwitches and the fabric manager, failed; or an XID of ``[health] xid_node``);
* every GPU of the node (two or more) raising a migrate-level signal within ``node_window_s`` of each other (the
  same XID on all of them at once: a fault of what they share);
* a fabric NIC down for ``nic_down_move_s`` (off by default: LinkPass keeps the traffic flowing on the other
  rails, and the NIC's state comes from LinkPass, not from NVML);
* an HCA unusable for ``hca_down_move_s`` (the RDMA device behind a NIC LinkPass avoids: NCCL's queue pairs do
  not follow LinkPass's routes, so the node's ranks move into processes started with ``NCCL_IB_HCA`` excluding
  it, which their node agent gives every process it starts: :mod:`torchpass.launch.node_fabric`).

Pure: no clock, no I/O; the watch passes the time in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clockwork.contracts.config.health import HealthConfig, parse_actions, parse_xids
from clockwork.contracts.config.health_signals import ACTION_RANK, NODE_SIGNALS, SEVERITY, SIGNALS
from clockworkd.gpuhealth.readings import GpuReading

LEVEL, STATE, EVENT = "level", "state", "event"


@dataclass(frozen=True)
class Observation:
    """A signal present in one reading: its value, the threshold it crossed, and how it behaves."""

    name: str
    kind: str
    value: Any
    threshold: Any = None


@dataclass
class Signal:
    """A raised signal of one GPU."""

    name: str
    action: str
    value: Any
    threshold: Any
    since: float
    last_seen: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.name,
            "action": self.action,
            "value": self.value,
            "threshold": self.threshold,
            "since": self.since,
            "last_seen": self.last_seen,
        }


@dataclass(frozen=True)
class Change:
    """A signal raised or cleared on one GPU (what the watch acts on and records)."""

    gpu: int
    uuid: str
    signal: str
    state: str  # "raised" or "cleared"
    action: str
    value: Any
    threshold: Any
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "uuid": self.uuid,
            "signal": self.signal,
            "state": self.state,
            "action": self.action,
            "value": self.value,
            "threshold": self.threshold,
            "time": self.time,
        }


@dataclass(frozen=True)
class NodeFault:
    """A fault of the whole node (see the module docstring): what raised it, on which GPU (None: every GPU, or
    not a GPU), why it is the node's, and since when."""

    signal: str
    value: Any
    threshold: Any
    gpu: int | None
    why: str
    since: float

    def cause(self) -> dict[str, Any]:
        """The fields a whole-node move's ``gpu.migration`` events carry."""
        gpu = "all" if self.gpu is None else self.gpu
        return {"signal": self.signal, "value": self.value, "threshold": self.threshold, "gpu": gpu, "scope": "node"}


@dataclass
class GpuState:
    """What the policy keeps per GPU between readings."""

    raised: dict[str, Signal] = field(default_factory=dict)
    seen_in_row: dict[str, int] = field(default_factory=dict)
    missed_in_row: dict[str, int] = field(default_factory=dict)
    last_nvlink: int | None = None
    history: deque[Change] = field(default_factory=deque)
    reading: GpuReading | None = None

    def worst_action(self) -> str:
        return max((s.action for s in self.raised.values()), key=ACTION_RANK.__getitem__, default="")


class Policy:
    """Judges each reading of every GPU against ``[health]`` (see the module docstring)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.overrides = parse_actions(cfg.actions, tuple(SIGNALS))
        self.xid_migrate = parse_xids("xid_migrate", cfg.xid_migrate)
        self.xid_warn = parse_xids("xid_warn", cfg.xid_warn)
        self.xid_node = parse_xids("xid_node", cfg.xid_node)
        self.gpus: dict[int, GpuState] = {}

    def action_of(self, name: str) -> str:
        """The action ``name`` takes: the configured override, else the catalogue's (or the XID lists')."""
        if name in self.overrides:
            return self.overrides[name]
        if name.startswith("xid."):
            xid = int(name[4:])
            moves = xid in self.xid_migrate or xid in self.xid_node
            return "migrate" if moves else "warn" if xid in self.xid_warn else "record"
        return SIGNALS[name][0]

    # ----- observations -------------------------------------------------------------------

    def _temperature(self, r: GpuReading, state: GpuState) -> list[Observation]:
        if r.temperature_c is None or r.slowdown_c is None or r.slowdown_c <= 0:
            return []
        temp = r.temperature_c
        tiers = [
            ("temperature.shutdown", r.shutdown_c),
            ("temperature.slowdown", r.slowdown_c - self.cfg.temp_migrate_margin_c),
            ("temperature.near_slowdown", r.slowdown_c - self.cfg.temp_warn_margin_c),
        ]
        for name, threshold in tiers:
            if threshold is None or threshold <= 0:
                continue
            held = name in state.raised and temp > threshold - self.cfg.temp_hysteresis_c
            if temp >= threshold or held:
                return [Observation(name, LEVEL, temp, threshold)]  # the highest tier only
        return []

    def observe(self, r: GpuReading, state: GpuState) -> list[Observation]:
        """Every signal present in reading ``r`` of a GPU in ``state``."""
        obs: list[Observation] = []
        if r.lost:
            return [Observation("gpu.lost", STATE, True)] + [Observation(f"xid.{x}", EVENT, x) for x in r.xids]
        if r.error:
            obs.append(Observation("gpu.unreadable", STATE, r.error))
        obs += self._temperature(r, state)
        for reason in r.throttle:
            obs.append(Observation(f"throttle.{reason}", LEVEL, True))
        if r.ecc_corrected is not None and r.ecc_corrected >= self.cfg.ecc_corrected_warn:
            obs.append(Observation("ecc.corrected", STATE, r.ecc_corrected, self.cfg.ecc_corrected_warn))
        if r.ecc_uncorrected:
            obs.append(Observation("ecc.uncorrected", STATE, r.ecc_uncorrected, 1))
        if r.ecc_aggregate_uncorrected:
            obs.append(Observation("ecc.aggregate_uncorrected", STATE, r.ecc_aggregate_uncorrected, 1))
        if r.rows_pending:
            obs.append(Observation("rows.pending", STATE, True))
        if r.rows_remap_failed:
            obs.append(Observation("rows.remap_failed", STATE, True))
        if r.nvlink_errors is not None:
            last, state.last_nvlink = state.last_nvlink, r.nvlink_errors
            delta = r.nvlink_errors - last if last is not None and r.nvlink_errors >= last else 0
            if delta >= self.cfg.nvlink_errors_warn:
                obs.append(Observation("nvlink.errors", LEVEL, delta, self.cfg.nvlink_errors_warn))
        if r.recovery_action and r.recovery_action != "none":
            name = {
                "drain_p2p": "recovery.drain_p2p",
                "gpu_reset": "recovery.reset",
                "bus_reset": "recovery.reset",
                "drain_and_reset": "recovery.reset",
                "node_reboot": "recovery.reboot",
                "system_reboot": "recovery.reboot",
            }.get(r.recovery_action, "recovery.other")
            obs.append(Observation(name, STATE, r.recovery_action))
        if r.fabric_error:
            obs.append(Observation("fabric.error", STATE, r.fabric_error))
        obs += [Observation(f"xid.{x}", EVENT, x) for x in r.xids]
        return obs

    # ----- evaluation -----------------------------------------------------------------------

    def evaluate(self, readings: list[GpuReading], now: float) -> list[Change]:
        """Judge one reading of every GPU; the signals raised and cleared by it."""
        changes: list[Change] = []
        for r in readings:
            state = self.gpus.setdefault(r.index, GpuState(history=deque(maxlen=self.cfg.history)))
            if not r.uuid and state.reading is not None:  # a lost GPU no longer tells its identity
                r.uuid, r.name = state.reading.uuid, state.reading.name
            state.reading = r
            present = {o.name: o for o in self.observe(r, state)}
            for name, o in present.items():
                state.missed_in_row.pop(name, None)
                seen = state.seen_in_row.get(name, 0) + 1
                state.seen_in_row[name] = seen
                if name in state.raised:
                    signal = state.raised[name]
                    signal.value, signal.threshold, signal.last_seen = o.value, o.threshold, now
                    continue
                if o.kind == LEVEL and seen < self.cfg.raise_after:
                    continue
                signal = Signal(name, self.action_of(name), o.value, o.threshold, now, now)
                state.raised[name] = signal
                changes.append(self._change(r, signal, "raised", now))
            for name in [n for n in state.seen_in_row if n not in present]:
                del state.seen_in_row[name]
            for name, signal in list(state.raised.items()):
                if name in present:
                    continue
                if name.startswith("xid."):
                    gone = now - signal.last_seen >= self.cfg.xid_hold_s
                else:
                    missed = state.missed_in_row.get(name, 0) + 1
                    state.missed_in_row[name] = missed
                    gone = missed >= self.cfg.clear_after
                if gone:
                    del state.raised[name]
                    state.missed_in_row.pop(name, None)
                    changes.append(self._change(r, signal, "cleared", now))
        for change in changes:
            self.gpus[change.gpu].history.append(change)
        return changes

    @staticmethod
    def _change(r: GpuReading, signal: Signal, state: str, now: float) -> Change:
        return Change(r.index, r.uuid, signal.name, state, signal.action, signal.value, signal.threshold, now)

    def node_scoped(self, name: str) -> bool:
        """Whether signal ``name`` is a fault of the whole node (a node signal, or an XID of ``xid_node``)."""
        return name in NODE_SIGNALS or (name.startswith("xid.") and int(name[4:]) in self.xid_node)

    def node_fault(
        self,
        nics_down: Mapping[str, tuple[float, str]] | None = None,
        now: float = 0.0,
        hcas_down: Mapping[str, tuple[float, str]] | None = None,
    ) -> NodeFault | None:
        """The node-level fault raised now (the module docstring's rules, in that order), or None: every raised
        fault is one GPU's. ``nics_down``: fabric NIC -> (down since, why), as LinkPass reports them; ``hcas_down``:
        HCA -> (unusable since, why), LinkPass's ``avoid_hcas``."""
        scoped = [
            NodeFault(s.name, s.value, s.threshold, index, f"gpu{index} {s.name}: a fault of the whole node", s.since)
            for index, state in sorted(self.gpus.items())
            for s in state.raised.values()
            if s.action == "migrate" and self.node_scoped(s.name)
        ]
        if scoped:
            return min(scoped, key=lambda f: (f.since, f.signal))
        movers = {
            index: min((s for s in state.raised.values() if s.action == "migrate"), key=lambda s: s.since, default=None)
            for index, state in self.gpus.items()
        }
        first = [s for s in movers.values() if s is not None]
        if len(movers) >= 2 and len(first) == len(movers):
            since = [s.since for s in first]
            if max(since) - min(since) <= self.cfg.node_window_s:
                value = ", ".join(f"gpu{i} {s.name}" for i, s in sorted(movers.items()) if s is not None)
                why = f"every GPU of the node failed within {self.cfg.node_window_s:g} s"
                return NodeFault("gpu.all", value, None, None, why, max(since))
        for nic, (down_since, reason) in sorted((nics_down or {}).items()):
            if self.cfg.nic_down_move_s > 0 and now - down_since >= self.cfg.nic_down_move_s:
                why = f"fabric NIC {nic} down for {now - down_since:.0f} s ({reason or 'no carrier'})"
                return NodeFault("nic.down", nic, self.cfg.nic_down_move_s, None, why, down_since)
        for hca, (down_since, reason) in sorted((hcas_down or {}).items()):
            if self.cfg.hca_down_move_s > 0 and now - down_since >= self.cfg.hca_down_move_s:
                why = (
                    f"HCA {hca} unusable for {now - down_since:.0f} s ({reason}): the node's ranks move into "
                    f"processes started with NCCL_IB_HCA excluding it"
                )
                return NodeFault("hca.down", hca, self.cfg.hca_down_move_s, None, why, down_since)
        return None

    def health(self, index: int) -> tuple[str, str]:
        """(severity, worst action) of a GPU's raised signals."""
        state = self.gpus.get(index)
        action = state.worst_action() if state else ""
        return SEVERITY[action], action
