"""Snapshots taken by the real staging path and writer process, then damaged, pruned and restored.

A one-rank :class:`torchpass.snapshot.Snapshotter` in this process stages a small model with Adam and an LR
scheduler and its writer process writes real HDF5 shards; the tests then flip a byte in a tensor's data, cut
a shard short, delete or edit a manifest, and check that a damaged snapshot is never loaded (the previous
good one is, bitwise), that no good one is an error, that retention keeps the newest N, that ``clockwork
snapshot`` reports the same, and that a full disk (a real, small tmpfs) fails the snapshot loudly while the
older ones stay good.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from clockwork.cli.main import run as clockwork
from clockwork.contracts.snapshots.store import (
    entry_file_offset,
    list_snapshots,
    shard_name,
    snapshot_path,
    verify_snapshot,
)
from tests.conftest import in_ci
from torchpass.config import TorchPassConfig
from torchpass.rank.state import StateParts
from torchpass.snapshot import RestoreError, Snapshotter, restore

LOG = logging.LoggerAdapter(logging.getLogger("test.snapshot"), {})


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        self.seen.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.seen if k == kind]


class Trainer:
    """A model, Adam and a scheduler, trained a step at a time (deterministic)."""

    def __init__(self, seed: int = 0, width: int = 64) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(16, width), nn.BatchNorm1d(width), nn.Linear(width, width), nn.Linear(width, 4)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 3, 0.5)
        self.parts = StateParts(self.model, [self.opt], {"sched": self.sched})
        self.done = -1

    def step(self, snaps: Snapshotter | None = None) -> None:
        """One training step; with ``snaps``, the optimizer step first waits for its copies (as TorchPass's
        wrapped optimizer does)."""
        self.done += 1
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(self.done))
        self.model(x).pow(2).mean().backward()
        if snaps is not None:
            snaps.before_update()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()

    def state(self) -> list[torch.Tensor]:
        out = [t.clone() for t in self.model.state_dict().values()]
        for st in self.opt.state.values():
            out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
        return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def events() -> Events:
    return Events()


def make_snapshotter(directory: Path, events: Events, **settings: Any) -> Snapshotter:
    cfg = TorchPassConfig(snapshot_dir=str(directory), **settings)
    return Snapshotter(cfg, LOG, events)


@pytest.fixture
def taken(tmp_path: Path, events: Events) -> Iterator[tuple[Path, Trainer, dict[int, list[torch.Tensor]]]]:
    """Snapshots after steps 2 and 5 of a training run; the state at each, for comparison."""
    snaps = make_snapshotter(tmp_path, events)
    trainer = Trainer()
    states = {}
    try:
        for _ in range(6):
            trainer.step()
            if trainer.done in (2, 5):
                assert snaps.capture(trainer.parts, trainer.done, 0, 1)
                states[trainer.done] = trainer.state()
                assert snaps.wait(60)
    finally:
        snaps.close()
    assert [e["step"] for e in events.of("torchpass.snapshot_written")] == [2, 5]
    yield tmp_path, trainer, states


def restore_into(target: Path, events: Events, *, required: bool = True, width: int = 64) -> tuple[int | None, Trainer]:
    fresh = Trainer(seed=1, width=width)  # different weights: a restore must overwrite every byte
    step = restore(
        fresh.parts,
        target,
        required=required,
        slot=0,
        device=torch.device("cpu"),
        agree=lambda ok: ok,
        log=LOG,
        event_sink=events,
    )
    return step, fresh


def data_offset(shard: Path, name: str) -> int:
    return entry_file_offset(shard, name)


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_training_goes_on_while_the_snapshot_copies(tmp_path: Path, events: Events) -> None:
    """Parameters and Adam state are copied by the snapshot thread while the next step's forward and backward
    pass run; its optimizer step waits for that copy. Steps taken at once after each capture (no wait for
    the writer) still leave snapshots equal to the state at their step, bitwise."""
    snaps = make_snapshotter(tmp_path, events, snapshot_keep=3)
    trainer = Trainer(width=2048)  # 50 MiB of parameters and Adam state: a copy that takes a while
    states = {}
    try:
        for _ in range(20):
            trainer.step(snaps)
            state = trainer.state()  # taken first: the next step starts right after the capture
            if snaps.capture(trainer.parts, trainer.done, 0, 1):
                states[trainer.done] = state
        assert snaps.wait(60)
    finally:
        snaps.close()
    written = [e["step"] for e in events.of("torchpass.snapshot_written")]
    assert written and not events.of("torchpass.snapshot_failed")
    complete = [info for info in list_snapshots(tmp_path) if info.complete]
    assert [info.step for info in complete] == written[-3:]
    for info in complete:
        step, fresh = restore_into(info.path, events, width=2048)
        assert step == info.step and same(fresh.state(), states[info.step]), f"snapshot of step {step} differs"


def test_restore_is_bitwise(taken: tuple[Path, Trainer, dict[int, list[torch.Tensor]]], events: Events) -> None:
    directory, trainer, states = taken
    step, fresh = restore_into(directory, events)
    assert step == 5
    assert same(fresh.state(), states[5])
    assert fresh.sched.state_dict() == trainer.sched.state_dict()
    assert verify_snapshot(snapshot_path(directory, 5)) == []


@pytest.mark.parametrize(
    "damage", ["flipped-byte", "truncated", "appended", "missing-manifest", "edited-manifest", "lost-shard"]
)
def test_a_damaged_snapshot_is_never_loaded(
    damage: str, taken: tuple[Path, Trainer, dict[int, list[torch.Tensor]]], events: Events
) -> None:
    directory, _, states = taken
    newest = snapshot_path(directory, 5)
    shard = newest / shard_name(0)
    if damage == "flipped-byte":
        flip_byte(shard, data_offset(shard, "t/000000") + 3)
    elif damage == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "appended":
        with shard.open("ab") as f:
            f.write(b"\0" * 100)
    elif damage == "missing-manifest":
        (newest / "manifest.json").unlink()
    elif damage == "edited-manifest":
        text = (newest / "manifest.json").read_text()
        (newest / "manifest.json").write_text(text.replace('"step": 5', '"step": 6', 1))
    else:
        shard.unlink()
    assert verify_snapshot(newest), "verification must find the damage"
    assert verify_snapshot(snapshot_path(directory, 2)) == []
    step, fresh = restore_into(directory, events)
    assert step == 2 and same(fresh.state(), states[2])
    if damage == "missing-manifest":
        assert [i.step for i in list_snapshots(directory) if i.complete] == [2]
    else:
        rejected = events.of("torchpass.snapshot_rejected")
        assert rejected and rejected[0]["folder"] == str(newest)


def test_no_good_snapshot_is_an_error(
    taken: tuple[Path, Trainer, dict[int, list[torch.Tensor]]], events: Events, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory, _, _ = taken
    for step in (2, 5):
        shard = snapshot_path(directory, step) / shard_name(0)
        flip_byte(shard, data_offset(shard, "meta"))
    with pytest.raises(RestoreError, match="no good snapshot") as info:
        restore_into(directory, events)
    assert "step-0000000002" in str(info.value) and "step-0000000005" in str(info.value)
    with pytest.raises(RestoreError, match="no good snapshot"):  # even when restoring was only implied
        restore_into(directory, events, required=False)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(RestoreError, match="no snapshot to restore"):
        restore_into(empty, events)
    assert restore_into(empty, events, required=False)[0] is None
    assert events.of("torchpass.restore_none")


def test_restoring_one_named_snapshot(
    taken: tuple[Path, Trainer, dict[int, list[torch.Tensor]]], events: Events
) -> None:
    directory, _, states = taken
    step, fresh = restore_into(snapshot_path(directory, 2), events)
    assert step == 2 and same(fresh.state(), states[2])
    (snapshot_path(directory, 5) / "manifest.json").unlink()
    with pytest.raises(RestoreError):  # a named snapshot is that one or nothing
        restore_into(snapshot_path(directory, 5), events)


def test_retention_keeps_the_newest(tmp_path: Path, events: Events) -> None:
    stale = snapshot_path(tmp_path, 0)
    stale.mkdir(parents=True)
    (stale / shard_name(0)).write_bytes(b"half written")  # a failed attempt: no manifest
    snaps = make_snapshotter(tmp_path, events, snapshot_keep=2)
    trainer = Trainer()
    try:
        for _ in range(4):
            trainer.step()
            assert snaps.capture(trainer.parts, trainer.done, 0, 1)
            assert snaps.wait(60)
    finally:
        snaps.close()
    infos = list_snapshots(tmp_path)
    assert [(i.step, i.complete) for i in infos] == [(2, True), (3, True)]
    assert not stale.exists()


def test_busy_writer_skips_instead_of_waiting(tmp_path: Path, events: Events) -> None:
    """Rank 0 of a 2-rank snapshot waits for rank 1's shard, which never comes: the next snapshot is skipped
    (training does not wait), then the first fails loudly at its timeout and leaves no snapshot behind."""
    snaps = make_snapshotter(tmp_path, events, snapshot_timeout_s=3.0)
    trainer = Trainer()
    try:
        trainer.step(snaps)
        assert snaps.capture(trainer.parts, 0, 0, 2)
        trainer.step(snaps)
        assert not snaps.capture(trainer.parts, 1, 0, 2)
        assert events.of("torchpass.snapshot_skipped")[0]["step"] == 1
        assert snaps.wait(60)
    finally:
        snaps.close()
    failed = events.of("torchpass.snapshot_failed")
    assert failed and "rank-00001.h5" in failed[0]["error"]
    assert [(i.step, i.complete) for i in list_snapshots(tmp_path)] == [(0, False), (1, False)]
    assert (snapshot_path(tmp_path, 1) / "failed-rank-00000").exists()  # the skip is announced to rank 0


def test_a_rank_that_skipped_fails_the_snapshot_at_once(tmp_path: Path, events: Events) -> None:
    """Another rank skipped this step (its writer was busy): rank 0 does not wait snapshot_timeout_s for it."""
    folder = snapshot_path(tmp_path, 0)
    folder.mkdir(parents=True)
    (folder / "failed-rank-00001").write_text("skipped")
    snaps = make_snapshotter(tmp_path, events, snapshot_timeout_s=600.0)
    trainer = Trainer()
    try:
        trainer.step()
        assert snaps.capture(trainer.parts, 0, 0, 2)
        assert snaps.wait(60), "rank 0's writer waited for a shard announced as skipped"
    finally:
        snaps.close(timeout_s=1)
    failed = events.of("torchpass.snapshot_failed")
    assert failed and "failed-rank-00001" in failed[0]["error"]
    assert not list_snapshots(tmp_path)[0].complete


def test_clockwork_snapshot_commands(
    taken: tuple[Path, Trainer, dict[int, list[torch.Tensor]]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _, _ = taken
    assert clockwork(["snapshot", "ls", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "step-0000000002" in out and "step-0000000005" in out and out.count("complete") == 2
    assert clockwork(["snapshot", "show", "--entries", str(snapshot_path(directory, 5))]) == 0
    out = capsys.readouterr().out
    assert "step 5  ranks 1" in out and "t/000000" in out and "rank/00000/torch_cpu_rng" in out
    assert clockwork(["snapshot", "verify", str(directory)]) == 0
    assert capsys.readouterr().out.count("OK ") == 2
    shard = snapshot_path(directory, 5) / shard_name(0)
    flip_byte(shard, data_offset(shard, "t/000001"))
    assert clockwork(["snapshot", "verify", str(directory)]) == 1
    captured = capsys.readouterr()
    assert "BAD  " in captured.out and "checksum mismatch" in captured.out and "1 of 2 snapshot(s)" in captured.err
    assert clockwork(["snapshot", "rm", str(directory)]) == 2  # not a snapshot folder: refused
    assert clockwork(["snapshot", "rm", str(snapshot_path(directory, 5))]) == 0
    assert clockwork(["snapshot", "ls", "--json", str(directory)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(d["step"], d["complete"]) for d in lines] == [(2, True)]


# ----- a full disk ------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB tmpfs: room for one snapshot of the wide model, not two."""
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail("the disk-full test needs root (mount -t tmpfs) and CI must run it")
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_fails_the_snapshot_and_keeps_the_old_one(small_disk: Path, events: Events) -> None:
    snaps = make_snapshotter(small_disk, events, snapshot_keep=5)
    trainer = Trainer(width=384)  # about 1.8 MiB of model and Adam state per snapshot
    try:
        trainer.step()
        assert snaps.capture(trainer.parts, 0, 0, 1)
        first = trainer.state()
        assert snaps.wait(60)
        trainer.step()
        assert snaps.capture(trainer.parts, 1, 0, 1)  # staged at once: the disk is not the loop's problem
        assert snaps.wait(60)
        trainer.step()  # training went on; the writer is usable again
    finally:
        snaps.close()
    failed = events.of("torchpass.snapshot_failed")
    assert failed and failed[0]["step"] == 1 and "No space left" in failed[0]["error"] + str(failed)
    assert [(i.step, i.complete) for i in list_snapshots(small_disk)] in ([(0, True)], [(0, True), (1, False)])
    assert verify_snapshot(snapshot_path(small_disk, 0)) == []
    assert (
        not [p for p in snapshot_path(small_disk, 1).glob(".*tmp*")] if snapshot_path(small_disk, 1).exists() else True
    )
    step, fresh = restore_into(small_disk, events, width=384)
    assert step == 0 and same(fresh.state(), first)


# ----- where the period and the folder come from ---------------------------------------------------------


def test_period_precedence_command_line_environment_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpass.cli import _config, run_cmd
    from torchpass.config import ConfigError

    for name in ("CLOCKWORK_SNAPSHOT", "SLURM_SPANK_CLOCKWORK_SNAPSHOT", "SPANK_CLOCKWORK_SNAPSHOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CLOCKWORK_SNAPSHOT_DIR", raising=False)
    settings = tmp_path / "tp.toml"
    settings.write_text("snapshot_interval_s = 5.0\nsnapshot_dir = '/from/file'\n")

    def config(*extra: str) -> TorchPassConfig:
        return _config(run_cmd.make_context("run", ["--local", "--config", str(settings), *extra, "train.py"]).params)

    assert config().snapshot_interval_s == 5.0 and config().restore == "auto"
    monkeypatch.setenv("SLURM_SPANK_CLOCKWORK_SNAPSHOT", "20m")  # what SPANK exports under --export=NONE
    monkeypatch.setenv("CLOCKWORK_SNAPSHOT_DIR", "/from/env/{job}")
    assert config().snapshot_interval_s == 1200.0 and config().snapshot_dir == "/from/env/{job}"
    assert config("--set", "snapshot_interval_s=7").snapshot_interval_s == 7.0
    assert config("--restore", "latest").restore == "latest"
    monkeypatch.setenv("CLOCKWORK_SNAPSHOT", "off")  # the plain name wins over the SPANK_ forms
    assert config().snapshot_interval_s == 0.0
    monkeypatch.setenv("CLOCKWORK_SNAPSHOT", "often")
    with pytest.raises(ConfigError, match="CLOCKWORK_SNAPSHOT: expected off or a duration"):
        config()


def test_restore_target_and_directory() -> None:
    from torchpass.snapshot import restore_target, snapshot_directory

    cfg = TorchPassConfig(snapshot_dir="/snaps/{job}")
    assert snapshot_directory(cfg, {"SLURM_JOB_ID": "42"}) == Path("/snaps/42")
    assert snapshot_directory(cfg, {}) == Path("/snaps/local")
    assert restore_target(cfg, {"SLURM_JOB_ID": "42"}) == (None, False)  # a first start
    assert restore_target(cfg, {"SLURM_JOB_ID": "42", "SLURM_JOB_RESTART_COUNT": "0"}) == (None, False)
    assert restore_target(cfg, {"SLURM_JOB_ID": "42", "SLURM_JOB_RESTART_COUNT": "1"}) == (Path("/snaps/42"), False)
    # what Slurm itself sets in a requeued job (sbatch(1))
    assert restore_target(cfg, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}) == (Path("/snaps/42"), False)
    latest = cfg.with_overrides(restore="latest")
    assert restore_target(latest, {"SLURM_JOB_ID": "42"}) == (Path("/snaps/42"), True)
    assert restore_target(cfg.with_overrides(restore="/x/step-0000000009"), {}) == (Path("/x/step-0000000009"), True)
    never = cfg.with_overrides(restore="never")
    assert restore_target(never, {"SLURM_JOB_RESTART_COUNT": "3"}) == (None, False)
