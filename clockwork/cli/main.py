"""``clockwork``: the command line for users and admins.

One top-level handler turns every :class:`ClockworkError` into ``clockwork: <message>`` and its exit
code; subcommands never print errors or exit themselves (the click pattern).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from clockwork import __version__
from clockwork.cli.context import CliContext, parse_sets
from clockwork.contracts.invoke import invoke

# Subcommand -> (module, attribute). Imported when the subcommand runs: the audit, report and snapshot
# commands pull in numpy, h5py and rich (~0.4 s), which `clockwork migrate` or `node status` should not pay.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("clockwork.cli.config_cmd", "config"),
    "sandbox": ("clockwork.cli.sandbox_cmd", "sandbox"),
    "demo": ("clockwork.cli.demo_cmd", "demo"),
    "node": ("clockwork.cli.node_cmd", "node"),
    "keys": ("clockwork.cli.keys_cmd", "keys"),
    "fabric": ("clockwork.cli.fabric_cmd", "fabric"),
    "lens": ("clockwork.cli.lens_cmd", "lens"),
    "migrate": ("clockwork.cli.migrate_cmd", "migrate"),
    "simulate": ("clockwork.cli.simulate_cmd", "simulate_cmd"),
    "simulate-peer-copy": ("clockwork.cli.peer_copy_sim_cmd", "peer_copy_sim_cmd"),
    "report": ("clockwork.cli.report_cmd", "report"),
    "audit": ("clockwork.cli.audit_cmd", "audit"),
    "snapshot": ("clockwork.cli.snapshot_cmd", "snapshot"),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use (click's documented lazy-loading pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        module, attribute = SUBCOMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command), f"{module}.{attribute} is not a click command"
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


def run(argv: Sequence[str]) -> int:
    """Run the CLI in-process and return its exit code (what tests call)."""
    return invoke(cli, argv, "clockwork")


def main() -> None:
    """Console-script entry point."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
