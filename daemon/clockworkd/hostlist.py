"""Slurm hostlist expressions (``node[1-3,5],gpu01``) expanded in pure Python.

Job and node records carry their nodes as hostlist expressions. Expanding them through
``scontrol show hostnames`` costs a process per call (and needs ``SLURM_CONF``), which the daemon's
hot paths cannot afford, so this module does it in-process.

Semantics follow Slurm 22.05's ``scontrol show hostnames`` (checked against it):

- items are separated by commas or whitespace at the top level; empty items are skipped;
- ``[...]`` holds comma-separated numbers or ``lo-hi`` ranges; the width of ``lo`` is the zero padding
  (``n[08-10]`` -> n08 n09 n10, ``n[8-10]`` -> n8 n9 n10);
- several brackets in one item form a product, the first bracket varying slowest
  (``a[1-2]b[1-2]`` -> a1b1 a1b2 a2b1 a2b2);
- duplicates and order are kept.

One deliberate superset: text after the last bracket (``n[1-2]-ib``) is kept as a suffix, where
Slurm 22.05 rejects the expression. Anything else malformed raises :class:`ValueError`.
"""

from __future__ import annotations

import re

__all__ = ["MAX_HOSTS", "expand_hostlist"]

MAX_HOSTS = 1_000_000
"""Refuse to expand beyond this many names: a typo like ``n[0-999999999]`` must not eat the memory."""

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_BRACKET = re.compile(r"(\[[^\[\]]*\])")


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order."""
    hosts: list[str] = []
    for item in _split_items(expr):
        hosts.extend(_expand_item(item, len(hosts)))
    return hosts


def _split_items(expr: str) -> list[str]:
    """Split at top-level commas/whitespace; commas inside brackets belong to the range list."""
    items: list[str] = []
    current: list[str] = []
    inside = False
    for ch in expr:
        if ch == "[":
            if inside:
                raise ValueError(f"nested '[' in hostlist {expr!r}")
            inside = True
        elif ch == "]":
            if not inside:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
            inside = False
        elif ch.isspace():
            if inside:
                raise ValueError(f"whitespace inside brackets in hostlist {expr!r}")
            if current:
                items.append("".join(current))
                current = []
            continue
        elif ch == "," and not inside:
            if current:
                items.append("".join(current))
                current = []
            continue
        current.append(ch)
    if inside:
        raise ValueError(f"unclosed '[' in hostlist {expr!r}")
    if current:
        items.append("".join(current))
    return items


def _expand_item(item: str, already: int) -> list[str]:
    names = [""]
    for part in _BRACKET.split(item):
        if part.startswith("["):
            values = _expand_ranges(part[1:-1], item)
            if (already + len(names) * len(values)) > MAX_HOSTS:
                raise ValueError(f"hostlist {item!r} expands to more than {MAX_HOSTS} names")
            names = [name + value for name in names for value in values]
        elif part:
            names = [name + part for name in names]
    return names


def _expand_ranges(body: str, item: str) -> list[str]:
    values: list[str] = []
    for spec in body.split(","):
        match = _RANGE.fullmatch(spec)
        if match is None:
            raise ValueError(f"bad range {spec!r} in hostlist {item!r}")
        lo, hi = match.group(1), match.group(2)
        if hi is None:
            values.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"descending range {spec!r} in hostlist {item!r}")
        if last - first + 1 > MAX_HOSTS:
            raise ValueError(f"range {spec!r} in hostlist {item!r} has more than {MAX_HOSTS} names")
        width = len(lo)
        values.extend(f"{n:0{width}d}" for n in range(first, last + 1))
    return values
