"""Logging for Clockwork's programs: named loggers under ``clockwork.*``, one format, one place.

Messages carry their context (job, node, rank, step) in the text the caller writes; the format adds
time, level, logger name and pid so interleaved hook and daemon logs can be told apart.
"""

from __future__ import annotations

import logging
import sys

from clockwork.contracts.config.core import LogConfig

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def configure_logging(cfg: LogConfig | None, component: str) -> None:
    """Send ``clockwork.*`` logs to the configured file (or stderr) at the configured level."""
    root = logging.getLogger("clockwork")
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler
    if cfg is not None and cfg.file:
        try:
            handler = logging.FileHandler(cfg.file)
        except OSError as exc:
            handler = logging.StreamHandler(sys.stderr)
            print(f"clockwork {component}: cannot open log file {cfg.file}: {exc}", file=sys.stderr)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel((cfg.level if cfg else "info").upper())
    root.propagate = False
