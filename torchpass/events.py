"""Where TorchPass's failures, decisions and timings go: the log, and an optional event sink.

A sink is any callable ``sink(kind, fields)``. The coordinator calls its sink for every decision
(``torchpass.generation``, ``torchpass.member_failed``, ``torchpass.recovered``, ``torchpass.migrated``,
...); each rank calls its own for what it sees locally (``torchpass.step_abandoned``, ``torchpass.joined``,
...). Sinks are called synchronously but never allowed to break training: a raising sink is logged and
ignored. The daemon sink talks to ``clockworkd`` through its client only, imported lazily, so TorchPass has
no import-time dependency on the daemon (dependency direction: torchpass -> clockworkd client).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DaemonEventSink", "EventSink", "JsonlEventSink", "emit"]

EventSink = Callable[[str, dict[str, Any]], None]


def emit(sink: EventSink | None, log: logging.Logger | logging.LoggerAdapter[Any], kind: str, **fields: Any) -> None:
    """Log an event at INFO and hand it to ``sink``; a failing sink costs a warning, never the job."""
    log.info("event %s %s", kind, json.dumps(fields, sort_keys=True, default=str))
    if sink is None:
        return
    try:
        sink(kind, fields)
    except Exception as exc:  # a sink is user code or a remote daemon: it must not break recovery
        log.warning("event sink failed for %s: %s: %s", kind, type(exc).__name__, exc)


class JsonlEventSink:
    """Append each event as one JSON line ``{"time", "kind", "fields"}`` (``torchpass run --events FILE``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), "kind": kind, "fields": fields}, sort_keys=True, default=str)
        with self._lock, self.path.open("a") as out:
            out.write(line + "\n")


class DaemonEventSink:
    """Post events to this node's ``clockworkd`` (so they land in the job's event log and report).

    ``control_socket`` is the daemon's local control socket (the Slurm wiring knows it from the node's
    configuration and passes it down; TorchPass itself reads no Clockwork configuration).

    The client is created on first use; while the daemon is unreachable events are logged and dropped
    (the log still has them), because a fault-tolerance layer must not stall on its own telemetry.
    """

    def __init__(self, job_id: int, control_socket: str | Path, timeout_s: float = 2.0) -> None:
        self.job_id = job_id
        self.control_socket = Path(control_socket)
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()
        self._log = logging.getLogger("clockwork.torchpass.events")

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self._lock:
            if self._client is None:
                from clockworkd.client import DaemonClient  # lazy: torchpass -> clockworkd client only

                self._client = DaemonClient(self.control_socket, self.timeout_s)
            try:
                self._client.post_event(self.job_id, kind, fields)
            except Exception as exc:
                self._log.warning("clockworkd did not take event %s: %s", kind, exc)
