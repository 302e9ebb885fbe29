"""The daemon's job registry and per-job event logs, persisted so that a crash or restart loses nothing.

Layout under the state folder::

    jobs/JOBID.json      one job record, replaced atomically (temp file, fsync, rename, fsync folder)
    events/JOBID.jsonl   the job's events, one JSON object per line, appended with a single write
                         of an O_APPEND file (in the page cache before the daemon answers) and fsync'd on
                         a thread of its own (:mod:`clockworkd.log_sync`), so a slow disk never stalls the loop

A crash can therefore leave at most a torn *last* line in an event log (the write that was under
way); loading drops it (truncating the file, so the next append starts on a fresh line) and keeps
everything before it. Unregistering a job marks it ended but keeps its events, so the Epilog may
gather them before or after it unregisters the job.

A big log is read in pages (``events(after=SEQ)``): every :data:`MARK_EVERY` events the registry notes where
in the file an event starts, so each page reads from the nearest mark on and stops when it is full, instead of
reading (and parsing) the whole log for every page.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clockwork.contracts import atomic_file
from clockworkd.log_sync import LogSync

log = logging.getLogger("clockwork.daemon")

RUNNING = "running"
ENDED = "ended"
# A job's event log may not grow past this (a runaway job must not fill the node's disk).
MAX_EVENT_LOG_BYTES = 64 * 1024 * 1024
RECENT_EVENTS = 100
#: Every this many events a log's in-memory index notes the event's offset (reading a page seeks there).
MARK_EVERY = 256
#: How much of a log one read takes while a page fills.
READ_CHUNK = 1 << 20


class UnknownJobError(LookupError):
    """No job with that id is registered on this node."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} is not registered on this node")
        self.job_id = job_id


class EventLogFullError(Exception):
    """The job's event log reached its size limit; further events are refused."""


@dataclass(frozen=True)
class JobRecord:
    """What the daemon knows about one job (from the Prolog's registration)."""

    job_id: int
    uid: int
    user: str
    nodes: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)
    state: str = RUNNING
    registered_at: float = 0.0
    ended_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "uid": self.uid,
            "user": self.user,
            "nodes": list(self.nodes),
            "options": dict(self.options),
            "state": self.state,
            "registered_at": self.registered_at,
            "ended_at": self.ended_at,
        }

    @classmethod
    def from_dict(cls, data: Any) -> JobRecord:
        """Rebuild a record from its JSON form; ValueError when a field is missing or of the wrong type."""
        try:
            record = cls(
                job_id=data["job_id"],
                uid=data["uid"],
                user=data["user"],
                nodes=tuple(data["nodes"]),
                options=dict(data["options"]),
                state=data["state"],
                registered_at=float(data["registered_at"]),
                ended_at=None if data.get("ended_at") is None else float(data["ended_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a job record: {exc}") from None
        if type(record.job_id) is not int or type(record.uid) is not int or record.state not in (RUNNING, ENDED):
            raise ValueError("not a job record: job_id/uid must be integers and state running or ended")
        return record


@dataclass
class _Log:
    """Bookkeeping of one job's event log: next sequence number, bytes used, and where some events start."""

    last_seq: int = 0
    size: int = 0
    count: int = 0  # events in the file
    marks: list[tuple[int, int]] = field(default_factory=list)  # (seq, byte offset) of every MARK_EVERY-th event

    def note(self, seq: int, offset: int) -> None:
        """An event with ``seq`` starts at ``offset``."""
        if self.count % MARK_EVERY == 0:
            self.marks.append((seq, offset))
        self.count += 1

    def start_for(self, after: int | None) -> int:
        """The offset of the last marked event with seq <= ``after`` + 1 (0: read from the start)."""
        offset = 0
        if after is not None:
            for seq, where in self.marks:
                if seq > after + 1:
                    break
                offset = where
        return offset


class Registry:
    """Jobs registered on this node and their event logs, in memory and on disk under ``state_dir``."""

    def __init__(
        self,
        state_dir: Path,
        node: str,
        *,
        clock: Callable[[], float] = time.time,
        max_log_bytes: int = MAX_EVENT_LOG_BYTES,
        sync: LogSync | None = None,
    ) -> None:
        self.node = node
        self.jobs_dir = state_dir / "jobs"
        self.events_dir = state_dir / "events"
        self._clock = clock
        self._max_log_bytes = max_log_bytes
        self._sync = LogSync() if sync is None else sync
        self._jobs: dict[int, JobRecord] = {}
        self._logs: dict[int, _Log] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        for folder in (self.jobs_dir, self.events_dir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    # ----- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read every job record and event log back (after a restart or a crash)."""
        self._jobs.clear()
        self._logs.clear()
        self._recent.clear()
        for path in sorted(self.jobs_dir.iterdir()):
            if atomic_file.is_temporary(path):
                log.info("removing %s, an unfinished job record write of an earlier run", path)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            try:
                record = JobRecord.from_dict(json.loads(path.read_bytes()))
            except (OSError, ValueError) as exc:
                log.error("node %s: job record %s unreadable, ignored: %s", self.node, path, exc)
                continue
            self._jobs[record.job_id] = record
        recent: list[dict[str, Any]] = []
        for job_id in sorted(self._jobs):
            events = self._load_log(job_id)
            if self._jobs[job_id].state == RUNNING:
                recent += events[-RECENT_EVENTS:]
        for event in sorted(recent, key=lambda e: e["time"])[-RECENT_EVENTS:]:
            self._recent.append(event)
        running = sum(1 for j in self._jobs.values() if j.state == RUNNING)
        log.info("node %s: registry loaded: %d jobs (%d running)", self.node, len(self._jobs), running)

    def _load_log(self, job_id: int) -> list[dict[str, Any]]:
        """Read one event log, dropping (and truncating away) a torn last line."""
        path = self._log_path(job_id)
        book = _Log()
        self._logs[job_id] = book
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning(
                "job %d (node %s): dropping a torn last event line (%d bytes) of %s, left by a crash",
                job_id,
                self.node,
                len(data) - end,
                path,
            )
            with open(path, "r+b") as fh:
                fh.truncate(end)
                os.fsync(fh.fileno())
            data = data[:end]
        book.size = len(data)
        events: list[dict[str, Any]] = []
        offset = 0
        for line in data.splitlines(keepends=True):
            for event in self._parse_lines(job_id, path, [line]):
                book.note(int(event["seq"]), offset)
                events.append(event)
            offset += len(line)
        if events:
            book.last_seq = max(int(e["seq"]) for e in events)
        return events

    def _parse_lines(self, job_id: int, path: Path, lines: Iterable[bytes]) -> Iterable[dict[str, Any]]:
        for number, line in enumerate(lines, 1):
            try:
                event = json.loads(line)
                if not isinstance(event, dict) or type(event.get("seq")) is not int:
                    raise ValueError("not an event record")
            except ValueError:
                log.warning("job %d (node %s): %s line %d is not an event, skipped", job_id, self.node, path, number)
                continue
            yield event

    # ----- jobs -----------------------------------------------------------------------------

    def _job_path(self, job_id: int) -> Path:
        return self.jobs_dir / f"{job_id}.json"

    def _log_path(self, job_id: int) -> Path:
        return self.events_dir / f"{job_id}.jsonl"

    def _save(self, record: JobRecord) -> None:
        atomic_file.write_bytes(
            self._job_path(record.job_id), json.dumps(record.to_dict(), sort_keys=True).encode(), mode=0o600
        )
        self._jobs[record.job_id] = record

    def get(self, job_id: int) -> JobRecord | None:
        return self._jobs.get(job_id)

    def jobs(self) -> list[JobRecord]:
        """Every known job (running and ended), by job id."""
        return [self._jobs[j] for j in sorted(self._jobs)]

    def register(
        self, job_id: int, uid: int, user: str, nodes: Iterable[str], options: dict[str, str], *, by: str = ""
    ) -> tuple[JobRecord, bool]:
        """Register a job (idempotent: the Prolog may run twice); returns the record and whether it is new.

        A job that ended and registers again (Slurm requeued it under the same id) runs again and keeps
        its earlier events.
        """
        old = self._jobs.get(job_id)
        record = JobRecord(job_id, uid, user, tuple(nodes), dict(options), RUNNING, self._clock())
        if old is not None and old.state == RUNNING:
            if old.uid != uid:
                log.warning(
                    "job %d (node %s): registered again with uid %d (was %d); taking the new owner",
                    job_id,
                    self.node,
                    uid,
                    old.uid,
                )
            record = replace(record, registered_at=old.registered_at)
            if record != old:
                self._save(record)
            return record, False
        self._save(record)
        if job_id not in self._logs:
            self._load_log(job_id)
        self.append_event(
            job_id,
            "job.registered",
            {"uid": uid, "user": user, "nodes": list(record.nodes), "options": dict(options)},
            by=by,
        )
        return record, True

    def unregister(self, job_id: int, *, by: str = "") -> JobRecord:
        """Mark a job ended (idempotent); its events stay for the Epilog and ``job_events``."""
        old = self._jobs.get(job_id)
        if old is None:
            raise UnknownJobError(job_id)
        if old.state == ENDED:
            return old
        record = replace(old, state=ENDED, ended_at=self._clock())
        self._save(record)
        self.append_event(job_id, "job.unregistered", {}, by=by)
        return record

    # ----- events ---------------------------------------------------------------------------

    def append_event(
        self, job_id: int, kind: str, fields: dict[str, Any], *, node: str | None = None, by: str = ""
    ) -> dict[str, Any]:
        """Record one event (written before returning, durable within the syncer's next round) and return it
        with its seq and time."""
        if job_id not in self._jobs:
            raise UnknownJobError(job_id)
        book = self._logs.setdefault(job_id, _Log())
        event = {
            "seq": book.last_seq + 1,
            "time": self._clock(),
            "job_id": job_id,
            "node": node or self.node,
            "kind": kind,
            "fields": fields,
            "by": by,
        }
        line = (json.dumps(event, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()
        if book.size + len(line) > self._max_log_bytes:
            raise EventLogFullError(
                f"job {job_id}: event log is full ({book.size} of {self._max_log_bytes} bytes); event {kind!r} dropped"
            )
        path = self._log_path(job_id)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a full disk: undo the partial line so the log stays parseable
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, book.size)
                raise OSError(f"short write to {path} ({written} of {len(line)} bytes)")
        finally:
            os.close(fd)
        self._sync.dirty(path, created)
        book.note(book.last_seq + 1, book.size)
        book.last_seq += 1
        book.size += len(line)
        self._recent.append(event)
        return event

    def events(
        self,
        job_id: int,
        *,
        since: float | None = None,
        after: int | None = None,
        limit: int | None = None,
        max_bytes: int | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """A job's events, oldest first, with time > ``since`` and seq > ``after``; and whether more follow.

        At most ``limit`` events and about ``max_bytes`` of them (always at least one), so a reply stays
        bounded; the caller pages on with ``after`` = the last seq. Reads the log from disk, so it works
        the same for running and ended jobs and after a restart.
        """
        if job_id not in self._jobs:
            raise UnknownJobError(job_id)
        path = self._log_path(job_id)
        book = self._logs.get(job_id)
        out: list[dict[str, Any]] = []
        used = 0
        for line in self._lines_from(path, book.start_for(after) if book is not None else 0):
            for event in self._parse_lines(job_id, path, [line]):
                if since is not None and not event.get("time", 0) > since:
                    continue
                if after is not None and not event["seq"] > after:
                    continue
                full = limit is not None and len(out) >= limit
                big = max_bytes is not None and used + len(line) > max_bytes
                if out and (full or big):
                    return out, True
                out.append(event)
                used += len(line)
        return out, False

    @staticmethod
    def _lines_from(path: Path, offset: int) -> Iterator[bytes]:
        """The complete lines of ``path`` from ``offset`` on, read a chunk at a time (a torn last line is not
        yielded: a write may be under way)."""
        try:
            fh = open(path, "rb")  # a generator: closed when it ends or is dropped
        except FileNotFoundError:
            return
        with fh:
            fh.seek(offset)
            rest = b""
            while chunk := fh.read(READ_CHUNK):
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                yield from lines

    def close(self) -> None:
        """Make every event written durable and stop the syncer's thread."""
        self._sync.close()

    def recent_events(self, limit: int = RECENT_EVENTS) -> list[dict[str, Any]]:
        """The last events recorded on this node (any job), oldest first."""
        return list(self._recent)[-limit:] if limit > 0 else []
