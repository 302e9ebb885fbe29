"""The configuration schema: one dataclass per component, one TOML section per dataclass.

The sections of Clockwork's own programs are in :mod:`clockwork.contracts.config.core`, each hosted component's
in a module of its own beside it (``lens``, ``nodewatch``, ``health``, ``audit``, ``borrow``, ``snapshots``), LinkPass's
in :mod:`linkpass.settings` (linkpass imports no other Clockwork package); :class:`ClockworkConfig` puts them together.

Every field carries its documentation (``doc``) and, where the set of good values is small, the allowed
values (``choices``) or bounds (``min``). ``clockwork config show`` and ``etc/clockwork.toml`` are both
generated from, and tested against, this single source so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from clockwork.contracts.config.audit import AuditConfig
from clockwork.contracts.config.borrow import BorrowConfig
from clockwork.contracts.config.core import DaemonConfig, HooksConfig, LogConfig, SandboxConfig, SlurmConfig
from clockwork.contracts.config.fields import setting
from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.config.lens import LensConfig
from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockwork.contracts.config.snapshots import SnapshotSiteConfig
from linkpass.settings import LinkPassConfig

__all__ = ["ClockworkConfig", "sections", "setting"]


@dataclass(frozen=True)
class ClockworkConfig:
    """The whole configuration; attribute names are the TOML section names."""

    log: LogConfig = field(default_factory=LogConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    linkpass: LinkPassConfig = field(default_factory=LinkPassConfig)
    lens: LensConfig = field(default_factory=LensConfig)
    nodewatch: NodeWatchConfig = field(default_factory=NodeWatchConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    borrow: BorrowConfig = field(default_factory=BorrowConfig)
    snapshots: SnapshotSiteConfig = field(default_factory=SnapshotSiteConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def sections() -> dict[str, type]:
    """Section name -> dataclass, in the order they appear in the file."""
    return {f.name: f.default_factory for f in fields(ClockworkConfig)}  # type: ignore[misc]
