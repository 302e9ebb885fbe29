"""The sandbox's node daemons with LinkPass on or off, and whether the fabric is back at its start state.

For ``bench/linkpass_failover.py``: its trials start only from a clean fabric (every node routes its peers
through nic0, every daemon's LinkPass reports NICs up, paths alive and peers routed home), so no trial starts
half failed over.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from clockwork.sandbox.cluster import Sandbox
from clockwork.sandbox.daemons import NodeDaemons
from clockwork.sandbox.processes import wait_until
from support.owned_processes import Procs


class Daemons:
    """One clockworkd per sandbox node with LinkPass on or off: started by this harness (its own processes and
    log folder, the caller's environment but for the ``[linkpass]`` settings it sets), and asked, stopped and
    waited for through the sandbox's :class:`NodeDaemons`."""

    def __init__(self, box: Sandbox, procs: Procs, log_dir: Path) -> None:
        self.box = box
        self.procs = procs
        self.log_dir = log_dir
        self.node_daemons = NodeDaemons(box)
        self.nodes = self.node_daemons.nodes

    def linkpass(self, node: str) -> dict[str, Any]:
        return self.node_daemons.component(node, "linkpass")

    def failovers(self, node: str) -> int | None:
        value = self.linkpass(node).get("failovers")
        return value if isinstance(value, int) else None

    def clean(self, node: str) -> bool:
        """LinkPass on ``node`` is back at its start: every NIC up, every path alive, every peer routed home."""
        return linkpass_clean(self.linkpass(node))

    def start_all(self, linkpass: bool, settings: dict[str, str] | None = None) -> None:
        """Stop whatever runs, start one daemon per node with LinkPass on or off, wait until all answer.

        ``settings``: extra ``[linkpass]`` settings (key -> value), given as CLOCKWORK_LINKPASS_KEY.
        """
        self.node_daemons.stop_all()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_LINKPASS_")}
        env["CLOCKWORK_LINKPASS_ENABLED"] = "true" if linkpass else "false"
        env.update({f"CLOCKWORK_LINKPASS_{k.upper()}": v for k, v in (settings or {}).items()})
        for node in self.nodes:
            argv = self.box.exec_argv(node, [self.node_daemons.exe, "--config", str(self.box.paths.clockwork_toml)])
            self.procs.start(argv, self.log_dir / f"clockworkd-{node}.log", env)
        for node in self.nodes:

            def answers(n: str = node) -> bool:
                return self.node_daemons.pid(n) is not None

            wait_until(f"clockworkd on {node} to answer (see {self.log_dir})", answers, timeout_s=20, interval_s=0.05)
        for node in self.nodes:
            lp = self.linkpass(node)
            wanted = (True,) if linkpass else (False, None)  # a disabled LinkPass may leave its section out
            if lp.get("enabled") not in wanted:
                raise RuntimeError(f"clockworkd on {node}: status()['linkpass'] = {lp!r}, wanted enabled={linkpass}")

    def stop_all(self) -> None:
        self.node_daemons.stop_all()


def routes_on_rail0(box: Sandbox) -> bool:
    """True when every node reaches every peer's node address through nic0 only (the state at start)."""
    layout = box.layout()
    addrs = {n.node_addr for n in layout.nodes}
    for node in layout.nodes:
        try:
            out = subprocess.run(
                ["ip", "-n", node.netns, "-j", "route", "show"], capture_output=True, text=True, timeout=5
            ).stdout
            routes = json.loads(out or "[]")
        except (subprocess.TimeoutExpired, ValueError):
            return False
        seen = set()
        for route in routes:
            dst = str(route.get("dst", "")).removesuffix("/32")
            if dst not in addrs or dst == node.node_addr:
                continue
            devs = [route.get("dev")] if route.get("dev") else [h.get("dev") for h in route.get("nexthops", [])]
            if not devs or any(d != "nic0" for d in devs):
                return False
            seen.add(dst)
        if seen != addrs - {node.node_addr}:
            return False
    return True


def linkpass_clean(lp: dict[str, Any], home: str = "nic0") -> bool:
    """A LinkPass status section at its start state: NICs up, paths alive (no hold-down), routes home.

    Fields a daemon does not report are not checked (an older daemon reports fewer).
    """
    if lp.get("enabled") is not True:
        return False
    nics = lp.get("nics")
    if isinstance(nics, dict) and not all(isinstance(v, dict) and v.get("up") is True for v in nics.values()):
        return False
    paths = lp.get("paths")
    if isinstance(paths, dict) and not all(
        isinstance(rails, dict) and all(state == "alive" for state in rails.values()) for rails in paths.values()
    ):
        return False
    routes = lp.get("routes")
    return not (isinstance(routes, dict) and not all(list(rails) == [home] for rails in routes.values()))
