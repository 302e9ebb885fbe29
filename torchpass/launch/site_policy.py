"""What the site's configuration decides for a TorchPass job, applied once by its launcher.

The admin's ``[snapshots]`` section of clockwork.toml (:class:`clockwork.contracts.config.snapshots.SnapshotSiteConfig`,
read with Clockwork's own loader: ``$CLOCKWORK_CONFIG``, else /etc/clockwork/clockwork.toml when it exists, and
``CLOCKWORK_SNAPSHOTS_*`` variables) sets where snapshots go and how much one job may keep. The launcher (``torchpass
run``, every node's agent under Slurm) folds it into the job's configuration, which every rank receives, so no
rank reads Clockwork's configuration itself:

* ``root``: the job's ``snapshot_dir`` becomes ``ROOT/USER/{job}`` unless the job chose a folder (``--config``,
  ``CLOCKWORK_SNAPSHOT_DIR``, ``--set``): a site default, below what the user says;
* ``quota``: the job's ``snapshot_quota`` is the smaller of its own and the site's (a job can lower it, never
  raise it).

It also reads the failure-domain source once (``failure_domains``: topology.conf or a site map), so that a bad
map stops the launch with its file and line instead of every rank later. This module imports no torch.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Mapping
from pathlib import Path

from clockwork.contracts.config import load_config
from clockwork.contracts.config.snapshots import parse_size
from clockwork.contracts.errors import ClockworkError
from torchpass.config import ConfigError, TorchPassConfig
from torchpass.failure_domains import DomainError, node_domains

__all__ = ["apply_site_policy"]


def _user(env: Mapping[str, str]) -> str:
    try:
        return env.get("SLURM_JOB_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container)
        return str(os.getuid())


def apply_site_policy(cfg: TorchPassConfig, environ: Mapping[str, str] | None = None) -> TorchPassConfig:
    """``cfg`` with the site's snapshot root and quota applied (see the module docstring); ConfigError naming the
    file, key or line when the site's configuration or the failure-domain source cannot be read."""
    env = os.environ if environ is None else environ
    try:
        site = load_config(env=env).config.snapshots
        site_quota, own_quota = parse_size(site.quota, "[snapshots] quota"), parse_size(cfg.snapshot_quota, "")
    except ClockworkError as exc:
        raise ConfigError(f"torchpass: Clockwork's configuration: {exc}") from None
    try:
        node_domains(cfg.failure_domains, env)
    except DomainError as exc:
        raise ConfigError(f"torchpass config: failure_domains: {exc}") from None
    changes: dict[str, str] = {}
    if site.root and cfg.snapshot_dir == TorchPassConfig().snapshot_dir:
        changes["snapshot_dir"] = str(Path(site.root) / _user(env) / "{job}")
    if site_quota and (not own_quota or own_quota > site_quota):
        changes["snapshot_quota"] = site.quota
    return cfg.with_overrides(**changes)
