"""Clockwork's configuration: the mechanism (``fields``: documented dataclass fields and the one value check),
the schema (``schema``: every section, one dataclass each; ``core``: the sections of Clockwork's own programs;
one module per hosted component's section) and the loader (``loader``: precedence, validation).

The names below load on first use (PEP 562): importing ``clockwork.contracts.config.core`` (what a client of the
node daemon needs, a training rank's event sink among them) must not load every component's section.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clockwork.contracts.config.loader import DEFAULT_PATH, LoadedConfig, load_config, parse_assignment
    from clockwork.contracts.config.schema import ClockworkConfig, sections

__all__ = ["DEFAULT_PATH", "ClockworkConfig", "LoadedConfig", "load_config", "parse_assignment", "sections"]

_WHERE = {
    "DEFAULT_PATH": "clockwork.contracts.config.loader",
    "LoadedConfig": "clockwork.contracts.config.loader",
    "load_config": "clockwork.contracts.config.loader",
    "parse_assignment": "clockwork.contracts.config.loader",
    "ClockworkConfig": "clockwork.contracts.config.schema",
    "sections": "clockwork.contracts.config.schema",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'clockwork.contracts.config' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
