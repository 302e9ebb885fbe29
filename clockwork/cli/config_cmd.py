"""``clockwork config``: see the effective configuration and where each value came from."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.contracts.config.example import render


@click.group()
def config() -> None:
    """Inspect Clockwork's configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def show(state: CliContext, as_json: bool) -> None:
    """Print every setting, its value and its source (default, file, environment, command line)."""
    loaded = state.load()
    rows = loaded.items()
    if as_json:
        out = {
            "file": str(loaded.path) if loaded.path else None,
            "settings": {f"{s}.{k}": {"value": v, "source": src} for s, k, v, src, _ in rows},
        }
        click.echo(json.dumps(out, indent=2))
        return
    table = Table(title=f"clockwork configuration (file: {loaded.path or 'none'})", title_justify="left")
    for col in ("setting", "value", "source"):
        table.add_column(col, overflow="fold")
    for section, key, value, source, _ in rows:
        table.add_row(f"{section}.{key}", json.dumps(value), source)
    Console(width=max(100, Console().width), soft_wrap=False).print(table)


@config.command("example")
def example() -> None:
    """Print a complete, commented configuration file (every setting at its default)."""
    click.echo(render(), nl=False)
