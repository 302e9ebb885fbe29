"""Fault requests: parsing, validation against the layout, and the nftables ruleset for packet loss.

Only the pure parts are tested here; applying a fault needs root and a sandbox (tests/integration).
"""

from __future__ import annotations

import pytest

from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.errors import ConfigError
from clockwork.sandbox.faults import (
    KINDS,
    NFT_TABLE,
    Fault,
    _nft_ruleset,
    losses_of,
    parse_percent,
    parse_rate,
    validate,
)
from clockwork.sandbox.layout import Layout, build_layout

RATE_UNITS = ("bit", "kbit", "mbit", "gbit", "bps", "kbps", "mbps", "gbps")


@pytest.fixture
def layout() -> Layout:
    return build_layout(SandboxConfig(nodes=3, nics=2))


# ----- parse_percent / parse_rate -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pct"),
    [("0", 0.0), ("0.5", 0.5), ("1", 1.0), ("1%", 1.0), ("12.25%", 12.25), ("100", 100.0), ("100%", 100.0)],
)
def test_parse_percent(text: str, pct: float) -> None:
    assert parse_percent(text) == pct


@pytest.mark.parametrize("text", ["-1", "100.01", "101", "abc", "", "%", "nan", "inf", "1e9"])
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_percent(text)
    assert str(err.value) == f"fault loss: invalid value {text!r} (expected a percentage 0..100, e.g. 1 or 0.5)"


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("8bit", 1.0),
        ("1kbit", 125.0),
        ("100mbit", 12.5e6),
        ("1gbit", 125e6),
        ("0.5mbit", 62500.0),
        ("1bps", 1.0),
        ("1kbps", 1e3),
        ("2.5mbps", 2.5e6),
        ("1gbps", 1e9),
        ("100MBit", 12.5e6),
    ],
)
def test_parse_rate(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


def test_parse_rate_off() -> None:
    assert parse_rate("off") is None


@pytest.mark.parametrize("text", ["100", "0mbit", "0.0gbit", "-1mbit", "fast", "1 mbit", "", "mbit", "1tbit"])
def test_parse_rate_rejects_and_lists_the_units(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_rate(text)
    msg = str(err.value)
    assert msg.startswith(f"fault rate: invalid value {text!r} (expected RATE with a unit ")
    for unit in RATE_UNITS:
        assert unit in msg
    assert "'off'" in msg


# ----- validate -------------------------------------------------------------------------------


def test_kinds() -> None:
    assert list(KINDS) == ["link", "port", "blackhole", "loss", "rate", "mtu"]


def test_validate_unknown_kind(layout: Layout) -> None:
    with pytest.raises(ConfigError) as err:
        validate(layout, "melt", "node1", "nic0", "down")
    assert str(err.value) == "unknown fault kind 'melt' (expected one of link, port, blackhole, loss, rate, mtu)"


def test_validate_unknown_node_and_nic(layout: Layout) -> None:
    with pytest.raises(ConfigError, match=r"^no sandbox node 'node4' \(nodes: node1, node2, node3\)$"):
        validate(layout, "link", "node4", "nic0", "down")
    with pytest.raises(ConfigError, match=r"^node2 has no NIC 'nic2' \(NICs: nic0, nic1\)$"):
        validate(layout, "link", "node2", "nic2", "down")


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [
        ("link", "sideways", "down or up"),
        ("port", "off", "down or up"),
        ("blackhole", "down", "on or off"),
        ("link", "DOWN", "down or up"),
    ],
)
def test_validate_value_not_allowed(layout: Layout, kind: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(layout, kind, "node1", "nic0", value)
    assert str(err.value) == f"fault {kind}: invalid value {value!r} (expected {expected})"


@pytest.mark.parametrize(
    ("kind", "value", "normalised"),
    [
        ("link", "down", "down"),
        ("port", "up", "up"),
        ("blackhole", "on", "on"),
        ("loss", "0.50", "0.5"),
        ("loss", "1%", "1"),
        ("loss", "100", "100"),
        ("loss", "0.0", "0"),
        ("rate", "100mbit", "100mbit"),
        ("rate", "off", "off"),
        ("mtu", "1000", "1000"),
        ("mtu", "1500", "1500"),
    ],
)
def test_validate_normalises(layout: Layout, kind: str, value: str, normalised: str) -> None:
    fault = validate(layout, kind, "node2", "nic1", value)
    assert fault == Fault(kind, "node2", "nic1", normalised)
    assert fault.key == f"{kind} node2 nic1"


def test_validate_checks_loss_and_rate_values(layout: Layout) -> None:
    with pytest.raises(ConfigError, match="fault loss: invalid value '150'"):
        validate(layout, "loss", "node1", "nic0", "150")
    with pytest.raises(ConfigError, match="fault rate: invalid value 'quick'"):
        validate(layout, "rate", "node1", "nic0", "quick")
    for bad in ("9001", "67", "1k", "-1"):
        with pytest.raises(ConfigError, match=rf"fault mtu: invalid value '{bad}' \(expected the switch port's MTU"):
            validate(layout, "mtu", "node1", "nic0", bad)


@pytest.mark.parametrize(
    ("kind", "value", "clears"),
    [
        ("link", "up", True),
        ("link", "down", False),
        ("port", "up", True),
        ("port", "down", False),
        ("blackhole", "off", True),
        ("blackhole", "on", False),
        ("loss", "0", True),
        ("loss", "0.00", True),
        ("loss", "0.5", False),
        ("loss", "100", False),
        ("rate", "off", True),
        ("rate", "100mbit", False),
        ("mtu", "1500", True),
        ("mtu", "1000", False),
    ],
)
def test_fault_clears(kind: str, value: str, clears: bool) -> None:
    assert Fault(kind, "node1", "nic0", value).clears is clears


# ----- loss: losses_of and the nftables ruleset -----------------------------------------------


def test_losses_of(layout: Layout) -> None:
    active = {
        "loss node1 nic0": "5",
        "loss node3 nic1": "0.5",
        "link node2 nic1": "down",
        "rate node2 nic0": "100mbit",
    }
    assert losses_of(active, layout) == {"n1-nic0": 5.0, "n3-nic1": 0.5}
    assert losses_of({}, layout) == {}


def test_nft_ruleset_half_a_percent() -> None:
    text = _nft_ruleset({"n1-nic0": 0.5})
    assert text == (
        f"table bridge {NFT_TABLE} {{\n"
        "  chain forward {\n"
        "    type filter hook forward priority 0; policy accept;\n"
        '    iifname "n1-nic0" numgen random mod 10000 < 50 counter drop\n'
        '    oifname "n1-nic0" numgen random mod 10000 < 50 counter drop\n'
        "  }\n"
        "}\n"
    )


def test_nft_ruleset_full_loss_drops_unconditionally() -> None:
    text = _nft_ruleset({"n2-nic1": 100.0})
    assert '    iifname "n2-nic1" counter drop\n' in text
    assert '    oifname "n2-nic1" counter drop\n' in text
    assert "numgen" not in text


def test_nft_ruleset_several_ports_both_directions_sorted() -> None:
    text = _nft_ruleset({"n3-nic0": 12.34, "n1-nic1": 1.0})
    rules = [line.strip() for line in text.splitlines() if line.strip().endswith("counter drop")]
    assert rules == [
        'iifname "n1-nic1" numgen random mod 10000 < 100 counter drop',
        'oifname "n1-nic1" numgen random mod 10000 < 100 counter drop',
        'iifname "n3-nic0" numgen random mod 10000 < 1234 counter drop',
        'oifname "n3-nic0" numgen random mod 10000 < 1234 counter drop',
    ]
    assert text.startswith(f"table bridge {NFT_TABLE} {{\n")
    assert text.count("{") == text.count("}")
