"""Where TorchPass's failures, decisions and timings go: the log, and an optional event sink.

A sink is any callable ``sink(kind, fields)``. The coordinator calls its sink for every decision
(``torchpass.generation``, ``torchpass.member_failed``, ``torchpass.recovered``, ``torchpass.migrated``,
...); each rank calls its own for what it sees locally (``torchpass.step_abandoned``, ``torchpass.joined``,
...). Sinks are called synchronously but never allowed to break training: a raising sink is logged and
ignored. The daemon sink talks to ``clockworkd`` through its client only
(:mod:`clockwork.contracts.daemon_client`), imported lazily. TorchPass imports of Clockwork only
``clockwork.contracts``, never the daemon itself (tests/unit/test_code_rules.py).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DaemonEventSink", "EventSink", "JsonlEventSink", "TeeSink", "emit", "emit_at", "tee"]

EventSink = Callable[[str, dict[str, Any]], None]


def emit(sink: EventSink | None, log: logging.Logger | logging.LoggerAdapter[Any], kind: str, **fields: Any) -> None:
    """Log an event at INFO and hand it to ``sink``; a failing sink costs a warning, never the job."""
    emit_at(logging.INFO, sink, log, kind, **fields)


def emit_at(
    level: int, sink: EventSink | None, log: logging.Logger | logging.LoggerAdapter[Any], kind: str, **fields: Any
) -> None:
    """:func:`emit` logging at ``level`` (a failed snapshot is an error, not news)."""
    log.log(level, "event %s %s", kind, json.dumps(fields, sort_keys=True, default=str))
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


def _fit(fields: dict[str, Any], limit: int) -> dict[str, Any]:
    """``fields`` with its largest values elided until its JSON fits in ``limit`` bytes (a generation of a
    job with thousands of ranks lists them all; the full event stays in the log and the events file)."""
    sizes = {key: len(json.dumps(value, default=str)) for key, value in fields.items()}
    if sum(sizes.values()) + 8 * len(sizes) <= limit:
        return fields
    out = dict(fields)
    total = sum(sizes.values()) + 8 * len(sizes)
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if total <= limit:
            break
        out[key] = f"<{sizes[key]} bytes elided; see the TorchPass log>"
        total -= sizes[key] - len(out[key])
    return out


class TeeSink:
    """Hands every event to several sinks (e.g. the ``--events`` file and the node daemon), each guarded."""

    def __init__(self, *sinks: EventSink | None) -> None:
        self.sinks = [sink for sink in sinks if sink is not None]
        self._log = logging.getLogger("clockwork.torchpass.events")

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink(kind, fields)
            except Exception as exc:  # one broken sink must not starve the others
                self._log.warning("event sink failed for %s: %s: %s", kind, type(exc).__name__, exc)


def tee(*sinks: EventSink | None) -> EventSink | None:
    """One sink for all the given ones (None when there is none, the sink itself when there is one)."""
    present = [sink for sink in sinks if sink is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else TeeSink(*present)


class DaemonEventSink:
    """Post events to this node's ``clockworkd`` (so they land in the job's event log and report).

    Where the daemon listens: ``control_socket`` when given (a node agent resolves it once and passes it to its
    ranks), else Clockwork's configuration (``config_path``, else ``$CLOCKWORK_CONFIG``) through
    :meth:`clockwork.contracts.daemon_client.DaemonClient.for_this_node`: TorchPass reads no Clockwork configuration
    itself.

    Posting happens on a background thread with a bounded queue: the coordinator emits events in the middle
    of a recovery and must never wait for its own telemetry. While the daemon is unreachable (or refuses, e.g.
    the job is not registered with it), events are dropped with a rate-limited warning; the log still has
    them. Nothing here can fail the job.
    """

    def __init__(
        self,
        job_id: int,
        control_socket: str | Path | None = None,
        *,
        config_path: str | Path | None = None,
        timeout_s: float = 2.0,
        max_queue: int = 10_000,
    ) -> None:
        self.job_id = int(job_id)
        self.control_socket = None if control_socket is None else Path(control_socket)
        self.config_path = config_path
        self.timeout_s = timeout_s
        self.max_fields_bytes = 16_384  # the daemon refuses large requests (64 KiB by default)
        self.posted = 0
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._disabled = ""
        self._log = logging.getLogger("clockwork.torchpass.events")

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if self._disabled:
            return
        self._ensure_thread()
        try:
            self._queue.put_nowait((kind, dict(fields)))
        except queue.Full:
            self._drop(kind, "the queue to clockworkd is full")

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchpass-daemon-events", daemon=True)
                self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Post what is queued (for at most ``timeout_s``) and stop the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _drop(self, kind: str, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 100 == 0:
            self._log.warning("clockworkd did not take event %s (%d dropped so far): %s", kind, self.dropped, why)

    def _client(self) -> Any:
        from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> clockworkd client only

        if self.control_socket is not None:
            return DaemonClient(self.control_socket, self.timeout_s)
        return DaemonClient.for_this_node(self.config_path, self.timeout_s)

    def _run(self) -> None:
        client: Any = None
        while True:
            item = self._queue.get()
            if item is None:
                break
            kind, fields = item
            if client is None:
                try:
                    client = self._client()  # connects nothing yet: a failure here is a setup problem
                except Exception as exc:  # clockworkd missing, or a bad Clockwork configuration
                    self._disabled = f"{type(exc).__name__}: {exc}"
                    self._log.warning("no events go to clockworkd: %s", self._disabled)
                    break
            try:
                client.post_event(self.job_id, kind, _fit(fields, self.max_fields_bytes))
                self.posted += 1
            except Exception as exc:  # unreachable, or refused: never the job's problem
                self._drop(kind, f"{type(exc).__name__}: {exc}")
        if client is not None:
            client.close()
