"""Slurm hostlist expressions (``node[1-3,5],gpu01``), expanded in-process by python-hostlist.

Job and node records carry their nodes as hostlist expressions. Expanding them through
``scontrol show hostnames`` costs a process per call (and needs ``SLURM_CONF``), which the daemon's
hot paths cannot afford. The one implementation is python-hostlist (a maintained library, also used by
NSC's and others' Slurm tooling); this module only fixes the rules to Slurm 22.05's ``scontrol show
hostnames`` (tests/unit/test_hostlist.py holds its output) and is what TorchPass uses too:

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

import hostlist

__all__ = ["MAX_HOSTS", "expand_hostlist"]

MAX_HOSTS: int = hostlist.MAX_SIZE
"""Refuse to expand beyond this many names: a typo like ``n[0-999999999]`` must not eat the memory."""


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order."""
    # Whitespace separates items as commas do (inside brackets it then makes an empty element: an error).
    try:
        hosts: list[str] = hostlist.expand_hostlist(re.sub(r"\s+", ",", expr), allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        if "too large" in str(exc):
            raise ValueError(f"hostlist {expr!r} expands to more than {MAX_HOSTS} names") from None
        raise ValueError(f"bad hostlist {expr!r}: {exc}") from None
    if len(hosts) > MAX_HOSTS:
        raise ValueError(f"hostlist {expr!r} expands to more than {MAX_HOSTS} names")
    return hosts
