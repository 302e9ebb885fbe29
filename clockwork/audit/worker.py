"""The audit worker: one per node, started by the driver through ``srun`` (``python -m clockwork.audit.worker``).

It connects to the driver (``CW_AUDIT_DRIVER``, a ``tcp://`` address) with CURVE keys derived from
the audit's secret (``CW_AUDIT_KEY``, in the environment srun passes on, never on a command line),
says hello with its node's own checks, then answers the driver's requests one at a time until told
``done``. Requests it does not understand are answered with an error, never a crash: the driver decides.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import msgpack
import zmq

from clockwork.audit import drill, measure
from clockwork.audit.node_checks import node_report
from clockwork.contracts.config import load_config
from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import expand, local_node_name
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.jobkey import JobKey
from linkpass.fabric import FabricMap

log = logging.getLogger("clockwork.audit")

ENV_DRIVER = "CW_AUDIT_DRIVER"  # not CLOCKWORK_*: that prefix is the configuration's
ENV_KEY = "CW_AUDIT_KEY"
IDLE_TIMEOUT_S = 900.0


class Worker:
    """Serves one node's measurements to the driver."""

    def __init__(self, node: str, fabric: FabricMap, report: dict[str, Any], daemon_cfg: DaemonConfig) -> None:
        self.node = node
        self.daemon_cfg = daemon_cfg
        me = fabric.node(node)
        self.nics = dict(me.nics)
        bindings: list[tuple[str, str | None]] = [(ip, nic) for nic, ip in self.nics.items()]
        self.echo = measure.EchoServer([*bindings, (me.addr, None)])
        self.sink = measure.Sink(bindings)
        self.report = report
        self.report["echo_ports"] = self.echo.ports()
        self.report["sink_ports"] = self.sink.ports()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "probe":
            targets = [measure.Target.from_dict(t) for t in req["targets"]]
            return {"paths": measure.probe(targets, req["run"], req["count"], req["interval_s"])}
        if op == "echo_counts":
            return {"received": self.echo.received(req["run"])}
        if op == "mtu":
            targets = [measure.Target.from_dict(t) for t in req["targets"]]
            return {"paths": measure.mtu_check(targets, req["mtu"], req["tries"], req["run"])}
        if op == "transfer":
            return measure.transfer(measure.Target.from_dict(req["target"]), req["seconds"])
        if op == "linkpass":  # LinkPass's state of every path of this node (the driver waits for a settled fabric)
            return {"paths": self.all_paths()}
        if op == "linkpass_running":  # asked once before the drills: a drill without LinkPass only cuts a link
            return {"not_running": self.linkpass_not_running()}
        if op == "drill":
            peers = [(name, ip, int(port)) for name, ip, port in req["peers"]]
            return drill.run_drill(req["nic"], req["node_ip"], peers, req["run"], req["timeout_s"], self.all_paths)
        return {"error": f"unknown request {op!r}"}

    def linkpass_not_running(self) -> str:
        """Why LinkPass is not running on this node ("" when it is)."""
        try:
            with DaemonClient.from_config(self.daemon_cfg, self.node) as client:
                linkpass = client.status().get("linkpass")
        except ClockworkError as exc:
            return f"clockworkd does not answer on {self.node} ({exc})"
        if not isinstance(linkpass, dict) or linkpass.get("enabled") is False:
            state = linkpass.get("state") if isinstance(linkpass, dict) else None
            return f"clockworkd on {self.node} runs no LinkPass ({state or 'not configured'})"
        return ""

    def all_paths(self) -> dict[str, dict[str, str]]:
        """peer -> rail -> LinkPass's state of that path (alive, holddown, dead: ...); empty if unknown."""
        try:
            with DaemonClient.from_config(self.daemon_cfg, self.node) as client:
                paths = (client.status().get("linkpass") or {}).get("paths") or {}
        except ClockworkError as exc:
            log.warning("node %s: cannot read LinkPass's paths: %s", self.node, exc)
            return {}
        return {str(p): {str(k): str(v) for k, v in (r or {}).items()} for p, r in paths.items()}

    def close(self) -> None:
        self.echo.close()
        self.sink.close()


def serve(driver: str, key: JobKey) -> int:
    """Say hello, then answer requests until ``done`` (exit 0) or the driver goes quiet (exit 1)."""
    cfg = load_config().config
    node = os.environ.get("SLURMD_NODENAME") or local_node_name(cfg.daemon)
    fabric = FabricMap.load(expand(cfg.linkpass.fabric_file, node))
    me = fabric.node(node)
    worker = Worker(node, fabric, node_report(cfg, node, dict(me.nics), me.addr), cfg.daemon)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 1000
    sock.identity = node.encode()
    key.connect_as_client(sock)
    sock.connect(driver)
    try:
        sock.send(msgpack.packb({"op": "hello", **worker.report}, default=str))
        while True:
            if not sock.poll(int(IDLE_TIMEOUT_S * 1000)):
                log.error("node %s: the audit driver went quiet for %.0f s; leaving", node, IDLE_TIMEOUT_S)
                return 1
            try:
                req = msgpack.unpackb(sock.recv(), raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                log.warning("node %s: dropped a malformed audit request: %s", node, exc)
                continue
            if not isinstance(req, dict):
                continue
            if req.get("op") == "done":
                return 0
            try:
                reply = worker.handle(req)
            except (KeyError, TypeError, ValueError, OSError) as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            sock.send(msgpack.packb({"id": req.get("id"), **reply}, default=str))
    finally:
        worker.close()
        sock.close()
        context.term()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    driver = os.environ.get(ENV_DRIVER, "")
    secret = os.environ.get(ENV_KEY, "")
    if not driver or not secret:
        print(
            f"clockwork audit worker: {ENV_DRIVER} and {ENV_KEY} must be set (the driver starts workers)",
            file=sys.stderr,
        )
        return 2
    return serve(driver, JobKey.from_hex(secret, where=ENV_KEY))


if __name__ == "__main__":
    sys.exit(main())
