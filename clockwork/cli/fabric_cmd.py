"""``clockwork fabric``: the fabric map and routes LinkPass needs, built from the nodes' own NIC inventories.

``clockwork fabric inventory`` on each node (as root, e.g. ``srun -N64 clockwork fabric inventory --out
/shared/inv/%n.json``... or pdsh) reports the node's stable address (the one /32 on loopback, or ``--addr``) and
its fabric NICs (``--nics``, glob patterns) with their IPv4 addresses. ``clockwork fabric init`` takes the node
list (``--nodes HOSTLIST``, else every node Slurm knows) and those inventories, checks the fabric
(:mod:`linkpass.plan`: the same rails everywhere, one subnet per rail, no address twice, node addresses off the
rails, heartbeats that fit one datagram) and writes the fabric map (LinkPass's ``fabric_file``) and the route
plan (per-peer /32s over a rail, ``src`` = the node address) as JSON. ``--apply`` then puts this node's node
address on loopback and its routes in the kernel (``ip -batch``: it needs root). The sandbox builds its fabric
with the same plan.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
from pathlib import Path
from typing import Any

import click

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts import atomic_file
from clockwork.contracts.daemon_paths import local_node_name
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm import from_config
from linkpass.fabric import FabricError
from linkpass.plan import HOME_CHOICES, Inventory, Route, plan

__all__ = ["fabric", "inventory_from_ip", "route_batch"]


@click.group()
def fabric() -> None:
    """The fabric map and per-peer routes LinkPass needs (admin)."""


def inventory_from_ip(node: str, ip_json: list[dict[str, Any]], patterns: list[str], addr: str | None) -> Inventory:
    """This node's inventory from ``ip -j -4 addr show``: the NICs matching ``patterns`` and the node address (``addr``,
    or the one non-127 /32 on loopback)."""
    nics: dict[str, str] = {}
    loopback: list[str] = []
    for link in ip_json:
        name = str(link.get("ifname", ""))
        v4 = [a for a in link.get("addr_info", []) if a.get("family") == "inet"]
        if name == "lo":
            loopback += [
                str(a["local"]) for a in v4 if a.get("prefixlen") == 32 and not str(a["local"]).startswith("127.")
            ]
        elif any(fnmatch.fnmatch(name, p) for p in patterns) and v4:
            nics[name] = f"{v4[0]['local']}/{v4[0]['prefixlen']}"
    if addr is None:
        if len(loopback) != 1:
            raise ClockworkError(
                f"{node}: expected one node address (a /32 on lo outside 127/8), found {loopback or 'none'}: "
                "give --addr"
            )
        addr = loopback[0]
    if not nics:
        raise ClockworkError(f"{node}: no NIC matching {', '.join(patterns)} has an IPv4 address")
    try:
        return Inventory.from_doc({"node": node, "addr": addr, "nics": nics}, node)
    except FabricError as exc:
        raise ClockworkError(str(exc)) from None


def route_batch(addr: str, routes: list[Route]) -> str:
    """``ip -batch`` input: the node address on loopback, then the routes."""
    return "\n".join([f"addr replace {addr}/32 dev lo"] + [r.ip_batch() for r in routes]) + "\n"


@fabric.command("inventory")
@click.option("--nics", default="ib*,nic*,eth*", show_default=True, help="Comma-separated globs of fabric NIC names.")
@click.option("--addr", default=None, help="This node's stable address (default: the one /32 on lo outside 127/8).")
@click.option("--node", default=None, help="This node's name (default: the Slurm node name of this host).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write here, not stdout.")
@pass_ctx
def inventory_cmd(state: CliContext, nics: str, addr: str | None, node: str | None, out: Path | None) -> None:
    """Report this node's node address and fabric NICs (JSON), for ``clockwork fabric init``."""
    name = node or local_node_name(state.load().config.daemon)
    try:
        shown = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ClockworkError(f"cannot list this node's addresses (ip -j -4 addr show): {exc}") from None
    inv = inventory_from_ip(name, json.loads(shown.stdout), [p.strip() for p in nics.split(",") if p.strip()], addr)
    text = json.dumps(inv.to_doc(), indent=2) + "\n"
    if out is None:
        click.echo(text, nl=False)
    else:
        atomic_file.write_text(out, text)


@fabric.command("init")
@click.option("--nodes", "hostlist", default=None, help="Slurm hostlist of the fabric's nodes (default: all Slurm's).")
@click.option(
    "--inventory",
    "inv_dir",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder of the nodes' inventories, NODE.json each (clockwork fabric inventory --out).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The fabric map to write.")
@click.option(
    "--routes",
    "routes_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The route plan to write (JSON: node -> routes).",
)
@click.option(
    "--home",
    type=click.Choice(HOME_CHOICES),
    default="first",
    show_default=True,
    help="Each peer's home rail: the first rail, or spread over the rails by node.",
)
@click.option("--apply", "apply_", is_flag=True, help="Also put this node's address and routes in its kernel (root).")
@click.option("--node", default=None, help="Which node --apply is for (default: this host's Slurm node name).")
@pass_ctx
def init_cmd(
    state: CliContext,
    hostlist: str | None,
    inv_dir: Path,
    out: Path,
    routes_out: Path | None,
    home: str,
    apply_: bool,
    node: str | None,
) -> None:
    """Build, check and write the fabric map and route plan; --apply this node's part."""
    if hostlist:
        nodes = expand_hostlist(hostlist)
    else:
        nodes = [n.name for n in from_config(state.load().config.slurm).nodes()]
    inventories = {}
    for name in nodes:
        path = inv_dir / f"{name}.json"
        if not path.exists():
            continue  # the plan's check names every node without one
        try:
            inventories[name] = Inventory.from_doc(json.loads(path.read_text()), str(path))
        except (OSError, ValueError) as exc:
            raise ClockworkError(f"{path}: unreadable: {exc}") from None
    try:
        result = plan(nodes, inventories, home)
    except FabricError as exc:
        raise ClockworkError(str(exc)) from None
    atomic_file.write_text(out, json.dumps(result.fabric, indent=2) + "\n")
    if routes_out is not None:
        atomic_file.write_text(routes_out, json.dumps(result.routes_doc(), indent=2) + "\n")
    rails = sorted(inventories[nodes[0]].nics)
    click.echo(f"fabric: {len(nodes)} nodes x {len(rails)} rails ({', '.join(rails)}) -> {out}")
    if apply_:
        me = node or local_node_name(state.load().config.daemon)
        if me not in result.routes:
            raise ClockworkError(f"--apply: {me} is not one of the fabric's nodes")
        batch = route_batch(inventories[me].addr, result.routes[me])
        done = subprocess.run(["ip", "-batch", "-"], input=batch, capture_output=True, text=True)
        if done.returncode != 0:
            raise ClockworkError(f"--apply on {me}: ip -batch failed: {done.stderr.strip()}")
        click.echo(f"applied on {me}: node address {inventories[me].addr}, {len(result.routes[me])} routes")
