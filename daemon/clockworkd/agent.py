"""``clockworkd``: the per-node agent's entry point.

Today it validates the configuration the node would run with (``--check-config``); the control plane
(ZeroMQ + msgpack, peer-credential checks, job registration) is built on this entry point next.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from clockworkd import __version__
from clockworkd.config import load_config
from clockworkd.errors import ClockworkError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="Configuration file.")
@click.option("--check-config", is_flag=True, help="Load and validate the configuration, print it, exit.")
@click.version_option(__version__, prog_name="clockworkd")
def agent(config_path: Path | None, check_config: bool) -> None:
    """The Clockwork node agent (one per node, run as root)."""
    loaded = load_config(config_path)
    if check_config:
        for section, key, value, source, _ in loaded.items():
            click.echo(f"{section}.{key} = {value!r}  ({source})")
        return
    raise ClockworkError(
        "the node agent's control plane is not part of this release yet; use --check-config", exit_code=2
    )


def main() -> None:
    try:
        agent.main(prog_name="clockworkd", standalone_mode=False)
    except ClockworkError as exc:
        click.echo(f"clockworkd: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
