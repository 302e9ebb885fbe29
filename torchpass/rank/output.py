"""What a rank writes: its log lines (prefixed with where it is in the job) and whole lines on shared output.

Set up once per rank by :func:`torchpass.init`, before anything is logged or printed."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["LOGGER_NAME", "LOG_FORMAT", "RankLog", "configure_logging", "whole_lines_on_shared_output"]

LOGGER_NAME = "clockwork.torchpass"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class RankLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with where the rank is (slot, generation, step, worker id), read at each message
    from ``where``: the same process changes slot and generation over its life."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__(logging.getLogger(LOGGER_NAME), {})
        self.where = where

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.where()}] {msg}", kwargs


def configure_logging(level: str) -> None:
    """Show TorchPass's own log on stderr unless the script configured logging itself."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def whole_lines_on_shared_output() -> None:
    """Keep each line a rank prints one ``write()``.

    The ranks of one launcher (or node agent) share its stdout and stderr, and are started with
    ``PYTHONUNBUFFERED`` so that nothing printed is lost when a rank is killed. Unbuffered, ``print`` writes
    its text and its newline in two calls, and two ranks' lines tear into each other. Line buffering flushes
    at every newline just as promptly, and a line then reaches the pipe in one write (atomic up to
    ``PIPE_BUF``). A stream the script replaced with something else is left alone.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue
        try:
            reconfigure(line_buffering=True, write_through=False)
        except (ValueError, OSError):  # closed, or not a text stream that can be reconfigured
            continue
