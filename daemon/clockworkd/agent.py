"""``clockworkd``: the per-node agent's entry point.

``clockworkd [--config PATH] [--foreground]`` runs the node daemon (:mod:`clockworkd.server`) until
SIGTERM or SIGINT, which close the sockets and remove the socket and pid files. It never forks:
``--foreground`` only states that explicitly (systemd ``Type=simple``). The Slurm Prolog starts it
detached itself, e.g. ``setsid -f clockworkd --config F </dev/null >>LOG 2>&1``, and knows it is up
when ``ping`` on the control socket answers. ``--check-config`` validates the configuration, prints
it and exits.

A second daemon for the same run folder exits with code 5 (``already running``) without touching the
running one; a stale pid file or socket of a dead daemon is replaced.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before numpy loads (Lens, the audit): its OpenBLAS would start one thread per core, which spin after each
# small matrix solve of the clock sync on the cores the training job needs (127 threads on a 128-core node;
# a perf profile of the 17-node sandbox put ~0.05 % of a core per daemon on it). One thread is all the daemon's
# few small solves need. An explicit setting in the daemon's environment is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from clockwork import __version__
from clockwork.contracts.config import load_config
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.logging_setup import configure_logging
from clockworkd.borrow.host import start_borrow
from clockworkd.failover.host import start_linkpass
from clockworkd.gpuhealth.host import start_health
from clockworkd.lens.host import start_lens
from clockworkd.nodewatch.host import start_nodewatch
from clockworkd.server import Daemon


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="Configuration file.")
@click.option("--check-config", is_flag=True, help="Load and validate the configuration, print it, exit.")
@click.option(
    "--foreground",
    is_flag=True,
    help="Run in the foreground (what clockworkd always does; start it with setsid to detach).",
)
@click.version_option(__version__, prog_name="clockworkd")
def agent(config_path: Path | None, check_config: bool, foreground: bool) -> None:
    """The Clockwork node agent (one per node, run as root)."""
    loaded = load_config(config_path)
    if check_config:
        for section, key, value, source, _ in loaded.items():
            click.echo(f"{section}.{key} = {value!r}  ({source})")
        return
    configure_logging(loaded.config.log, component="daemon")
    cfg = loaded.config.daemon
    paths = DaemonPaths.from_config(cfg)
    daemon = Daemon(cfg, paths)
    daemon.start()
    linkpass = start_linkpass(loaded.config.linkpass, paths, daemon)
    daemon.components["linkpass"] = linkpass
    daemon.components["lens"] = start_lens(
        loaded.config.lens, loaded.config.linkpass, paths, daemon, gray=None if isinstance(linkpass, str) else linkpass
    )
    daemon.components["nodewatch"] = start_nodewatch(loaded.config.nodewatch, cfg, paths, daemon, linkpass)
    daemon.components["health"] = start_health(loaded.config.health, paths, daemon)
    daemon.components["borrow"] = start_borrow(loaded.config.borrow, loaded.config.slurm, daemon)
    daemon.serve()


def main() -> None:
    try:
        agent.main(prog_name="clockworkd", standalone_mode=False)
    except ClockworkError as exc:
        click.echo(f"clockworkd: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
