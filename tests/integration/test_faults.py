"""Fault injection on the real fabric: each fault does what it says, and `clear` undoes all of it."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from clockwork.sandbox.cluster import Sandbox
from tests.integration.conftest import CLOCKWORK, on_node


def reachable(box: Sandbox, src: str, dst_ip: str) -> bool:
    return on_node(box, src, "ping", "-c", "1", "-W", "1", "-q", dst_ip).returncode == 0


def reachable_again(box: Sandbox, src: str, dst_ip: str, tries: int = 5) -> bool:
    """After a fault is lifted: neighbour entries that failed during the fault need an ARP round first."""
    return any(reachable(box, src, dst_ip) for _ in range(tries))


def rail_ip(box: Sandbox, node: str, nic: str) -> str:
    return box.layout().node(node).nic(nic).ip


def netns(box: Sandbox, node: str) -> str:
    """The network namespace of sandbox node ``node`` (``TAG-node`` under a test worker)."""
    return box.layout().node(node).netns


def node_pids(box: Sandbox, node: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns(box, node)], capture_output=True, text=True).stdout.split()


def link_flags(ns: str, dev: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev], capture_output=True, text=True).stdout


def loss_share(box: Sandbox, src: str, dst_ip: str, count: int = 300) -> float:
    out = on_node(box, src, "ping", "-c", str(count), "-i", "0.002", "-W", "1", "-q", dst_ip).stdout
    m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    assert m, out
    sent, got = int(m.group(1)), int(m.group(2))
    return 1 - got / sent


def cli(box: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLOCKWORK, "sandbox", "--state", str(box.paths.root), *args], capture_output=True, text=True, timeout=60
    )


def test_baseline_every_node_reaches_every_peer_on_every_rail(sandbox: Sandbox) -> None:
    layout = sandbox.layout()
    for node in layout.nodes:
        for peer in layout.nodes:
            if peer is not node:
                assert reachable_again(sandbox, node.name, peer.node_addr), (node.name, peer.node_addr)
                for nic in peer.nics:
                    assert reachable_again(sandbox, node.name, nic.ip), (node.name, nic.ip)


def test_rail_bridges_forward_without_the_hosts_ip_firewall_hooks(sandbox: Sandbox) -> None:
    """A switch does not run the host's iptables on the frames it forwards; with br_netfilter loaded the bridges
    would (costing the sending node ~1 µs a packet)."""
    keys = ["iptables", "ip6tables", "arptables"]
    argv = [
        "ip",
        "netns",
        "exec",
        sandbox.layout().fabric_ns,
        "sysctl",
        "-n",
        *(f"net.bridge.bridge-nf-call-{k}" for k in keys),
    ]
    got = subprocess.run(argv, capture_output=True, text=True)
    if got.returncode != 0:  # no such keys in the fabric: br_netfilter is not loaded at all
        assert not Path("/proc/sys/net/bridge").exists(), got.stderr
        return
    assert got.stdout.split() == ["0", "0", "0"]


def test_link_down_cuts_one_rail_only_and_up_restores_it(sandbox: Sandbox) -> None:
    assert cli(sandbox, "fault", "link", "node2", "nic0", "down").returncode == 0
    assert "state DOWN" in link_flags(netns(sandbox, "node2"), "nic0")
    assert not reachable(sandbox, "node1", rail_ip(sandbox, "node2", "nic0"))
    assert reachable(sandbox, "node1", rail_ip(sandbox, "node2", "nic1"))
    assert sandbox.status()["faults"] == {"link node2 nic0": "down"}
    assert cli(sandbox, "fault", "link", "node2", "nic0", "up").returncode == 0
    assert reachable_again(sandbox, "node1", rail_ip(sandbox, "node2", "nic0"))
    assert sandbox.status()["faults"] == {}


def test_clear_restores_routes_the_kernel_dropped_on_admin_down(sandbox: Sandbox) -> None:
    node3 = sandbox.layout().node("node3")
    sandbox.fault("link", "node1", "nic0", "down")
    routes = subprocess.run(
        ["ip", "-n", netns(sandbox, "node1"), "route", "show", f"{node3.node_addr}/32"], capture_output=True, text=True
    ).stdout
    assert routes.strip() == ""  # admin-down removed the node-address routes through nic0
    sandbox.clear_faults()
    assert reachable_again(sandbox, "node1", node3.node_addr)


def test_port_down_is_carrier_loss_seen_by_the_node(sandbox: Sandbox) -> None:
    sandbox.fault("port", "node3", "nic1", "down")
    assert "NO-CARRIER" in link_flags(netns(sandbox, "node3"), "nic1")
    assert not reachable(sandbox, "node1", rail_ip(sandbox, "node3", "nic1"))
    assert reachable(sandbox, "node1", rail_ip(sandbox, "node3", "nic0"))
    sandbox.fault("port", "node3", "nic1", "up")
    deadline = time.monotonic() + 5
    while "NO-CARRIER" in link_flags(netns(sandbox, "node3"), "nic1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reachable_again(sandbox, "node1", rail_ip(sandbox, "node3", "nic1"))


def test_blackhole_drops_everything_while_carrier_stays_up(sandbox: Sandbox) -> None:
    sandbox.fault("blackhole", "node2", "nic0", "on")
    flags = link_flags(netns(sandbox, "node2"), "nic0")
    assert "LOWER_UP" in flags and "NO-CARRIER" not in flags
    assert not reachable(sandbox, "node1", rail_ip(sandbox, "node2", "nic0"))
    assert not reachable(sandbox, "node2", rail_ip(sandbox, "node4", "nic0"))  # both directions
    assert reachable(sandbox, "node1", rail_ip(sandbox, "node2", "nic1"))
    sandbox.fault("blackhole", "node2", "nic0", "off")
    assert reachable_again(sandbox, "node1", rail_ip(sandbox, "node2", "nic0"))


def test_loss_drops_about_the_asked_share(sandbox: Sandbox) -> None:
    target = rail_ip(sandbox, "node4", "nic0")
    sandbox.fault("loss", "node4", "nic0", "100")
    assert loss_share(sandbox, "node1", target, count=20) == 1.0
    sandbox.fault("loss", "node4", "nic0", "20")
    # A ping is lost if the request or the reply is: expected 1 - 0.8^2 = 36 %; 300 pings keep the
    # binomial spread near 3 %, so these bounds are many standard deviations wide.
    assert 0.15 < loss_share(sandbox, "node1", target) < 0.60
    assert loss_share(sandbox, "node1", rail_ip(sandbox, "node4", "nic1"), count=100) == 0.0
    sandbox.fault("loss", "node4", "nic0", "0")
    assert sandbox.status()["faults"] == {}
    assert loss_share(sandbox, "node1", target, count=100) == 0.0


def _throughput_bytes_per_s(box: Sandbox, src: str, dst: str, nbytes: int) -> float:
    """Send ``nbytes`` over TCP from src to dst's rail-0 address, timed at the receiver."""
    ip = rail_ip(box, dst, "nic0")
    server = subprocess.Popen(
        box.exec_argv(
            dst,
            [
                "python3",
                "-c",
                "import socket,time\n"
                f"s=socket.create_server(('{ip}',17999)); print('listening', flush=True); c,_=s.accept(); n=0; t=None\n"
                "while True:\n d=c.recv(1<<16)\n t=t or time.monotonic()\n"
                " if not d: break\n n+=len(d)\n"
                "print(n/(time.monotonic()-t))",
            ],
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    client = on_node(
        box,
        src,
        "python3",
        "-c",
        f"import socket; c=socket.create_connection(('{ip}',17999)); c.sendall(b'x'*{nbytes}); c.close()",
    )
    assert client.returncode == 0, client.stderr
    out, _ = server.communicate(timeout=60)
    return float(out.split()[-1])


def test_rate_limits_throughput_both_ways_and_off_lifts_it(sandbox: Sandbox) -> None:
    sandbox.fault("rate", "node2", "nic0", "8mbit")
    for ns, dev in ((sandbox.layout().fabric_ns, "n2-nic0"), (netns(sandbox, "node2"), "nic0")):
        qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 8Mbit" in qdisc, qdisc
    limited = _throughput_bytes_per_s(sandbox, "node1", "node2", 2_000_000)
    assert limited < 2 * 1e6, limited  # 8 Mbit/s = 1 MB/s; allow the bucket's burst
    sandbox.fault("rate", "node2", "nic0", "off")
    assert (
        "tbf"
        not in subprocess.run(
            ["tc", "-n", netns(sandbox, "node2"), "qdisc", "show", "dev", "nic0"], capture_output=True, text=True
        ).stdout
    )
    unlimited = _throughput_bytes_per_s(sandbox, "node1", "node2", 20_000_000)
    assert unlimited > 4 * limited


def test_clear_undoes_every_kind_at_once(sandbox: Sandbox) -> None:
    sandbox.fault("link", "node1", "nic1", "down")
    sandbox.fault("port", "node2", "nic1", "down")
    sandbox.fault("blackhole", "node3", "nic0", "on")
    sandbox.fault("loss", "node4", "nic1", "50")
    sandbox.fault("rate", "node4", "nic0", "1mbit")
    assert len(sandbox.status()["faults"]) == 5
    result = cli(sandbox, "fault", "clear")
    assert result.returncode == 0, result.stderr
    assert sandbox.status()["faults"] == {}
    test_baseline_every_node_reaches_every_peer_on_every_rail(sandbox)
    assert loss_share(sandbox, "node1", rail_ip(sandbox, "node4", "nic1"), count=50) == 0.0


def test_node_crash_kills_everything_in_it_and_restore_brings_it_back_empty(sandbox: Sandbox) -> None:
    on_node(sandbox, "node4", "sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
    before = node_pids(sandbox, "node4")
    assert len(before) >= 2  # slurmd and the sleeper at least
    result = cli(sandbox, "fault", "node", "node4", "crash")
    assert result.returncode == 0, result.stderr
    assert "node node4 crashed" in result.stdout
    assert node_pids(sandbox, "node4") == []
    for nic in ("nic0", "nic1"):
        assert not reachable(sandbox, "node1", rail_ip(sandbox, "node4", nic))
        assert "state DOWN" in link_flags(sandbox.layout().fabric_ns, sandbox.layout().node("node4").nic(nic).port)
    assert sandbox.status()["faults"] == {"node node4 -": "crash"}

    result = cli(sandbox, "fault", "node", "node4", "restore")
    assert result.returncode == 0, result.stderr
    assert all(reachable_again(sandbox, "node1", rail_ip(sandbox, "node4", nic)) for nic in ("nic0", "nic1"))
    pids = node_pids(sandbox, "node4")
    cmdlines = [open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0] for p in pids]
    assert any(c.endswith(b"slurmd") for c in cmdlines) and not any(c.endswith(b"sleep") for c in cmdlines)
    deadline = time.monotonic() + 60
    while not sandbox.node_states().get("node4", "").startswith("IDLE"):
        assert time.monotonic() < deadline, f"node4 did not come back IDLE: {sandbox.node_states()}"
        time.sleep(0.5)
    assert sandbox.status()["faults"] == {}


def test_clear_restores_a_crashed_node(sandbox: Sandbox) -> None:
    assert cli(sandbox, "fault", "node", "node3", "crash").returncode == 0
    assert cli(sandbox, "fault", "clear").returncode == 0
    assert reachable_again(sandbox, "node1", rail_ip(sandbox, "node3", "nic0"))
    assert sandbox.status()["faults"] == {}
    deadline = time.monotonic() + 60
    while not sandbox.node_states().get("node3", "").startswith("IDLE"):
        assert time.monotonic() < deadline, f"node3 did not come back IDLE: {sandbox.node_states()}"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["node", "node1", "explode"], "`fault node` needs NODE crash|restore"),
        (["loss", "node1", "nic0", "150"], "fault loss: invalid value '150' (expected a percentage 0..100"),
        (["link", "node1", "nic0", "sideways"], "fault link: invalid value 'sideways' (expected down or up)"),
        (["rate", "node1", "nic0", "fast"], "fault rate: invalid value 'fast'"),
        (["link", "node9", "nic0", "down"], "no sandbox node 'node9' (nodes: node1, node2, node3, node4)"),
        (["port", "node1", "nic7", "down"], "node1 has no NIC 'nic7' (NICs: nic0, nic1)"),
    ],
)
def test_bad_fault_requests_are_refused_with_the_reason(sandbox: Sandbox, args: list[str], message: str) -> None:
    result = cli(sandbox, "fault", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("clockwork: ") and message in result.stderr, result.stderr
    assert sandbox.status()["faults"] == {}
