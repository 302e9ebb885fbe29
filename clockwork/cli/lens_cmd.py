"""``clockwork lens``: Fleet Lens's view of the fabric, read from live node daemons.

Every daemon holds the whole picture (each tells the others what it measures), so asking the local
daemon is enough on a real cluster. Where the nodes share one run folder (``{node}`` in ``[daemon]
run_dir``, as on the sandbox) every node's daemon that answers is asked and their views merged; from
the sandbox host no daemon is "local", so that is the only way there. ``--node`` picks daemons
explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from clockwork.cli import lens_render as render
from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts import lens_view
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_paths import expand, local_node_name
from clockwork.contracts.errors import ClockworkError, DaemonUnavailableError
from linkpass.fabric import FabricError, FabricMap

METRICS = ("p50", "min", "p99", "loss", "rtt")


def _candidates(state: CliContext, nodes: tuple[str, ...]) -> list[str]:
    loaded = state.load().config
    if nodes:
        return list(nodes)
    here = local_node_name(loaded.daemon)
    if "{node}" not in loaded.daemon.run_dir:
        return [here]
    try:
        fabric = FabricMap.load(expand(loaded.linkpass.fabric_file, here))
    except FabricError:
        return [here]
    return sorted(fabric.nodes, key=lens_view.natural_key)


def collect(state: CliContext, nodes: tuple[str, ...]) -> list[dict[str, Any]]:
    """The Lens snapshot of every daemon that answers (at least one, or an error saying who was asked)."""
    cfg = state.load().config.daemon
    asked = _candidates(state, nodes)
    snapshots: list[dict[str, Any]] = []
    problems = []
    for node in asked:
        try:
            with DaemonClient.from_config(cfg, node) as client:
                snap = client.lens()
        except ClockworkError as exc:
            problems.append(f"{node}: {exc}")
            continue
        if snap.get("enabled") is False:
            problems.append(f"{node}: Fleet Lens is off ({snap.get('state', 'not running')})")
            continue
        snapshots.append(snap)
        remote = snap.get("remote_paths")
        if remote:  # what the other daemons told this one: older than their own word, so merged first
            snapshots.append({"time": 0.0, "paths": remote})
    if not any(s.get("node") for s in snapshots):
        raise DaemonUnavailableError(
            "no Fleet Lens answered (asked " + ", ".join(asked) + "): " + "; ".join(problems)
            if problems
            else "no node daemon to ask"
        )
    return snapshots


def _console() -> Console:
    return Console(width=max(120, Console().width), soft_wrap=False)


node_option = click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NODE",
    help="Ask this node's daemon (repeatable); default: this node's, or every node's where run_dir has {node}.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group()
def lens() -> None:
    """Fleet Lens: one-way delays, loss, clock offsets and suspect links, from the live daemons."""


@lens.command()
@node_option
@json_option
@pass_ctx
def suspects(state: CliContext, nodes: tuple[str, ...], as_json: bool) -> None:
    """The links (or switch ports) Lens holds responsible for bad paths now; exit code 0 either way."""
    merged = lens_view.merge(collect(state, nodes))
    if as_json:
        click.echo(json.dumps(merged.suspects, indent=2, sort_keys=True))
        return
    if not merged.suspects:
        click.echo(f"no suspects ({len(merged.paths)} paths watched, {len(merged.bad_paths())} bad)")
        return
    _console().print(render.suspects_table(merged))


@lens.command()
@click.option("--metric", type=click.Choice(METRICS), default="p50", show_default=True, help="What each cell shows.")
@node_option
@json_option
@pass_ctx
def matrix(state: CliContext, metric: str, nodes: tuple[str, ...], as_json: bool) -> None:
    """One-way delay, loss or round trip between every pair of NICs (rows send, columns receive)."""
    merged = lens_view.merge(collect(state, nodes))
    if as_json:
        click.echo(json.dumps([merged.paths[k] for k in sorted(merged.paths)], indent=2, sort_keys=True))
        return
    _console().print(render.matrix_table(merged, metric))  # type: ignore[arg-type]


@lens.command()
@node_option
@json_option
@pass_ctx
def clock(state: CliContext, nodes: tuple[str, ...], as_json: bool) -> None:
    """Each node's clock offset to the reference clock, with its uncertainty."""
    merged = lens_view.merge(collect(state, nodes))
    if as_json:
        doc = {"reference": merged.reference, "clock": merged.clock, "loop_residual_us": merged.loop_residual_us}
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    _console().print(render.clock_table(merged))


@lens.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="PNG file to write.")
@node_option
@pass_ctx
def plot(state: CliContext, out: Path, nodes: tuple[str, ...]) -> None:
    """Heatmaps of one-way delay and loss per rail, suspects, clock offsets: one PNG."""
    written = render.plot(lens_view.merge(collect(state, nodes)), out)
    click.echo(f"wrote {written}")
