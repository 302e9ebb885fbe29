"""Each peer's home rail, kept across daemon restarts in a small JSON file.

Why: a daemon restarted while a route is failed over must not take the failed-over rail for home (the kernel's
route is then not the admin's). Written durably through the host's ``write_file`` (old or new content after a
crash, never half): a rename without fsync may leave an empty file after a power loss, and a daemon that then
takes the failed-over rail for home never fails back. A file that cannot be read is ignored (logged): the
routes the kernel has then give the homes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("clockwork.linkpass")

__all__ = ["load", "save"]


def load(path: Path, me: str) -> dict[str, str]:
    """Peer -> home rail as last saved; empty when there is no (usable) file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s: ignoring %s: %s", me, path, exc)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def save(path: Path, write_file: Callable[[Path, bytes], None], home: dict[str, str], me: str) -> None:
    """Record ``home`` (peer -> rail) durably; an error is logged, not raised (the routes still move)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(home, sort_keys=True).encode())
    except OSError as exc:
        log.warning("%s: cannot record the home rails in %s: %s", me, path, exc)
