"""Fault injection on the sandbox fabric: the failures LinkPass and Fleet Lens must survive and see.

Each fault acts where the real one would: ``link`` on the node's own NIC (admin down, as a driver
reset does), ``port`` on the switch side (the node sees carrier loss), ``blackhole`` a switch port
that stops forwarding while carrier stays up (the gray failure carrier checks miss), ``loss`` random
drops in both directions (an nftables rule on the bridge), ``rate`` a token bucket in both directions
(a degraded link), ``mtu`` a switch port configured for smaller frames than the fabric's (small probes
pass, full-size frames vanish). The kernel here has no netem; added delay is out of scope for this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clockwork.contracts.errors import ConfigError
from clockwork.sandbox.fabric import baseline_routes
from clockwork.sandbox.layout import Layout, NicSpec, NodeSpec
from clockwork.sandbox.shell import in_netns, run

NFT_TABLE = "clockwork_faults"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
_RATE_SCALE = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "bps": 1,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
}

#: kind -> allowed values (None = free-form, checked by the kind's parser).
KINDS: dict[str, tuple[str, ...] | None] = {
    "link": ("down", "up"),
    "port": ("down", "up"),
    "blackhole": ("on", "off"),
    "loss": None,
    "rate": None,
    "mtu": None,
}
#: The MTU every sandbox NIC and switch port has (the kernel's veth default); an ``mtu`` fault to it clears.
FABRIC_MTU = 1500


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str
    nic: str
    value: str

    @property
    def key(self) -> str:
        return f"{self.kind} {self.node} {self.nic}"

    @property
    def clears(self) -> bool:
        """True when this value returns the NIC to health (so it leaves the active-fault list)."""
        if self.kind == "mtu":
            return int(self.value) == FABRIC_MTU
        return self.value in ("up", "off", "0") or (self.kind == "loss" and float(self.value) == 0)


def parse_percent(value: str) -> float:
    try:
        pct = float(value.rstrip("%"))
    except ValueError:
        pct = -1.0
    if not 0.0 <= pct <= 100.0:
        raise ConfigError(f"fault loss: invalid value {value!r} (expected a percentage 0..100, e.g. 1 or 0.5)")
    return pct


def parse_rate(value: str) -> float | None:
    """Bytes per second for a tc rate such as ``100mbit``; None for ``off``."""
    if value == "off":
        return None
    m = _RATE.match(value.lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(
            f"fault rate: invalid value {value!r} (expected RATE with a unit bit, kbit, mbit, gbit, bps, kbps, "
            "mbps or gbps, e.g. 100mbit; or 'off')"
        )
    return float(m.group(1)) * _RATE_SCALE[m.group(2)]


def parse_mtu(value: str) -> int:
    """A switch port MTU in bytes (68, the IPv4 minimum, .. 9000 jumbo frames)."""
    if not value.isdigit() or not 68 <= int(value) <= 9000:
        raise ConfigError(
            f"fault mtu: invalid value {value!r} (expected the switch port's MTU in bytes, 68..9000; "
            f"{FABRIC_MTU} = the fabric's own, which clears the fault)"
        )
    return int(value)


def validate(layout: Layout, kind: str, node: str, nic: str, value: str) -> Fault:
    """Check a fault request against the layout and the kind's allowed values."""
    if kind not in KINDS:
        raise ConfigError(f"unknown fault kind {kind!r} (expected one of {', '.join(KINDS)})")
    layout.node(node).nic(nic)
    allowed = KINDS[kind]
    if allowed is not None and value not in allowed:
        raise ConfigError(f"fault {kind}: invalid value {value!r} (expected {' or '.join(allowed)})")
    if kind == "loss":
        value = f"{parse_percent(value):g}"
    elif kind == "rate":
        parse_rate(value)
    elif kind == "mtu":
        value = str(parse_mtu(value))
    return Fault(kind, node, nic, value)


def _nft_ruleset(losses: dict[str, float]) -> str:
    """One bridge table dropping a share of the frames to and from each lossy switch port."""
    rules = []
    for port, pct in sorted(losses.items()):
        threshold = max(1, round(pct * 100))  # per 10 000, so 0.01 % steps; never round a loss away
        sample = "" if threshold >= 10000 else f"numgen random mod 10000 < {threshold} "
        rules += [f'    {side} "{port}" {sample}counter drop' for side in ("iifname", "oifname")]
    return (
        f"table bridge {NFT_TABLE} {{\n  chain forward {{\n"
        "    type filter hook forward priority 0; policy accept;\n" + "\n".join(rules) + "\n  }\n}\n"
    )


def _set_losses(layout: Layout, losses: dict[str, float]) -> None:
    nft = [*in_netns(layout.fabric_ns), "nft"]
    run([*nft, "delete", "table", "bridge", NFT_TABLE], check=False)
    if losses:
        run([*nft, "-f", "-"], input=_nft_ruleset(losses))


def _set_rate(layout: Layout, node: NodeSpec, nic: NicSpec, bytes_per_s: float | None) -> None:
    ends = [(layout.fabric_ns, nic.port), (node.netns, nic.name)]  # both directions
    for ns, dev in ends:
        if bytes_per_s is None:
            run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        else:
            burst = max(32 * 1024, int(bytes_per_s / 50))
            run(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{int(bytes_per_s * 8)}bit",
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                ]
            )


def losses_of(active: dict[str, str], layout: Layout) -> dict[str, float]:
    """Switch port -> loss percent for every active loss fault."""
    out = {}
    for key, value in active.items():
        kind, node, nic = key.split()
        if kind == "loss":
            out[layout.node(node).nic(nic).port] = float(value)
    return out


def apply(layout: Layout, fault: Fault, active: dict[str, str]) -> None:
    """Put ``fault`` into effect and update ``active`` (the sandbox's record of live faults)."""
    node = layout.node(fault.node)
    nic = node.nic(fault.nic)
    if fault.kind == "link":
        run(["ip", "-n", node.netns, "link", "set", nic.name, fault.value])
    elif fault.kind == "port":
        run(["ip", "-n", layout.fabric_ns, "link", "set", nic.port, fault.value])
    elif fault.kind == "blackhole":
        state = "0" if fault.value == "on" else "3"  # 0 = disabled, 3 = forwarding
        run(["bridge", "-n", layout.fabric_ns, "link", "set", "dev", nic.port, "state", state])
    elif fault.kind == "rate":
        _set_rate(layout, node, nic, parse_rate(fault.value))
    elif fault.kind == "mtu":
        run(["ip", "-n", layout.fabric_ns, "link", "set", nic.port, "mtu", fault.value])
    if fault.clears:
        active.pop(fault.key, None)
    else:
        active[fault.key] = fault.value
    if fault.kind == "loss":
        _set_losses(layout, losses_of(active, layout))


def clear(layout: Layout, active: dict[str, str]) -> None:
    """Undo every fault and restore the baseline routes (an admin-down NIC loses its routes)."""
    _set_losses(layout, {})
    for node in layout.nodes:
        fabric_cmds, node_cmds = [], []
        for nic in node.nics:
            fabric_cmds.append(f"link set {nic.port} up mtu {FABRIC_MTU}")
            node_cmds.append(f"link set {nic.name} up")
            run(["bridge", "-n", layout.fabric_ns, "link", "set", "dev", nic.port, "state", "3"], check=False)
            _set_rate(layout, node, nic, None)
        run(["ip", "-n", layout.fabric_ns, "-batch", "-"], input="\n".join(fabric_cmds) + "\n")
        run(["ip", "-n", node.netns, "-batch", "-"], input="\n".join(node_cmds + baseline_routes(layout, node)) + "\n")
    active.clear()
