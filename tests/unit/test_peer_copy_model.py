"""``clockwork simulate-peer-copy``'s model: the arithmetic of a shard and its stream, when a round stalls the
step, and that the copies stop paying off once their stalls cost more than the restarts they save."""

from __future__ import annotations

import json

import pytest

from clockwork.cli.main import run
from clockwork.cli.peer_copy_model import PeerCopyInputs, peer_copy


def test_shard_host_memory_and_the_nic_share() -> None:
    result = peer_copy(PeerCopyInputs(params=70e9, gpus=1024))
    assert result.shard_gb == pytest.approx(70e9 * 12 / 1024 / 1e9)
    assert result.host_gb == pytest.approx(5 * result.shard_gb)  # 3 own copies + 2 of the neighbour's
    assert result.nic_share == pytest.approx(2 / 1024)  # 2 r / (G K): r = 1, K = 1
    two = peer_copy(PeerCopyInputs(params=70e9, gpus=1024, copies=2))
    assert two.host_gb == pytest.approx(7 * result.shard_gb) and two.stream_s > result.stream_s


def test_a_round_that_does_not_fit_stalls_the_step_and_a_longer_period_hides_it() -> None:
    slow = PeerCopyInputs(params=70e9, gpus=64, nic_gbps=5.0)  # 13 GB over 5 Gb/s: ~21 s against a 17 s step
    stalled = peer_copy(slow)
    assert not stalled.hidden and stalled.overhead > 0
    hidden = peer_copy(PeerCopyInputs(params=70e9, gpus=64, nic_gbps=5.0, every_steps=4))
    assert hidden.hidden and hidden.overhead == 0
    assert hidden.redo_steps > stalled.redo_steps - 1  # a longer period costs more recomputation per crash


def test_sync_pays_the_whole_round_every_step_and_redoes_only_the_step_in_progress() -> None:
    overlapped = peer_copy(PeerCopyInputs(params=7e9, gpus=64))
    sync = peer_copy(PeerCopyInputs(params=7e9, gpus=64, sync=True))
    assert overlapped.hidden and overlapped.overhead == 0 and not sync.hidden
    assert sync.overhead == pytest.approx(sync.stream_s / sync.step_s) and sync.overhead > 0
    assert sync.host_gb == pytest.approx(4 * sync.shard_gb)  # 2 own copies + 2 of the neighbour's
    assert sync.redo_steps == pytest.approx(0.5 * (1 + sync.overhead))  # half the step in progress, its round too
    assert overlapped.redo_steps == pytest.approx(0.5 + overlapped.stream_s / overlapped.step_s)  # and the window
    with pytest.raises(ValueError, match="needs every_steps = 1"):
        peer_copy(PeerCopyInputs(params=7e9, gpus=64, sync=True, every_steps=5))


def test_copies_pay_off_at_the_defaults_and_not_when_their_stalls_dominate() -> None:
    assert peer_copy(PeerCopyInputs(params=7e9, gpus=1024)).hours_saved > 0
    costly = peer_copy(PeerCopyInputs(params=70e9, gpus=64, nic_gbps=1.0, mttf_h=1000.0))
    assert costly.overhead > 1 and costly.hours_saved < 0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        peer_copy(PeerCopyInputs(params=7e9, gpus=1))
    with pytest.raises(ValueError, match="live_fraction"):
        peer_copy(PeerCopyInputs(params=7e9, gpus=8, live_fraction=2.0))


def test_the_command_prints_json_for_every_model_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(["simulate-peer-copy", "--json", "--model", "7B", "--model", "70B", "--gpus", "64", "--gpus", "1024"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["gpus"]) for r in data["results"]] == [("7B", 64), ("7B", 1024), ("70B", 64), ("70B", 1024)]
    assert data["inputs"]["copies"] == 1 and data["sources"]
    assert run(["simulate-peer-copy", "--model", "7B", "--gpus", "64"]) == 0
    assert "saved h" in capsys.readouterr().out
    assert run(["simulate-peer-copy", "--sync", "--model", "7B", "--gpus", "64"]) == 0
    assert "synchronous" in capsys.readouterr().out
