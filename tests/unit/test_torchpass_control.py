"""The rank's control channel: which announced generations abort the step in progress.

A failure's (or a rebuild's) generation aborts the collectives in flight at once and makes the lifecycle stale, so
the step is abandoned everywhere. A planned one (a migration: every member of the current generation is alive) only
raises ``latest_gen``: the step in progress finishes on every rank, which follows it at the boundary
(:meth:`torchpass.rank.step.StepLifecycle.stale`). Driven through the messages the coordinator sends, as msgpack
maps."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from clockwork.contracts.coordinator_replies import GenerationPush, HeartbeatAck
from clockwork.contracts.coordinator_wire import JobState, decode
from torchpass.rank.control import ControlChannel


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlChannel]:
    monkeypatch.setenv("TORCHPASS_JOB_KEY", secrets.token_hex(32))
    made = ControlChannel(
        "tcp://127.0.0.1:9", "w0", heartbeat_interval_s=1.0, coordinator_timeout_s=10.0, rpc_timeout_s=1.0
    )
    yield made
    made.close()


def _wire(message: GenerationPush | HeartbeatAck) -> dict[str, Any]:
    return decode(message.to_wire())


def test_a_planned_generation_is_followed_at_the_boundary_a_failures_at_once(channel: ControlChannel) -> None:
    aborted: list[int] = []
    channel.on_generation = aborted.append
    channel.handle_push(_wire(GenerationPush(1, planned=True)))
    assert (channel.latest_gen, channel.urgent_gen, aborted) == (1, -1, [])
    channel.handle_push(_wire(HeartbeatAck(1, JobState.RUNNING, (), planned=True)))  # the acks say it again
    assert (channel.latest_gen, channel.urgent_gen, aborted) == (1, -1, [])
    assert channel.cut_off_gen == -1  # a planned one cuts nothing off
    channel.handle_push(_wire(GenerationPush(2)))  # a failure during the migration's step
    assert (channel.latest_gen, channel.urgent_gen, aborted) == (2, 2, [2])
    channel.handle_push(_wire(HeartbeatAck(2, JobState.RUNNING)))
    assert aborted == [2]  # announced once
    assert channel.cut_off_gen == 2


def test_a_generation_cuts_off_the_old_groups_only_once_their_abort_ran(channel: ControlChannel) -> None:
    """``cut_off_gen`` (what gloo waits give up on) follows the abort, never precedes it: seen from inside the
    abort, it is still the older generation."""
    seen: list[int] = []
    channel.on_generation = lambda gen: seen.append(channel.cut_off_gen)
    channel.handle_push(_wire(GenerationPush(4)))
    assert (seen, channel.cut_off_gen) == ([-1], 4)


def test_a_push_without_the_planned_field_aborts_as_before(channel: ControlChannel) -> None:
    """A coordinator that does not send the field (an older one): every generation aborts, as it always did."""
    aborted: list[int] = []
    channel.on_generation = aborted.append
    channel.handle_push({"op": "generation", "gen": 3})
    assert (channel.latest_gen, channel.urgent_gen, aborted) == (3, 3, [3])
