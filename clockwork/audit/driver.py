"""The audit driver: starts one worker per node through Slurm and schedules the measurements between them.

Workers are started with ``srun`` (inside the caller's allocation when there is one, else in a new one), so
they run where jobs run and see what jobs see; on the sandbox that is each node's network namespace. The
driver listens on an address the nodes can reach, with CURVE keys derived from a secret drawn for this
audit, so only its own workers can connect and nothing else can ask a node to drop a NIC.

Order of the rounds: probes (loss, round trip) and path MTU first, on an idle fabric; then bulk transfers
one at a time (so each link's figure is its own, not a share); then LinkPass drills, node by node, each
against a peer whose NICs are all healthy so a drill never measures someone else's fault.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from clockwork.audit.worker import ENV_DRIVER, ENV_KEY
from clockwork.contracts.config.audit import AuditConfig
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.jobkey import JobKey

log = logging.getLogger("clockwork.audit")

#: The longest the drills wait for the fabric to settle from the previous drill (LinkPass's hold-down cap).
SETTLE_S = 30.0


class AuditError(ClockworkError):
    """The audit could not run (not: the audit found faults)."""

    exit_code = 7


def route_source(addr: str) -> str:
    """The local address this host uses to reach ``addr`` (what a node connecting back will reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addr, 9))  # UDP connect sends nothing; it only picks the route
        return str(sock.getsockname()[0])


@dataclass
class WorkerLaunch:
    """How the workers are started: the srun command line and its environment."""

    nodes: list[str]
    srun: str = "srun"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        n = str(len(self.nodes))
        return [
            self.srun,
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(self.nodes)}",
            "--job-name=clockwork-audit",
            "--kill-on-bad-exit=0",
            "--export=ALL",
            *self.extra_args,
            sys.executable,
            "-m",
            "clockwork.audit.worker",
        ]


class Driver:
    """Runs one audit; :meth:`run` returns the raw figures that :func:`verdict.judge` turns into a report."""

    def __init__(self, cfg: AuditConfig, launch: WorkerLaunch, listen: str, *, drill: bool) -> None:
        self.cfg = cfg
        self.launch = launch
        self.listen = listen
        self.drill = drill and cfg.drill
        self.key = JobKey.new()
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.router_mandatory = True
        self.key.serve(self.sock)
        port = self.sock.bind_to_random_port(f"tcp://{listen}")
        self.endpoint = f"tcp://{listen}:{port}"
        self.hello: dict[str, dict[str, Any]] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()
        self._ids = itertools.count(1)
        self._runs = itertools.count(int(time.time()) & 0xFFFF_0000)
        self.timings: dict[str, float] = {}
        self.linkpass_down: dict[str, str] = {}  # node -> why LinkPass is not running there (drills skipped)

    # ----- plumbing ---------------------------------------------------------------------

    def _srun_output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()[-2000:]

    def _start_workers(self) -> None:
        env = dict(os.environ, **self.launch.env, **{ENV_DRIVER: self.endpoint, ENV_KEY: self.key.hex})
        cmd = self.launch.command()
        log.info("starting audit workers: %s", " ".join(cmd))
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise AuditError(f"cannot start the audit workers with {cmd[0]}: {exc}") from exc
        deadline = time.monotonic() + self.cfg.worker_start_timeout_s
        while len(self.hello) < len(self.launch.nodes) and time.monotonic() < deadline:
            if self.sock.poll(200):
                node, msg = self._recv()
                if msg.get("op") == "hello" and node in self.launch.nodes:
                    self.hello[node] = msg
            elif self.proc.poll() is not None:
                break
        missing = [n for n in self.launch.nodes if n not in self.hello]
        if missing and not self.hello:
            raise AuditError(
                f"no audit worker started (srun exit {self.proc.poll()}); srun said:\n"
                + (self._srun_output() or "(nothing)")
            )
        for node in missing:
            log.warning("node %s: its audit worker did not start", node)

    def _recv(self) -> tuple[str, dict[str, Any]]:
        identity, data = self.sock.recv_multipart()
        try:
            msg = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.UnpackException):
            log.warning("dropped a malformed message from audit worker %r", identity)
            return identity.decode(errors="replace"), {}
        return identity.decode(errors="replace"), msg if isinstance(msg, dict) else {}

    def ask(self, requests: dict[str, dict[str, Any]], timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Send one request to each named worker at once; their answers (an ``error`` entry for silence)."""
        pending: dict[int, str] = {}
        for node, req in requests.items():
            rid = next(self._ids)
            try:
                self.sock.send_multipart([node.encode(), msgpack.packb({"id": rid, **req}, default=str)])
                pending[rid] = node
            except zmq.ZMQError as exc:
                log.warning("node %s: cannot reach its audit worker: %s", node, exc)
        answers: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + (timeout_s or self.cfg.step_timeout_s)
        while pending and time.monotonic() < deadline:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            node, msg = self._recv()
            answered = msg.get("id")
            if answered in pending:
                answers[pending.pop(answered)] = msg
        for node in pending.values():
            answers[node] = {"error": "the audit worker did not answer in time"}
        return answers

    def _nics(self, node: str) -> dict[str, dict[str, Any]]:
        return self.hello[node].get("nics") or {}

    def _rails(self) -> dict[str, list[str]]:
        """Rail (NIC name) -> nodes that have it, in the order given."""
        rails: dict[str, list[str]] = {}
        for node in self.launch.nodes:
            if node in self.hello:
                for nic in self._nics(node):
                    rails.setdefault(nic, []).append(node)
        return rails

    def _target(self, src: str, dst: str, nic: str, ports: str) -> dict[str, Any]:
        dst_ip = self._nics(dst)[nic]["ip"]
        return {
            "src": f"{src}/{nic}",
            "dst": f"{dst}/{nic}",
            "device": nic,
            "src_ip": self._nics(src)[nic]["ip"],
            "dst_ip": dst_ip,
            "port": int(self.hello[dst][ports][dst_ip]),
        }

    def rail_mtu(self, nodes: list[str], nic: str) -> int:
        if self.cfg.mtu:
            return self.cfg.mtu
        mtus = Counter(m for n in nodes if (m := self._nics(n)[nic].get("mtu")))
        return mtus.most_common(1)[0][0] if mtus else 1500

    # ----- rounds -----------------------------------------------------------------------

    def _round_probes(self, rails: dict[str, list[str]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        run = next(self._runs)
        requests = {}
        for node in self.hello:
            targets = [
                self._target(node, peer, nic, "echo_ports")
                for nic, nodes in rails.items()
                if node in nodes
                for peer in nodes
                if peer != node
            ]
            requests[node] = {
                "op": "probe",
                "run": run,
                "count": self.cfg.probe_count,
                "interval_s": self.cfg.probe_interval_ms / 1000,
                "targets": targets,
            }
        budget = self.cfg.step_timeout_s + self.cfg.probe_count * self.cfg.probe_interval_ms / 1000
        answers = self.ask(requests, budget)
        paths = [p for node in requests for p in answers[node].get("paths", [])]
        counts = self.ask({node: {"op": "echo_counts", "run": run} for node in self.hello})
        received = [dict(r, node=node) for node, a in counts.items() for r in a.get("received", [])]
        return paths, received

    def _round_mtu(self, rails: dict[str, list[str]]) -> list[dict[str, Any]]:
        run = next(self._runs)
        requests: dict[str, dict[str, Any]] = {node: {"op": "mtu", "run": run, "targets": []} for node in self.hello}
        results = []
        for nic, nodes in rails.items():  # one rail at a time: each has its own MTU
            mtu = self.rail_mtu(nodes, nic)
            for node in nodes:
                requests[node] = {
                    "op": "mtu",
                    "run": run,
                    "mtu": mtu,
                    "tries": self.cfg.mtu_probes,
                    "targets": [self._target(node, p, nic, "echo_ports") for p in nodes if p != node],
                }
            answers = self.ask({n: requests[n] for n in nodes})
            results += [p for n in nodes for p in answers[n].get("paths", [])]
        return results

    def transfer_pairs(self, nodes: list[str]) -> list[tuple[str, str]]:
        """Who sends to whom on one rail: every ordered pair on small clusters, else both ring neighbours."""
        if len(nodes) <= self.cfg.all_pairs_max_nodes:
            return [(a, b) for a in nodes for b in nodes if a != b]
        n = len(nodes)
        return [(nodes[i], nodes[(i + d) % n]) for i in range(n) for d in (1, -1)]

    def _round_bandwidth(
        self, rails: dict[str, list[str]], paths: list[dict[str, Any]], mtu: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """One transfer at a time. Pairs the earlier rounds found unreachable, or dropping full-size frames
        (which stall TCP), are not measured: that finding already explains them, and a transfer would only
        time out and smear the blame onto the healthy end."""
        unreachable = {(p["src"], p["dst"]) for p in paths if not p.get("replies")}
        big_drops = {(m["src"], m["dst"]) for m in mtu if m.get("small_ok") and not m.get("full_ok")}
        results = []
        for nic, nodes in rails.items():
            for src, dst in self.transfer_pairs(nodes):
                pair = (f"{src}/{nic}", f"{dst}/{nic}")
                if pair in unreachable or pair in big_drops or pair[::-1] in big_drops:
                    why = "unreachable" if pair in unreachable else "the path drops full-size frames"
                    results.append({"src": pair[0], "dst": pair[1], "skipped": why})
                    continue
                req = {
                    "op": "transfer",
                    "target": self._target(src, dst, nic, "sink_ports"),
                    "seconds": self.cfg.bandwidth_s,
                }
                answer = self.ask({src: req}, self.cfg.step_timeout_s + 4 * self.cfg.bandwidth_s)[src]
                answer.pop("id", None)
                answer.setdefault("src", f"{src}/{nic}")
                answer.setdefault("dst", f"{dst}/{nic}")
                results.append(answer)
        return results

    def _healthy_nics(self, node: str) -> bool:
        return all(f.get("operstate") == "up" and f.get("carrier") for f in self._nics(node).values())

    def _wait_settled(self) -> bool:
        """Wait (bounded by LinkPass's longest hold-down) until every node's LinkPass calls every path alive.

        Each drill is a flap, and LinkPass damps flaps with a hold-down that doubles per flap: a peer whose
        other path to the drilled node is still held down cannot move the traffic yet, and the drill would
        time the damping instead of the failover (seen on the sandbox: 1 to 2 s). Drills therefore start
        on a settled fabric."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            answers = self.ask({node: {"op": "linkpass"} for node in self.hello})
            states = [v for a in answers.values() for rails in (a.get("paths") or {}).values() for v in rails.values()]
            if states and all(v == "alive" for v in states):
                return True
            time.sleep(0.2)
        log.warning("the fabric did not settle within %.0f s before a drill", SETTLE_S)
        return False

    def _linkpass_not_running(self) -> dict[str, str]:
        """node -> why LinkPass is not running there, for every node where it is not."""
        answers = self.ask({node: {"op": "linkpass_running"} for node in self.hello})
        return {node: str(a["not_running"]) for node, a in answers.items() if a.get("not_running")}

    def _round_drills(self, paths: list[dict[str, Any]]) -> list[dict[str, Any]]:
        not_running = self._linkpass_not_running()
        if not_running:  # nothing would move the traffic: a drill would only cut a link, and wait for nothing
            why = "LinkPass is not running on " + ", ".join(sorted(not_running))
            self.linkpass_down = not_running
            return [{"node": node, "nic": nic, "skipped": why} for node in self.hello for nic in self._nics(node)]
        replies = {(p["src"], p["dst"]): p.get("replies", 0) for p in paths}

        def clean(a: str, b: str) -> bool:  # every rail between the two carries probes both ways
            nics = set(self._nics(a)) & set(self._nics(b))
            return all(replies.get((f"{a}/{n}", f"{b}/{n}"), 0) > 0 for n in nics)

        results = []
        for node in self.hello:
            nics = self._nics(node)
            for nic in nics:
                others_ok = all(f.get("operstate") == "up" and f.get("carrier") for n, f in nics.items() if n != nic)
                peers = [p for p in self.hello if p != node and self._healthy_nics(p) and clean(node, p)]
                if len(nics) < 2 or not others_ok or not peers or not nics[nic].get("carrier"):
                    why = (
                        "the node has no other NIC to move to"
                        if len(nics) < 2
                        else "another NIC of this node is down: a drill would cut the node off"
                        if not others_ok
                        else "this NIC is down already"
                        if not nics[nic].get("carrier")
                        else "no peer with a clean fabric to drill against"
                    )
                    results.append({"node": node, "nic": nic, "skipped": why})
                    continue
                req = {
                    "op": "drill",
                    "nic": nic,
                    "node_ip": self.hello[node]["node_addr"],
                    "peers": [
                        (p, self.hello[p]["node_addr"], int(self.hello[p]["echo_ports"][self.hello[p]["node_addr"]]))
                        for p in peers
                    ],
                    "run": next(self._runs),
                    "timeout_s": self.cfg.drill_timeout_s,
                }
                self._wait_settled()
                answer = self.ask({node: req}, self.cfg.step_timeout_s + 3 * self.cfg.drill_timeout_s)[node]
                answer.pop("id", None)
                results.append({"node": node, **answer, "nic": nic})
        return results

    # ----- the audit --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.time()
        try:
            t0 = time.monotonic()
            self._start_workers()
            self.timings["start_s"] = time.monotonic() - t0
            rails = self._rails()
            t0 = time.monotonic()
            paths, received = self._round_probes(rails)
            self.timings["probes_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            mtu = self._round_mtu(rails)
            self.timings["mtu_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            bandwidth = self._round_bandwidth(rails, paths, mtu)
            self.timings["bandwidth_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            drills = self._round_drills(paths) if self.drill else []
            self.timings["drills_s"] = time.monotonic() - t0
        finally:
            self.close()
        return {
            "started_at": started,
            "ended_at": time.time(),
            "nodes": list(self.launch.nodes),
            "node_reports": self.hello,
            "probes": paths,
            "echo_received": received,
            "mtu": mtu,
            "bandwidth": bandwidth,
            "drills": drills,
            "drill_requested": self.drill,
            "linkpass_down": self.linkpass_down,
            "timings": self.timings,
            "srun_output": self._srun_output() if len(self.hello) < len(self.launch.nodes) else "",
        }

    def close(self) -> None:
        for node in self.hello:
            try:
                self.sock.send_multipart([node.encode(), msgpack.packb({"op": "done"})])
            except zmq.ZMQError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=10)
        self.sock.close(0)
        self.context.term()


def default_listen(first_node_addr: str) -> str:
    """Where workers can reach us: our address on the route to the first node."""
    try:
        return route_source(first_node_addr)
    except OSError as exc:
        raise AuditError(f"cannot find a local address that reaches {first_node_addr}: {exc} (use --listen)") from exc


def srun_path(bin_dir: str) -> str:
    return str(Path(bin_dir) / "srun") if bin_dir else "srun"
