"""Snapshots staged through an arena smaller than the rank's share (``snapshot_arena_max``).

* The writer: a shard written a window at a time (windows that cut entries anywhere, a window of one page, and
  one larger than the share) has the same index, CRC-32s and bytes as the whole-arena writer's, read back by the
  store's reader; a rank that goes away mid-shard fails the shard, and nothing is renamed into place.
* The real path: a :class:`torchpass.snapshot.Snapshotter` with a 64 KiB cap and its writer process snapshot a
  model with Adam whose state is many times larger, while training goes on right after each capture (the
  optimizer step waits for the last window): every snapshot restores bitwise equal to the state at its step, the
  arena stays at the cap, and the shard equals a whole-arena snapshot of the same state entry for entry.
"""

from __future__ import annotations

import mmap
import os
import queue
import zlib
from pathlib import Path

import numpy as np
import pytest

from clockwork.contracts.errors import ConfigError
from clockwork.contracts.snapshots.messages import Entry, PieceReady, WriteRequest, pieces
from clockwork.contracts.snapshots.store import file_entries, list_snapshots, read_entries, shard_name
from clockwork.contracts.snapshots.writer import write_shard, write_shard_windowed
from tests.unit.test_snapshot_store import LOG, Events, Trainer, restore_into, same
from tests.unit.test_snapshot_writer import arena  # noqa: F401  (the fixture)
from torchpass.config import TorchPassConfig
from torchpass.snapshot import Snapshotter

PAGE = 4096


def _read_back(path: Path) -> tuple[dict[str, dict[str, object]], dict[str, np.ndarray]]:
    entries = file_entries(path)
    body = {"files": {path.name: {"size": path.stat().st_size, "entries": entries}}}
    return entries, read_entries(path.parent, body)


def _windowed(source: mmap.mmap, entries: list[Entry], window: int, path: Path) -> list[int]:
    """Write ``entries`` of ``source`` through a ``window``-byte arena, filling it piece by piece as a rank
    does; the pieces written, in order."""
    fd = os.open("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, window)
    small = mmap.mmap(fd, window)
    os.close(fd)
    cuts = pieces(entries, window)
    done: list[int] = []

    def ready(index: int) -> None:
        lo, hi = cuts[index]
        small[: hi - lo] = source[lo:hi]

    write_shard_windowed(small, path, entries, window, ready, done.append)
    return done


@pytest.mark.parametrize("window", [PAGE, 3 * PAGE, 1 << 20, 64 << 20], ids=["page", "3-pages", "1MiB", "larger"])
def test_a_windowed_shard_equals_the_whole_arena_shard(
    arena: tuple[mmap.mmap, list[Entry]],  # noqa: F811
    tmp_path: Path,
    window: int,
) -> None:
    source, entries = arena
    whole, windowed = tmp_path / "whole.h5", tmp_path / "windowed.h5"
    write_shard(source, whole, entries, direct=False)
    written = _windowed(source, entries, window, windowed)
    assert written == list(range(len(pieces(entries, window))))
    index_whole, data_whole = _read_back(whole)
    index_windowed, data_windowed = _read_back(windowed)
    assert index_windowed == index_whole  # offsets, sizes, CRC-32s, dtypes, shapes
    for e in entries:
        expected = source[e.offset : e.offset + e.nbytes]
        assert data_windowed[e.name].tobytes() == expected == data_whole[e.name].tobytes(), e.name
        assert index_windowed[e.name]["crc32"] == zlib.crc32(expected) & 0xFFFFFFFF


def test_a_rank_gone_mid_shard_fails_it_and_leaves_no_shard(
    arena: tuple[mmap.mmap, list[Entry]],  # noqa: F811
    tmp_path: Path,
) -> None:
    source, entries = arena
    path = tmp_path / "rank-00000.h5"

    def ready(index: int) -> None:
        if index == 2:
            raise ValueError("the rank went away before piece 2")

    with pytest.raises(ValueError, match="before piece 2"):
        write_shard_windowed(source, path, entries, PAGE, ready, lambda i: None)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_the_wire_carries_the_window_and_the_pieces() -> None:
    entries = (Entry("a", 0, 10_000, "torch.uint8", (10_000,)), Entry("b", 12_288, 5, "torch.uint8", (5,)))
    request = WriteRequest(1, "/proc/1/fd/3", 9, "/tmp/x", 0, entries, window=2 * PAGE)
    again = WriteRequest.from_line(request.to_line())
    assert again == request and again.pieces() == [(0, 8192), (8192, 12_293)]
    assert WriteRequest.from_line(WriteRequest(1, "p", 9, "f", 0, entries).to_line()).pieces() == [(0, 12_293)]
    assert PieceReady.from_line(PieceReady(1, 4).to_line()) == PieceReady(1, 4)
    with pytest.raises(ValueError, match="multiple of 4096"):
        WriteRequest.from_line(request.to_line().replace('"window": 8192', '"window": 100'))


def test_the_cap_is_checked_as_a_size() -> None:
    assert TorchPassConfig().snapshot_arena_max == "32G"
    assert TorchPassConfig(snapshot_arena_max="0").snapshot_arena_max == "0"
    with pytest.raises(ConfigError, match="snapshot_arena_max: at least one 4 KiB page"):
        TorchPassConfig(snapshot_arena_max="100")
    with pytest.raises(ConfigError, match="snapshot_arena_max"):
        TorchPassConfig(snapshot_arena_max="lots")


def _snapshotter(directory: Path, events: Events, cap: str) -> Snapshotter:
    return Snapshotter(TorchPassConfig(snapshot_dir=str(directory), snapshot_arena_max=cap), LOG, events)


def test_a_state_larger_than_the_arena_snapshots_and_restores_bitwise_while_training_goes_on(tmp_path: Path) -> None:
    """Width 256: ~0.8 MiB of parameters and Adam state through a 64 KiB arena (13+ windows a snapshot). Each
    step starts right after the capture; its optimizer step waits for the last window (before_update)."""
    events = Events()
    snaps = _snapshotter(tmp_path / "windowed", events, "64K")
    trainer = Trainer(width=256)
    states = {}
    arena_sizes = set()
    try:
        for _ in range(12):
            trainer.step(snaps)
            state = trainer.state()
            if snaps.capture(trainer.parts, trainer.done, 0, 1):
                states[trainer.done] = state
                arena_sizes.add(snaps.arena_bytes)
        assert snaps.wait(60)
        trainer.step(snaps)  # and one more, snapshotted both ways, for the file comparison
        states[trainer.done] = trainer.state()
        assert snaps.capture(trainer.parts, trainer.done, 0, 1) and snaps.wait(60)
        snaps.before_update()
        whole_events = Events()
        whole = _snapshotter(tmp_path / "whole", whole_events, "0")
        try:  # the same state through a whole-share arena
            assert whole.capture(trainer.parts, trainer.done, 0, 1) and whole.wait(60)
            assert whole.arena_bytes > 10 * 65536
        finally:
            whole.close()
    finally:
        snaps.close()
    assert not events.of("torchpass.snapshot_failed"), events.of("torchpass.snapshot_failed")
    assert arena_sizes == {65536}, arena_sizes
    complete = [info for info in list_snapshots(tmp_path / "windowed") if info.complete]
    assert complete and [i.step for i in complete] == [e["step"] for e in events.of("torchpass.snapshot_written")][-3:]
    for info in complete:
        step, fresh = restore_into(info.path, events, width=256)
        assert step == info.step and same(fresh.state(), states[info.step]), f"snapshot of step {step} differs"
    assert complete[-1].step == trainer.done
    last = complete[-1].path / shard_name(0)
    (reference,) = [i.path for i in list_snapshots(tmp_path / "whole") if i.complete]
    index, data = _read_back(last)
    whole_index, whole_data = _read_back(reference / shard_name(0))
    tensors = [n for n in index if n.startswith("t/")]
    assert len(tensors) > 8 and {n: index[n] for n in tensors} == {n: whole_index[n] for n in tensors}
    assert all(data[n].tobytes() == whole_data[n].tobytes() for n in tensors)


def test_the_optimizer_step_waits_for_the_last_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot thread is held at its second window until the next step is at its optimizer step; that step
    runs only once every window was copied, and the snapshot is the state of its step."""
    from torchpass.snapshot import windowed as windowed_module

    gate: queue.Queue[None] = queue.Queue()
    copied: list[int] = []
    real_copy = windowed_module.WindowedStaging.copy

    def held(self: windowed_module.WindowedStaging, into: object, index: int) -> None:
        if index == 1:
            gate.get(timeout=60)
        real_copy(self, into, index)  # type: ignore[arg-type]
        copied.append(index)

    monkeypatch.setattr(windowed_module.WindowedStaging, "copy", held)
    events = Events()
    snaps = _snapshotter(tmp_path, events, "64K")
    trainer = Trainer(width=256)
    real_before = snaps.before_update
    at_step: list[int] = []

    def before_update() -> None:
        gate.put(None)  # the snapshot thread goes on only now, while this step is about to update
        real_before()
        at_step.append(len(copied))

    try:
        trainer.step(snaps)
        state = trainer.state()
        assert snaps.capture(trainer.parts, trainer.done, 0, 1)
        monkeypatch.setattr(snaps, "before_update", before_update)
        trainer.step(snaps)
        assert snaps.wait(60)
    finally:
        snaps.close()
    assert at_step == [len(copied)] and len(copied) > 8, (at_step, copied)
    (info,) = [i for i in list_snapshots(tmp_path) if i.complete]
    step, fresh = restore_into(info.path, events, width=256)
    assert step == 0 and same(fresh.state(), state)
