"""``clockwork demo``: the three promises on a fresh sandbox cluster (the scenes are :mod:`clockwork.sandbox.demo`)."""

from __future__ import annotations

import click

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.sandbox.demo import run_demo


@click.command()
@click.option("--steps", default=40, show_default=True, help="Training steps of the demo job (scene 1).")
@click.option("--ft-steps", default=300, show_default=True, help="Training steps of the fault-tolerant job.")
@click.option(
    "--keep", is_flag=True, help="Leave the sandbox running afterwards (stop it with `clockwork sandbox down`)."
)
@pass_ctx
def demo(state: CliContext, steps: int, ft_steps: int, keep: bool) -> None:
    """Run the demo on a fresh 4-node sandbox cluster, then tear it down."""
    state.set("sandbox.nodes", 4)
    run_demo(state.load().config.sandbox, steps=steps, ft_steps=ft_steps, keep=keep)
