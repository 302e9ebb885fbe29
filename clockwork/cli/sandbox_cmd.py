"""``clockwork sandbox``: a real multi-node Slurm cluster with a two-rail fabric, on this machine."""

from __future__ import annotations

import json
import os
import sys

import click
from rich.console import Console
from rich.table import Table

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts.errors import ConfigError, SandboxError
from clockwork.sandbox import gpu_faults
from clockwork.sandbox.cluster import Sandbox, require_root
from clockwork.sandbox.daemons import NodeDaemons
from clockwork.sandbox.faults import KINDS
from clockwork.sandbox.slurm_release import RELEASES, release


def _sandbox(state: CliContext) -> Sandbox:
    return Sandbox(state.load().config.sandbox)


def _say(msg: str) -> None:
    click.echo(f"  - {msg}", err=True)


@click.group()
@click.option(
    "--state", "state_dir", metavar="DIR", help="State folder of the sandbox (default /run/clockwork-sandbox)."
)
@pass_ctx
def sandbox(state: CliContext, state_dir: str | None) -> None:
    """The embedded sandbox cluster (needs root).

    \b
    Nodes node1..nodeN are network + UTS namespaces, each with NICs nic0, nic1 (one per rail; the
    switch-side ports are nI-nicR on bridge railR in namespace cw-fabric) and a stable node address.
    Slurm (munge, slurmctld, one slurmd per node, optionally slurmdbd + MariaDB) runs for real.
    """
    state.set("sandbox.state_dir", state_dir)


@sandbox.command()
@click.option("--nodes", type=int, help="Number of nodes (default 3).")
@click.option("--nics", type=int, help="NICs (rails) per node (default 2).")
@click.option("--accounting/--no-accounting", default=None, help="Start slurmdbd + MariaDB so sacct works.")
@click.option("--slurm", metavar="VERSION", help=f"Slurm release: {' or '.join(RELEASES)} (default 22.05).")
@click.option("--state", "state_dir", metavar="DIR", help="State folder (same as `sandbox --state`).")
@pass_ctx
def up(
    state: CliContext,
    nodes: int | None,
    nics: int | None,
    accounting: bool | None,
    slurm: str | None,
    state_dir: str | None,
) -> None:
    """Build the cluster and wait until every node is idle."""
    state.set("sandbox.nodes", nodes)
    state.set("sandbox.nics", nics)
    state.set("sandbox.accounting", accounting)
    state.set("sandbox.slurm", slurm)
    state.set("sandbox.state_dir", state_dir)
    box = _sandbox(state)
    seconds = box.up(progress=_say)
    cfg = box.config
    click.echo(
        f"sandbox up in {seconds:.1f} s: Slurm {cfg.slurm}, {cfg.nodes} nodes x {cfg.nics} NICs, accounting "
        f"{'on' if cfg.accounting else 'off'}, state {box.paths.root}\n"
        f'use it with: eval "$(clockwork sandbox env)"'
    )


@sandbox.command()
@click.option("--slurm", metavar="VERSION", help=f"Slurm release: {' or '.join(RELEASES)} (default 22.05).")
@pass_ctx
def prepare(state: CliContext, slurm: str | None) -> None:
    """Build what `up --slurm VERSION` needs and the host lacks, once (idempotent).

    \b
    22.05: the host's own packages (make venv installs them): nothing to build.
    24.11: a Debian 13 root with Slurm 24.11 under /var/cache/clockwork (root, network, once per machine).
    """
    state.set("sandbox.slurm", slurm)
    chosen = release(state.load().config.sandbox.slurm)
    if not chosen.from_root:
        click.echo(f"Slurm {chosen.version}: the host's own packages, nothing to build")
        return
    if not chosen.ready():
        require_root("clockwork sandbox prepare")
    seconds = chosen.ensure_root(progress=_say)
    how = f"built in {seconds:.1f} s" if seconds else "already built"
    click.echo(f"Slurm {chosen.installed()} root at {chosen.root}: {how}")


@sandbox.command()
@pass_ctx
def down(state: CliContext) -> None:
    """Stop every sandbox process; remove its namespaces, bridges, veths and mounts (also after a crash)."""
    removed = _sandbox(state).down()
    click.echo("sandbox down: removed " + (", ".join(removed) if removed else "nothing (none was running)"))


@sandbox.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(state: CliContext, as_json: bool) -> None:
    """Show nodes, addresses, NICs, Slurm states, services and active faults."""
    info = _sandbox(state).status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    if info["phase"] != "up":
        click.echo(f"no sandbox running at {info['state_dir']} (phase: {info['phase']})")
        return
    table = Table(title=f"sandbox at {info['state_dir']} (slurm.conf {info['slurm_conf']})", title_justify="left")
    for col in ("node", "node addr", "mgmt addr", "slurm", "NICs (addr -> switch port)"):
        table.add_column(col)
    for node in info["nodes"]:
        nics = ", ".join(f"{n['nic']} {n['addr']} -> {n['switch_port']}" for n in node["nics"])
        table.add_row(node["name"], node["node_addr"], node["mgmt_addr"], node["slurm_state"], nics)
    console = Console(width=max(120, Console().width))
    console.print(table)
    dead = [name for name, svc in info["services"].items() if not svc["alive"]]
    console.print(f"services: {len(info['services'])} running" + (f", DEAD: {', '.join(dead)}" if dead else ""))
    console.print("faults: " + (", ".join(f"{k}={v}" for k, v in info["faults"].items()) or "none"))


@sandbox.command()
@pass_ctx
def env(state: CliContext) -> None:
    """Print shell exports for the sandbox: eval "$(clockwork sandbox env)"."""
    click.echo(_sandbox(state).env_exports(), nl=False)


@sandbox.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("node")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctx
def exec(state: CliContext, node: str, command: tuple[str, ...]) -> None:
    """Run COMMAND on NODE (its network, hostname and /etc/hosts): sandbox exec node1 -- ip addr."""
    argv = list(command[1:] if command[0] == "--" else command)
    if not argv:
        raise click.UsageError("no command given: clockwork sandbox exec NODE -- CMD...")
    argv = _sandbox(state).exec_argv(node, argv)
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise SandboxError(f"cannot run {argv[0]}: {exc}") from None


@sandbox.command(
    epilog="\b\nExamples:\n  clockwork sandbox fault link node2 nic0 down\n"
    "  clockwork sandbox fault loss node1 nic1 1\n"
    "  clockwork sandbox fault rate node3 nic0 100mbit\n  clockwork sandbox fault mtu node2 nic1 1000\n"
    "  clockwork sandbox fault gpu node2 0 temp 95\n  clockwork sandbox fault gpu node2 0 clear\n"
    "  clockwork sandbox fault clear"
)
@click.argument("kind", type=click.Choice([*KINDS, "node", "gpu", "clear"]))
@click.argument("node", required=False)
@click.argument("nic", required=False)
@click.argument("value", required=False)
@click.argument("amount", required=False)
@pass_ctx
def fault(
    state: CliContext, kind: str, node: str | None, nic: str | None, value: str | None, amount: str | None
) -> None:
    """Inject a fault on one NIC, a node or a GPU, or clear all faults.

    \b
    link NODE NIC down|up        the node's own NIC, admin down (kernel drops its routes)
    port NODE NIC down|up        the switch-side port (node sees carrier loss)
    blackhole NODE NIC on|off    switch port stops forwarding, carrier stays up (gray failure)
    loss NODE NIC PERCENT        random drops both ways (0 = none)
    rate NODE NIC RATE|off       token-bucket limit both ways, e.g. 100mbit
    mtu NODE NIC MTU             the switch port's MTU (1500 = the fabric's, clears it)
    node NODE crash|restore      the whole node dies (every process killed, links dark) / comes back empty
    gpu NODE INDEX temp C        the node's daemon reads its GPU INDEX at C degrees (slowdown 90, shutdown 100)
    gpu NODE INDEX ecc N         ... with N volatile uncorrected ECC errors
    gpu NODE INDEX xid N         ... one XID N event (e.g. 79: fallen off the bus)
    gpu NODE INDEX clear         that GPU back to healthy
    clear                        undo every fault, restore the baseline routes, heal every GPU
    """
    box = _sandbox(state)
    if kind == "gpu":
        if not (node and nic and value):
            raise click.UsageError("`fault gpu` needs NODE INDEX temp|ecc|xid VALUE or NODE INDEX clear")
        index, injected = box.gpu_fault(node, nic, value, amount)
        what = gpu_faults.summary(injected) or "healthy"
        click.echo(f"fault gpu {node} gpu{index} = {what}")
        return
    if amount is not None:
        raise click.UsageError(f"`fault {kind}` takes at most NODE NIC VALUE")
    if kind == "node":
        action = nic
        if not node or action not in ("crash", "restore") or value:
            raise ConfigError("`fault node` needs NODE crash|restore, e.g. fault node node3 crash")
        if action == "crash":
            killed = box.crash_node(node)
            click.echo(f"node {node} crashed: {killed} processes killed, its links are dark")
        else:
            box.restore_node(node)
            click.echo(f"node {node} restored: links up, slurmd restarted (no daemons, no jobs)")
        return
    if kind == "clear":
        if node or nic or value:
            raise click.UsageError("`fault clear` takes no further arguments")
        box.clear_faults()
        click.echo("all faults cleared")
        return
    if not (node and nic and value):
        raise click.UsageError(f"`fault {kind}` needs NODE NIC VALUE, e.g. fault {kind} node1 nic0 ...")
    result = box.fault(kind, node, nic, value)
    click.echo(f"fault {result.kind} {result.node} {result.nic} = {result.value}")


@sandbox.group()
def daemons() -> None:
    """Start or stop one clockworkd per sandbox node (Fleet Lens and LinkPass without a job)."""


@daemons.command("up")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="A setting for the daemons (repeatable), e.g. --set lens.interval_ms=5.",
)
@pass_ctx
def daemons_up(state: CliContext, settings: tuple[str, ...]) -> None:
    """(Re)start the daemon of every node and wait until each answers."""
    require_root("clockwork sandbox daemons up")
    values = {}
    for item in settings:
        name, eq, value = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r}: expected SECTION.KEY=VALUE", param_hint="--set")
        values[name.strip()] = value.strip()
    for node, pid in NodeDaemons(_sandbox(state)).start_all(values).items():
        _say(f"clockworkd on {node}: pid {pid}")


@daemons.command("down")
@pass_ctx
def daemons_down(state: CliContext) -> None:
    """Stop the daemon of every node."""
    require_root("clockwork sandbox daemons down")
    NodeDaemons(_sandbox(state)).stop_all()
    _say("node daemons stopped")
