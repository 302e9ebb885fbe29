"""The job registry and event logs: what a restarted (or crashed) daemon finds on disk.

Every test works in its own state folder under tmp_path with a fake clock, so times are exact.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

import pytest

from clockworkd.log_sync import LogSync
from clockworkd.registry import (
    ENDED,
    MARK_EVERY,
    RUNNING,
    EventLogFullError,
    JobRecord,
    Registry,
    UnknownJobError,
)


class FakeClock:
    def __init__(self) -> None:
        self._ticks = itertools.count(1000)

    def __call__(self) -> float:
        return float(next(self._ticks))


def _registry(state: Path, **kwargs: int) -> Registry:
    reg = Registry(state, "node1", clock=FakeClock(), **kwargs)
    reg.load()
    return reg


def _kinds(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events]


def test_register_post_read(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    record, created = reg.register(7, 1000, "alice", ["node1", "node2"], {"ft": "aware"}, by="uid 0 pid 1")
    assert created
    assert record == JobRecord(7, 1000, "alice", ("node1", "node2"), {"ft": "aware"}, RUNNING, 1000.0)
    event = reg.append_event(7, "link.failover", {"nic": "nic0"}, by="uid 1000 pid 2")
    assert event == {
        "seq": 2,
        "time": 1002.0,
        "job_id": 7,
        "node": "node1",
        "kind": "link.failover",
        "fields": {"nic": "nic0"},
        "by": "uid 1000 pid 2",
    }
    events, more = reg.events(7)
    assert _kinds(events) == ["job.registered", "link.failover"]
    registered = {"uid": 1000, "user": "alice", "nodes": ["node1", "node2"], "options": {"ft": "aware"}}
    assert events[0]["fields"] == registered
    assert not more
    assert reg.get(7) == record
    assert [j.job_id for j in reg.jobs()] == [7]
    assert reg.recent_events() == events


def test_files_on_disk(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {})
    reg.append_event(7, "x", {"a": 1})
    record = json.loads((tmp_path / "jobs" / "7.json").read_text())
    assert record["uid"] == 1000
    assert record["state"] == RUNNING
    lines = (tmp_path / "events" / "7.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["job.registered", "x"]
    assert not list((tmp_path / "jobs").glob(".*.tmp"))
    assert (tmp_path / "events").stat().st_mode & 0o777 == 0o700


def test_register_is_idempotent_and_requeue_keeps_events(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    first, created = reg.register(7, 1000, "alice", ["node1"], {})
    again, created_again = reg.register(7, 1000, "alice", ["node1"], {})
    assert created and not created_again
    assert again == first
    assert _kinds(reg.events(7)[0]) == ["job.registered"]
    ended = reg.unregister(7)
    assert ended.state == ENDED and ended.ended_at is not None
    assert reg.unregister(7) == ended  # idempotent, no second event
    requeued, created = reg.register(7, 1000, "alice", ["node2"], {})
    assert created and requeued.state == RUNNING and requeued.ended_at is None
    assert _kinds(reg.events(7)[0]) == ["job.registered", "job.unregistered", "job.registered"]


def test_unknown_job(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    with pytest.raises(UnknownJobError, match="job 9 is not registered"):
        reg.append_event(9, "x", {})
    with pytest.raises(UnknownJobError):
        reg.events(9)
    with pytest.raises(UnknownJobError):
        reg.unregister(9)


def test_events_survive_unregister_and_restart(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {"ft": "aware"})
    reg.register(8, 1001, "bob", ["node1"], {})
    reg.append_event(7, "a", {"n": 1})
    reg.append_event(7, "b", {"n": 2})
    reg.unregister(7)
    before = reg.events(7)[0]

    restarted = _registry(tmp_path)
    assert [(j.job_id, j.state) for j in restarted.jobs()] == [(7, ENDED), (8, RUNNING)]
    assert restarted.get(7) == reg.get(7)
    assert restarted.events(7)[0] == before
    # Sequence numbers continue where they stopped.
    assert restarted.append_event(7, "late", {})["seq"] == before[-1]["seq"] + 1
    # Recent events after a restart are those of running jobs.
    assert {e["job_id"] for e in restarted.recent_events()} <= {7, 8}
    assert any(e["job_id"] == 8 for e in restarted.recent_events())


def test_torn_last_line_is_dropped_and_appends_continue(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {})
    reg.append_event(7, "a", {})
    log = tmp_path / "events" / "7.jsonl"
    good = log.read_bytes()
    with open(log, "ab") as fh:  # a crash in the middle of the next write
        fh.write(b'{"seq":3,"time":1.0,"kind":"tor')

    restarted = _registry(tmp_path)
    assert _kinds(restarted.events(7)[0]) == ["job.registered", "a"]
    assert log.read_bytes() == good  # truncated, so the next record starts on its own line
    restarted.append_event(7, "b", {})
    assert _kinds(_registry(tmp_path).events(7)[0]) == ["job.registered", "a", "b"]


def test_garbage_lines_and_records_are_skipped(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {})
    with open(tmp_path / "events" / "7.jsonl", "ab") as fh:
        fh.write(b"not json\n[1, 2]\n")
    reg.append_event(7, "after", {})
    (tmp_path / "jobs" / "99.json").write_text("{broken")
    (tmp_path / "jobs" / ".98.json.tmp").write_text("{half")
    restarted = _registry(tmp_path)
    assert [j.job_id for j in restarted.jobs()] == [7]
    assert _kinds(restarted.events(7)[0]) == ["job.registered", "after"]
    assert not (tmp_path / "jobs" / ".98.json.tmp").exists()


def test_paging(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {})
    for i in range(9):
        reg.append_event(7, "tick", {"i": i})
    page, more = reg.events(7, limit=4)
    assert [e["seq"] for e in page] == [1, 2, 3, 4] and more
    page, more = reg.events(7, after=4, limit=4)
    assert [e["seq"] for e in page] == [5, 6, 7, 8] and more
    page, more = reg.events(7, after=8, limit=4)
    assert [e["seq"] for e in page] == [9, 10] and not more
    since = page[0]["time"]
    assert [e["seq"] for e in reg.events(7, since=since)[0]] == [10]
    # A byte budget bounds a page too, but never returns nothing while events remain.
    page, more = reg.events(7, max_bytes=1)
    assert [e["seq"] for e in page] == [1] and more


def test_event_log_quota(tmp_path: Path) -> None:
    reg = _registry(tmp_path, max_log_bytes=600)
    reg.register(7, 1000, "alice", ["node1"], {})
    with pytest.raises(EventLogFullError, match="event log is full"):
        for _ in range(20):
            reg.append_event(7, "x", {"pad": "y" * 50})
    size = (tmp_path / "events" / "7.jsonl").stat().st_size
    assert size <= 600
    assert _registry(tmp_path, max_log_bytes=600).events(7)[0][-1]["kind"] == "x"


def test_job_record_from_dict_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        JobRecord.from_dict({"job_id": 1})
    with pytest.raises(ValueError):
        JobRecord.from_dict([1, 2])
    good = JobRecord(1, 2, "u", ("n",), {}, RUNNING, 1.0).to_dict()
    with pytest.raises(ValueError):
        JobRecord.from_dict({**good, "state": "zombie"})
    with pytest.raises(ValueError):
        JobRecord.from_dict({**good, "uid": "2"})
    assert JobRecord.from_dict(good).to_dict() == good


def test_a_slow_disk_never_holds_up_an_append(tmp_path: Path) -> None:
    """The fsync waits for the disk (here: until the test lets it go); the append, and a read of what was
    appended, do not wait for it. flush() says when everything is durable."""
    disk = threading.Event()
    synced: list[int] = []

    def slow_fsync(fd: int) -> None:
        assert disk.wait(60), "the test never released the disk"
        os.fsync(fd)
        synced.append(fd)

    reg = Registry(tmp_path, "node1", clock=FakeClock(), sync=LogSync(fsync=slow_fsync))
    reg.load()
    reg.register(7, 1000, "alice", ["node1"], {})
    for k in range(50):  # every one returns while the disk is stuck
        reg.append_event(7, "tick", {"k": k})
    events, _ = reg.events(7)
    assert [e["fields"].get("k") for e in events[1:]] == list(range(50))
    assert not synced
    disk.set()
    assert reg.events(7)[0] == events
    reg.close()  # waits for the syncer: everything written is durable now
    assert synced, "nothing was fsync'd"
    assert len(synced) < 51, "one fsync per event, where one per round was expected"


def test_an_fsync_error_is_counted_and_loses_no_written_event(tmp_path: Path) -> None:
    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    sync = LogSync(fsync=failing)
    reg = Registry(tmp_path, "node1", clock=FakeClock(), sync=sync)
    reg.load()
    reg.register(7, 1000, "alice", ["node1"], {})
    reg.append_event(7, "link.failover", {})
    assert sync.flush(30)
    assert sync.errors >= 1
    again = _registry(tmp_path)
    assert _kinds(again.events(7)[0]) == ["job.registered", "link.failover"]


@pytest.mark.parametrize("restart", [False, True])
def test_pages_of_a_big_log_match_one_read(tmp_path: Path, restart: bool) -> None:
    """Paging with after=SEQ starts at the nearest noted event (MARK_EVERY apart), in memory or rebuilt after a
    restart: the pages are exactly the whole log, at every page size, also across a torn last line."""
    reg = _registry(tmp_path)
    reg.register(7, 1000, "alice", ["node1"], {})
    total = 3 * MARK_EVERY + 17
    for k in range(total):
        reg.append_event(7, "tick", {"k": k, "pad": "x" * (k % 40)})
    if restart:
        with open(tmp_path / "events" / "7.jsonl", "ab") as fh:
            fh.write(b'{"seq": 99999, "torn')
        reg = _registry(tmp_path)
    whole, more = reg.events(7)
    assert not more and [e["seq"] for e in whole] == list(range(1, total + 2))
    for limit in (1, 7, MARK_EVERY - 1, MARK_EVERY, MARK_EVERY + 1):
        pages: list[dict] = []
        after = None
        while True:
            page, more = reg.events(7, after=after, limit=limit)
            pages += page
            if not more:
                break
            after = page[-1]["seq"]
        assert pages == whole, limit
    tail, more = reg.events(7, after=2 * MARK_EVERY + 3, limit=5)
    assert [e["seq"] for e in tail] == list(range(2 * MARK_EVERY + 4, 2 * MARK_EVERY + 9)) and more
