"""``clockwork keys``: the ZeroMQ CURVE keys that daemons present to each other (admin, once per cluster).

``clockwork keys generate --dir /etc/clockwork/curve`` makes ``daemon.key`` (public) and
``daemon.key_secret`` (secret, mode 0600); copy the folder to every node, owned by root. Daemons
accept peers presenting any public key (``*.key``) of that folder, so per-node pairs made with
``--name NODE`` work as well: put every ``NODE.key`` in every node's folder. LinkPass and Fleet Lens derive
a MAC key per pair of nodes from them (``clockwork.contracts.pairwise_keys``): with per-node pairs a node
can sign packets only as itself (docs/admin-guide.md, "Per-node keys and key rotation").
"""

from __future__ import annotations

from pathlib import Path

import click

from clockwork.contracts.curve_keys import CurveKeyError, generate
from clockwork.contracts.errors import ClockworkError


@click.group()
def keys() -> None:
    """CURVE keys of the daemon-to-daemon plane."""


@keys.command("generate")
@click.option(
    "--dir",
    "key_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the key pair, e.g. /etc/clockwork/curve (made if missing).",
)
@click.option("--name", default="daemon", show_default=True, help="File name stem: NAME.key, NAME.key_secret.")
def generate_cmd(key_dir: Path, name: str) -> None:
    """Make a CURVE key pair for the node daemons ([daemon] curve_secret_key / curve_public_key)."""
    if not name or "/" in name or name.startswith("."):
        raise ClockworkError(f"--name {name!r}: use a plain file name stem such as 'daemon' or a node name")
    try:
        public, secret = generate(key_dir, name)
    except (CurveKeyError, OSError) as exc:
        raise ClockworkError(f"keys generate: {exc}") from None
    click.echo(f"public key: {public}\nsecret key: {secret} (mode 0600: keep it root-only)")
    click.echo("install the folder on every node; the daemons accept every *.key in it")
