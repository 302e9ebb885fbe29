"""The one configuration mechanism: documented dataclass fields (:func:`setting`) and the one check of a value
against its field (:func:`coerce`: type, choices, minimum). The daemon's schema, every component's section
(``clockwork.contracts.config.lens``) and TorchPass's :class:`torchpass.config.TorchPassConfig` use both.

Kept outside the :mod:`clockwork.contracts.config` package (whose import loads the whole schema) so that
components defining their own section can use it without an import cycle, and TorchPass without the daemon.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

__all__ = ["FieldValueError", "coerce", "expected", "setting"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class FieldValueError(ValueError):
    """A value its field does not accept; the message is ``invalid value V (expected ...)``."""


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


def expected(f: dataclasses.Field[Any]) -> str:
    """What ``f`` accepts, in words (``one of a, b``, ``an integer >= 1``, ...)."""
    choices = f.metadata.get("choices")
    if choices:
        return "one of " + ", ".join(choices)
    kind = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}[str(f.type)]
    if "min" in f.metadata:
        kind += f" >= {f.metadata['min']:g}"
    return kind


def coerce(f: dataclasses.Field[Any], raw: Any, *, text_ok: bool = True) -> Any:
    """``raw`` as the field's type, checked against its choices and minimum, or FieldValueError.

    ``text_ok``: the value may be text to parse (environment, command line); a TOML file has types of its
    own, so there ``nodes = "3"`` is an error rather than a guess. An integer is taken for a float field.
    """
    kind = str(f.type)
    value: Any = raw
    ok = True
    if isinstance(raw, str) and kind != "str" and text_ok:
        text = raw.strip().lower()
        try:
            if kind == "bool":
                value = True if text in _TRUE else False if text in _FALSE else None
                ok = value is not None
            elif kind == "int":
                value = int(text)
            elif kind == "float":
                value = float(text)
        except ValueError:
            ok = False
    elif kind == "bool":
        ok = isinstance(raw, bool)
    elif kind == "int":
        ok = isinstance(raw, int) and not isinstance(raw, bool)
    elif kind == "float":
        ok = isinstance(raw, int | float) and not isinstance(raw, bool)
        value = float(raw) if ok else raw
    elif kind == "str":
        ok = isinstance(raw, str)
    if ok and "choices" in f.metadata:
        ok = value in f.metadata["choices"]
    if ok and kind == "float":
        ok = math.isfinite(value)
    if ok and "min" in f.metadata:
        ok = value >= f.metadata["min"]
    if not ok:
        raise FieldValueError(f"invalid value {raw!r} (expected {expected(f)})")
    return value
