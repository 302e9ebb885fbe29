"""``torchpass.rollout``: rollout workers always hold one complete version; a slow one never holds the trainer.

A real :class:`Publisher` (ROUTER socket, CURVE with the job key) and real :class:`Subscriber` processes'
sockets on 127.0.0.1; the subscribers run in this process (their own sockets and buffers) except the one with
the wrong key, which runs in a child process with a different ``TORCHPASS_JOB_KEY``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from clockwork.contracts.coordinator_wire import encode
from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey
from torchpass.rollout.push import Publisher, Subscriber, _Version


@pytest.fixture(autouse=True)
def job_key(monkeypatch: pytest.MonkeyPatch) -> str:
    key = JobKey.new().hex
    monkeypatch.setenv(ENV_JOB_KEY, key)
    return key


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher("tcp://127.0.0.1:0", chunk_mb=0.01)  # 10 KiB chunks: many per version
    try:
        yield pub
    finally:
        pub.close()


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)).to(torch.float32)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_versions_arrive_whole_and_bitwise(publisher: Publisher) -> None:
    sub = Subscriber(publisher.endpoint)
    try:
        assert not sub.poll(0.2) and sub.version == 0 and sub.tensors() == {}
        trainer = model(0)
        assert publisher.publish(trainer) == 1
        assert sub.poll(10.0) and sub.version == 1
        assert equal(sub.tensors(), trainer.state_dict())
        assert not sub.poll(0.2)  # nothing newer
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(-3.0)
        publisher.publish(trainer)
        assert sub.poll(10.0) and sub.version == 2
        worker = model(5)
        sub.load_into(worker)
        assert equal(worker.state_dict(), trainer.state_dict())
    finally:
        sub.close()


def test_a_slow_subscriber_skips_to_the_newest(publisher: Publisher) -> None:
    """Versions published while a subscriber is mid-download make it start over with the newest; it never
    exposes a mix, and the trainer published every version without waiting for it."""
    sub = Subscriber(publisher.endpoint, window=1)
    fast = Subscriber(publisher.endpoint)
    try:
        trainer = model(1)
        publisher.publish(trainer)
        assert fast.poll(10.0)
        head = sub._next_id()
        sub._sock.send(encode("latest", id=head, have=0))  # the slow one learns of version 1 ...
        got = sub._recv(time.monotonic() + 10)
        assert got is not None and got[0]["version"] == 1
        for step in range(3):  # the trainer moves on while the slow one has not fetched a byte
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
            assert publisher.publish(trainer) == step + 2
            deadline = time.monotonic() + 10
            while publisher.version < publisher.published and time.monotonic() < deadline:
                time.sleep(0.01)
        assert publisher.version == 4
        assert not sub._download(got[0])  # version 1 is gone: abandoned, nothing exposed
        assert sub.version == 0 and sub.skipped_versions == 1 and sub.tensors() == {}
        assert sub.poll(10.0) and sub.version == 4
        assert equal(sub.tensors(), trainer.state_dict())
        assert fast.poll(10.0) and fast.version == 4
    finally:
        sub.close()
        fast.close()


def test_publish_while_staged_is_skipped_not_waited_for(publisher: Publisher) -> None:
    trainer = model(2)
    with publisher._lock:  # the previous version's GPU copies are still running
        publisher._staged = _Version(1, torch.empty(1, dtype=torch.uint8), [], 0, events=[_NeverDone()])
    assert publisher.publish(trainer) is None
    assert publisher.skipped == 1 and publisher.version == 0


class _NeverDone:
    def query(self) -> bool:
        return False


def test_attach_publishes_every_n_commits(publisher: Publisher) -> None:
    class Ctx:
        slot = 0

        def __init__(self) -> None:
            self.hooks: list = []

        def on_commit(self, hook) -> None:  # type: ignore[no-untyped-def]
            self.hooks.append(hook)

    ctx, trainer = Ctx(), model(3)
    publisher.attach(ctx, trainer, every_steps=3)
    for step in range(7):
        ctx.hooks[0](step)
        deadline = time.monotonic() + 10
        while publisher.version < publisher.published and time.monotonic() < deadline:
            time.sleep(0.01)
    assert publisher.published == 2 and publisher.version == 2  # after steps 2 and 5


def test_a_worker_with_another_key_gets_nothing(publisher: Publisher) -> None:
    publisher.publish(model(4))
    code = textwrap.dedent(
        f"""
        from torchpass.rollout import Subscriber
        sub = Subscriber({publisher.endpoint!r}, request_timeout_s=1.0)
        print("GOT" if sub.poll(2.0) else "NOTHING", sub.version)
        """
    )
    env = dict(os.environ, **{ENV_JOB_KEY: JobKey.new().hex})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NOTHING", "0"]
