"""``clockwork audit``: is this cluster sound before it is handed over?

Runs the Fleet Audit on the chosen nodes through Slurm (one worker per node, started with srun) and prints
pass/fail per node and per link with the reason and the evidence; ``--json`` and ``--html`` for tools and
people; ``--drain`` drains the failing nodes with a ``clockwork: audit: ...`` reason. Exit status: 0 when
everything passed, 1 when the audit found faults, 7 when it could not run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from clockwork.audit import html_report
from clockwork.audit.driver import AuditError, Driver, WorkerLaunch, default_listen, srun_path
from clockwork.audit.verdict import judge
from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts.errors import ClockworkError, NeedRootError
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm import from_config


def _summary(report: dict[str, Any]) -> None:
    console = Console(width=max(120, Console().width), soft_wrap=False)
    checks = "  ".join(
        f"{c} [{'green' if r == 'pass' else 'bold red' if r == 'fail' else 'grey50'}]{r}[/]"
        for c, r in report["checks"].items()
    )
    console.print(f"checks: {checks}")
    if report["findings"]:
        table = Table(title="Findings", header_style="bold")
        for col in ("target", "check", "what was found"):
            table.add_column(col)
        for f in report["findings"]:
            table.add_row(f["target"], f["check"], f["summary"])
        console.print(table)
    passed = [n for n, v in report["nodes"].items() if v["ok"]]
    failed = [n for n, v in report["nodes"].items() if not v["ok"]]
    console.print(f"nodes passed: {', '.join(passed) or 'none'}")
    if failed:
        console.print(f"[bold red]nodes failed: {', '.join(failed)}[/]")
    timings = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in (report.get("timings") or {}).items())
    console.print(f"audit {'PASSED' if report['ok'] else 'FAILED'} ({timings})")


@click.command()
@click.option(
    "--nodes",
    "hostlist",
    metavar="HOSTLIST",
    help="Nodes to audit, a Slurm hostlist such as node[1-4]; default: this allocation's ($SLURM_JOB_NODELIST).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (raw figures included).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the HTML report.")
@click.option("--drain", is_flag=True, help="Drain every failing node with a `clockwork: audit: ...` reason.")
@click.option("--drill/--no-drill", default=None, help="Run the LinkPass drill per NIC (default: [audit] drill).")
@click.option(
    "--listen",
    metavar="ADDR",
    help="Address the workers connect back to (default: this host's address on the route to the first node).",
)
@click.option(
    "--srun-arg",
    "srun_args",
    multiple=True,
    metavar="ARG",
    help="Extra argument for srun, e.g. --srun-arg=--partition=maint (repeatable).",
)
@pass_ctx
def audit(
    state: CliContext,
    hostlist: str | None,
    as_json: bool,
    html_path: Path | None,
    drain: bool,
    drill: bool | None,
    listen: str | None,
    srun_args: tuple[str, ...],
) -> None:
    """Audit nodes and links before production: reachability, loss, delay, bandwidth, MTU, clocks, drills.

    \b
    Needs root (a drill takes NICs down; workers bind to NICs). Run it on nodes no job uses:
      salloc -N4 --exclusive clockwork audit --html audit.html
      clockwork audit --nodes node[1-4] --json > audit.json
    Exit status 0: everything passed; 1: faults found (each named with its evidence); 7: could not run.
    """
    if os.geteuid() != 0:
        raise NeedRootError("clockwork audit needs root: its drills take NICs down and its workers bind to NICs")
    loaded = state.load().config
    expr = hostlist or os.environ.get("SLURM_JOB_NODELIST", "")
    if not expr:
        raise click.UsageError("which nodes? Give --nodes HOSTLIST, or run inside an allocation (salloc -N...)")
    nodes = expand_hostlist(expr)
    if len(nodes) < 2:
        raise click.UsageError(
            f"an audit needs at least two nodes to measure links between ({expr!r} has {len(nodes)})"
        )
    if listen is None:
        backend = from_config(loaded.slurm)
        addrs = {n.name: n.addr for n in backend.nodes()}
        unknown = [n for n in nodes if n not in addrs]
        if unknown:
            raise ClockworkError(f"Slurm does not know node(s) {', '.join(unknown)}")
        listen = default_listen(addrs[nodes[0]])
    launch = WorkerLaunch(
        nodes=nodes,
        srun=srun_path(loaded.slurm.bin_dir),
        extra_args=list(srun_args),
        env={"SLURM_CONF": loaded.slurm.conf},
    )
    driver = Driver(loaded.audit, launch, listen, drill=loaded.audit.drill if drill is None else drill)
    raw = driver.run()
    report = judge(raw, loaded.audit)
    if html_path is not None:
        html_path.write_text(html_report.render(report))
    if as_json:
        click.echo(json.dumps({**report, "raw": raw}, indent=2, default=str))
    else:
        _summary(report)
        if html_path is not None:
            click.echo(f"HTML report: {html_path}")
    if drain:
        backend = from_config(loaded.slurm)
        for node, verdict in report["nodes"].items():
            if not verdict["ok"]:
                reason = f"clockwork: audit: {verdict['reasons'][0]}"[:200]
                backend.drain(node, reason)
                click.echo(f"drained {node}: {reason}", err=True)
    if not report["ok"]:
        failed = [n for n, v in report["nodes"].items() if not v["ok"]]
        raise ClockworkError(f"audit failed on {', '.join(failed)}", exit_code=1)


__all__ = ["AuditError", "audit"]
