"""The kernel settings failover depends on: applied from configuration, and reported as they are."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("clockwork.linkpass")
PROC_SYS = Path("/proc/sys")


def parse(text: str) -> dict[str, str]:
    """``a.b=1,c.d=2`` -> {"a.b": "1", "c.d": "2"}; ValueError naming a bad item."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"sysctl item {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _path(key: str) -> Path:
    return PROC_SYS / key.replace(".", "/")


def read(keys: list[str]) -> dict[str, str | None]:
    """Current values (None where this kernel has no such setting)."""
    out: dict[str, str | None] = {}
    for key in keys:
        try:
            out[key] = _path(key).read_text().strip()
        except OSError:
            out[key] = None
    return out


def apply(wanted: dict[str, str]) -> dict[str, str]:
    """Write each setting this kernel has; returns {key: problem} for those it could not set."""
    problems = {}
    for key, value in wanted.items():
        try:
            _path(key).write_text(value)
        except FileNotFoundError:
            problems[key] = "not supported by this kernel"
        except OSError as exc:
            problems[key] = str(exc)
    for key, problem in problems.items():
        log.warning("sysctl %s not set: %s", key, problem)
    return problems
