"""Clockwork's access to Slurm: one small interface (:class:`SlurmBackend`), two implementations.

Use :func:`make_backend`; code that needs Slurm takes a :class:`SlurmBackend` and never imports a
concrete backend, so tests and sites without pyslurm get the CLI backend transparently.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

from clockwork.contracts.config.core import SlurmConfig
from clockwork.contracts.errors import ConfigError, SlurmError
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm.backend import (
    FINISHED_JOB_STATES,
    AcctRecord,
    JobInfo,
    NodeInfo,
    SlurmBackend,
    SlurmVersion,
    node_state,
)
from clockwork.contracts.slurm.cli_backend import CliBackend, SlurmTimeoutError
from clockwork.contracts.slurm.pyslurm_backend import PyslurmBackend, pyslurm_release

__all__ = [
    "BACKEND_KINDS",
    "FINISHED_JOB_STATES",
    "AcctRecord",
    "CliBackend",
    "JobInfo",
    "NodeInfo",
    "PyslurmBackend",
    "SlurmBackend",
    "SlurmTimeoutError",
    "SlurmVersion",
    "expand_hostlist",
    "make_backend",
    "node_state",
]

_log = logging.getLogger("clockwork.slurm")

BACKEND_KINDS = ("auto", "cli", "pyslurm")


def make_backend(
    kind: str,
    slurm_conf: Path,
    bin_dir: Path | None = None,
    timeout_s: float = 30.0,
) -> SlurmBackend:
    """Build the Slurm backend for this site.

    - ``"cli"``: the client commands, always.
    - ``"pyslurm"``: libslurm through pyslurm; :class:`SlurmError` says why when that is impossible
      (not installed, fails to load, or built for another Slurm release than the site runs).
    - ``"auto"``: pyslurm when it is importable and its major.minor equals the site's Slurm
      (``sinfo --version``), otherwise the CLI, with the reason logged at INFO.

    Importing pyslurm initialises libslurm from ``SLURM_CONF``; this function sets that variable to
    ``slurm_conf`` in the process environment first.
    """
    if kind not in BACKEND_KINDS:
        raise ConfigError(f"unknown Slurm backend {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")
    cli = CliBackend(slurm_conf, bin_dir=bin_dir, timeout_s=timeout_s)
    if kind == "cli":
        return cli
    module, reason = _usable_pyslurm(cli)
    if module is not None:
        _log.info("Slurm backend: pyslurm (%s)", reason)
        return PyslurmBackend(module, cli)
    if kind == "pyslurm":
        raise SlurmError(f"the pyslurm Slurm backend was requested but cannot be used: {reason}")
    _log.info("Slurm backend: CLI, because %s", reason)
    return cli


def _usable_pyslurm(cli: CliBackend) -> tuple[ModuleType | None, str]:
    """(module, reason) when pyslurm fits this site, else (None, why not)."""
    conf = str(cli.slurm_conf)
    try:
        spec = importlib.util.find_spec("pyslurm")
    except (ImportError, ValueError) as exc:
        return None, f"pyslurm is not importable ({exc})"
    if spec is None:
        return None, "pyslurm is not importable (not installed)"
    try:
        site = cli.version()
    except SlurmError as exc:
        return None, f"the site's Slurm version is unknown ({exc})"
    if "pyslurm" in sys.modules:
        if os.environ.get("SLURM_CONF") != conf:
            return None, (
                f"pyslurm is already loaded with SLURM_CONF={os.environ.get('SLURM_CONF')!r}, "
                f"not {conf!r} (libslurm reads it once)"
            )
    else:
        os.environ["SLURM_CONF"] = conf
    try:
        module = importlib.import_module("pyslurm")
    except Exception as exc:  # ImportError, or libslurm failing in slurm_init(): report, fall back
        return None, f"pyslurm is not importable ({type(exc).__name__}: {exc})"
    try:
        built_for = pyslurm_release(module)
    except (ValueError, TypeError) as exc:
        return None, f"cannot tell which Slurm release pyslurm was built for ({exc})"
    if built_for != site[:2]:
        return None, (
            f"pyslurm is built for Slurm {built_for[0]}.{built_for[1]:02d} "
            f"but the site's libslurm is {site[0]}.{site[1]:02d}.{site[2]}"
        )
    return module, f"built for Slurm {built_for[0]}.{built_for[1]:02d}, matching the site"


def from_config(cfg: SlurmConfig) -> SlurmBackend:
    """The backend the ``[slurm]`` section asks for."""
    return make_backend(cfg.backend, Path(cfg.conf), Path(cfg.bin_dir) if cfg.bin_dir else None, cfg.timeout_s)
