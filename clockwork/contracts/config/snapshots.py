"""The site's snapshot policy: the ``[snapshots]`` section of clockwork.toml (one documented dataclass).

Why in the admin's file: where a cluster's jobs put their snapshots, and how much of that filesystem one job may
fill, is the site's decision, not each user's. A job's launcher (``torchpass run``) reads this section once and
gives the result to every rank in its configuration: ``root`` becomes the job's snapshot folder unless the user
chose another, and ``quota`` is a ceiling on the job's own ``snapshot_quota`` (the job's budgets are checked
against it at start, :mod:`torchpass.rank.budgets`). Sizes are bytes, or a number with a binary unit (``500G``,
``1.5T``, ``800GiB``), as Slurm writes sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clockwork.contracts.config.fields import setting
from clockwork.contracts.errors import ConfigError

__all__ = ["SnapshotSiteConfig", "parse_size"]

_SIZE = re.compile(r"(?i)^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str, where: str) -> int:
    """Bytes of ``1024``, ``500G``, ``1.5T``, ``800GiB`` (binary units); 0 for '' or '0' (none). ``where`` names the
    setting in the error."""
    if not text.strip():
        return 0
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"{where}: invalid size {text!r} (bytes, or a number with K, M, G, T or P: 500G, 1.5T)")
    return int(float(match.group(1)) * 1024 ** _POWERS[match.group(2).lower()])


@dataclass(frozen=True)
class SnapshotSiteConfig:
    """Where TorchPass snapshots go on this cluster, and how much one job may keep (torchpass run reads this)."""

    root: str = setting(
        "",
        "Site-wide snapshot root, on a filesystem every node shares (e.g. /lustre/clockwork-snapshots): a job "
        "writes its snapshots to ROOT/{user}/{job} unless it chose a folder itself (snapshot_dir, "
        "CLOCKWORK_SNAPSHOT_DIR). Empty: clockwork-snapshots/{job} in the job's working directory.",
    )
    quota: str = setting(
        "",
        "Most bytes one job's snapshots may hold at once (its snapshot_keep snapshots and the one being written): "
        "a job whose snapshots would need more is refused at start, or runs without snapshots when its budget "
        "policy is 'degrade'. A job's own snapshot_quota may only be lower. Bytes or 500G, 2T; empty: none.",
    )

    def __post_init__(self) -> None:
        parse_size(self.quota, "[snapshots] quota")
