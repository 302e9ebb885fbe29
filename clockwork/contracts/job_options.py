"""A job's ``--clockwork-ft`` and ``--clockwork-spares`` options, parsed once into a typed value.

The SPANK plugin validates the options and exports them: to the job's environment as ``CLOCKWORK_FT`` and
``CLOCKWORK_SPARES``, as ``SLURM_SPANK_CLOCKWORK_*`` under ``--export=NONE``, and to Prolog and Epilog as
``SPANK_CLOCKWORK_*``. The hooks (is this a Clockwork job?) and TorchPass's launcher and agents (which mode,
which spares) read them here, in that order of spellings, so that they always agree: ``off`` is off for
everyone, and a value the plugin would have refused is an error, not a silent default. Torch-free.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["FtMode", "JobOptions", "JobOptionsError", "SpareMode"]

_Mode = TypeVar("_Mode", "FtMode", "SpareMode")

PREFIXES = ("CLOCKWORK_", "SLURM_SPANK_CLOCKWORK_", "SPANK_CLOCKWORK_")


class JobOptionsError(ValueError):
    """An exported option holds a value the SPANK plugin does not accept (the message names it)."""


class FtMode(enum.Enum):
    """``--clockwork-ft``: off, the model-aware API, or model-transparent mode."""

    OFF = "off"
    AWARE = "aware"
    TRANSPARENT = "transparent"


class SpareMode(enum.Enum):
    """``--clockwork-spares``: no spare, a standby spare node, or a node borrowed from preemptible work."""

    NONE = "none"
    STANDBY = "standby"
    BORROW = "borrow"


@dataclass(frozen=True)
class JobOptions:
    """What the job was submitted with; ``spares`` is None when ``--clockwork-spares`` was not given."""

    ft: FtMode = FtMode.OFF
    spares: SpareMode | None = None

    @property
    def enabled(self) -> bool:
        """Whether this is a Clockwork job (``--clockwork-ft`` other than off)."""
        return self.ft is not FtMode.OFF

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobOptions:
        """The options as exported to this process (the first non-empty spelling of each wins)."""
        env = os.environ if environ is None else environ
        ft = _lookup(env, "FT")
        spares = _lookup(env, "SPARES")
        return cls(
            ft=_parse(FtMode, "FT", ft) if ft else FtMode.OFF,
            spares=_parse(SpareMode, "SPARES", spares) if spares else None,
        )

    @classmethod
    def from_registered(cls, options: Mapping[str, str]) -> JobOptions:
        """The options as the Prolog registered them with the daemon (``{"ft": "aware", "spares": "borrow"}``)."""
        return cls.from_environ({f"CLOCKWORK_{name.upper()}": value for name, value in options.items()})


def _lookup(env: Mapping[str, str], name: str) -> str:
    return next((env[p + name].strip() for p in PREFIXES if env.get(p + name, "").strip()), "")


def _parse(kind: type[_Mode], name: str, value: str) -> _Mode:
    try:
        return kind(value.lower())
    except ValueError:
        accepted = ", ".join(m.value for m in kind)
        raise JobOptionsError(f"CLOCKWORK_{name}={value!r}: expected one of {accepted}") from None
