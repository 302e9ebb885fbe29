"""``clockwork``: the command line for users and admins.

One top-level handler turns every :class:`ClockworkError` into ``clockwork: <message>`` and its exit
code; subcommands never print errors or exit themselves (the click pattern).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from clockworkd import __version__
from clockworkd.cli.audit_cmd import audit
from clockworkd.cli.config_cmd import config
from clockworkd.cli.context import CliContext, parse_sets
from clockworkd.cli.demo_cmd import demo
from clockworkd.cli.keys_cmd import keys
from clockworkd.cli.lens_cmd import lens
from clockworkd.cli.migrate_cmd import migrate
from clockworkd.cli.node_cmd import node
from clockworkd.cli.report_cmd import report
from clockworkd.cli.sandbox_cmd import sandbox
from clockworkd.cli.simulate_cmd import simulate_cmd
from clockworkd.cli.snapshot_cmd import snapshot
from clockworkd.errors import ClockworkError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Configuration file (default: $CLOCKWORK_CONFIG, else /etc/clockwork/clockwork.toml).",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one setting (repeatable); beats the environment and the file.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log what happens underneath (debug level).")
@click.version_option(__version__, prog_name="clockwork")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, sets: tuple[str, ...], verbose: bool) -> None:
    """Clockwork for Slurm: fault tolerance for GPU training jobs.

    \b
    Precedence of settings: command line > environment (CLOCKWORK_SECTION_KEY) > file > default.
    Start with `clockwork demo`, or `clockwork sandbox up` for a cluster to play with.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    state = CliContext(config_path=config_path)
    for name, value in parse_sets(sets).items():
        state.set(name, value)
    ctx.obj = state


cli.add_command(config)
cli.add_command(sandbox)
cli.add_command(demo)
cli.add_command(node)
cli.add_command(keys)
cli.add_command(lens)
cli.add_command(migrate)
cli.add_command(simulate_cmd, name="simulate")
cli.add_command(report)
cli.add_command(audit)
cli.add_command(snapshot)


def run(argv: Sequence[str]) -> int:
    """Run the CLI in-process and return its exit code (what tests call)."""
    try:
        cli.main(args=list(argv), prog_name="clockwork", standalone_mode=False)
    except ClockworkError as exc:
        click.echo(f"clockwork: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("clockwork: aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(run(sys.argv[1:]))
