"""The documented-field helper every configuration dataclass uses (the schema's single convention).

Kept outside the :mod:`clockworkd.config` package (whose import loads the whole schema) so that
components defining their own section (``clockworkd.lens.settings``) can use it without an import cycle.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, doc: str, *, choices: tuple[str, ...] | None = None, min: float | None = None) -> Any:
    """A documented dataclass field; ``choices``/``min`` are enforced by the loader."""
    meta: dict[str, Any] = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if min is not None:
        meta["min"] = min
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
