"""A rank's link to the coordinator: requests from the main thread, and a control thread for the rest.

The per-step cost of fault tolerance lives here, so it is kept to reading two Python attributes: the
control thread receives the coordinator's pushes (``generation``, ``stop``) and stores the newest generation
number in :attr:`ControlChannel.latest_gen`; the training loop compares it with its own at each step
boundary, and the DDP communication hook does the same before launching a collective. No per-step request
is ever sent. The control thread also sends heartbeats (carrying the current step, for ``torchpass
status``), notices a vanished coordinator, and calls back into the rank when a newer generation appears so a
collective blocked on a silently dead peer can be aborted at once instead of waiting for its timeout.

This module imports no torch. Its requests go through :class:`clockwork.contracts.coordinator_client.CoordinatorRpc`
and its messages are :mod:`clockwork.contracts.coordinator_wire`'s (with :mod:`clockwork.contracts.coordinator_requests`
and :mod:`clockwork.contracts.coordinator_replies`), which ``torchpass status``, ``clockwork migrate`` and the daemon
use too: one implementation of the protocol's client side.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from clockwork.contracts.coordinator_client import CoordinatorLost, CoordinatorRefused, CoordinatorRpc, JobStopped
from clockwork.contracts.coordinator_replies import GenerationPush, HeartbeatAck, SnapshotPush, StopPush, parse_push
from clockwork.contracts.coordinator_wire import ProtocolError, decode, encode
from torchpass.auth import connect_as_client, job_key

__all__ = ["ControlChannel", "CoordinatorLost", "CoordinatorRefused", "CoordinatorRpc", "JobStopped"]

log = logging.getLogger("clockwork.torchpass.control")


class ControlChannel:
    """The rank's two sockets to the coordinator and the control thread that owns one of them."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        *,
        heartbeat_interval_s: float,
        coordinator_timeout_s: float,
        rpc_timeout_s: float,
    ) -> None:
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.latest_gen = -1  # newest generation the coordinator announced (read by the training loop)
        # newest one that was not planned (a failure, a rebuild): it aborts the step in progress; a planned one
        # (a migration, every member alive) is followed once the step in progress ends
        self.urgent_gen = -1
        # newest generation whose announcement this thread acted on (the old groups aborted): a gloo wait still
        # pending in a group older than this is given up (torchpass.sharded.gloo_wait)
        self.cut_off_gen = -1
        self.stopped: JobStopped | None = None
        self.lost = False
        self.step = -1  # written by the training loop, reported in heartbeats
        # (step, ordinal, name) of the script's collective the training loop is waiting in, or None; reported in
        # heartbeats so the coordinator can tell a rank its peers went past (torchpass.coordinator.lockstep)
        self.collective: tuple[int, int, str] | None = None
        self.snapshot_steps: set[int] = set()  # steps after which the coordinator asked for a snapshot
        self.skipped_snapshots: collections.deque[int] = collections.deque()  # reported in the next heartbeat
        self.on_generation: Callable[[int], None] | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.rpc = CoordinatorRpc(
            self._context, endpoint, rpc_timeout_s, identity=f"{worker_id}.r".encode(), key=job_key()
        )
        self._closing = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # close() wakes the control thread at once
        self._thread = threading.Thread(target=self._run, name="torchpass-control", daemon=True)

    def start(self) -> None:
        """Start the control thread (after :meth:`call` ``register``, so the coordinator knows us)."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close both sockets."""
        self._closing.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.rpc.close()
        self._context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def check(self) -> None:
        """Raise if the job was stopped or the coordinator is lost (cheap; called while waiting)."""
        if self.stopped is not None:
            raise self.stopped
        if self.lost:
            raise CoordinatorLost(f"coordinator {self.endpoint} silent for {self.coordinator_timeout_s:g} s")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """A short request (register, broken, joined, migrate, ...)."""
        return self.rpc.call(op, wid=self.worker_id, **fields)

    def wait(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """A long poll (await_generation, finished); gives up when the coordinator goes silent."""
        return self.rpc.wait(op, time.monotonic() + timeout_s, interrupt=self._interrupt, wid=self.worker_id, **fields)

    def _interrupt(self) -> None:
        if self.lost:
            raise CoordinatorLost(f"the coordinator at {self.endpoint} went silent")

    # ----- the control thread ---------------------------------------------------------------

    def _run(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}.n".encode())
        connect_as_client(sock)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            sock.send(encode("hello", wid=self.worker_id, step=self.step))
            last_heard = last_sent = time.monotonic()
            while not self._closing.is_set():
                wait_s = max(0.0, last_sent + self.heartbeat_interval_s - time.monotonic())
                if dict(poller.poll(int(wait_s * 1000) + 1)).get(sock):
                    last_heard = time.monotonic()
                    self.lost = False
                    try:
                        self.handle_push(decode(sock.recv()))
                    except ProtocolError as exc:
                        log.warning("unreadable push from the coordinator: %s", exc)
                now = time.monotonic()
                if now - last_sent >= self.heartbeat_interval_s:
                    skipped = [self.skipped_snapshots.popleft() for _ in range(len(self.skipped_snapshots))]
                    hb = encode("hb", wid=self.worker_id, step=self.step, skipped=skipped, uc=self.collective)
                    sock.send(hb, zmq.NOBLOCK)
                    last_sent = now
                if now - last_heard > self.coordinator_timeout_s and not self.lost:
                    log.error("coordinator silent for %.1f s", now - last_heard)
                    self.lost = True
                    self._announce(1 << 62)
        except zmq.ZMQError as exc:
            if not self._closing.is_set():
                log.error("control thread stopped: %s", exc)
        finally:
            sock.close(0)

    def handle_push(self, msg: dict[str, Any]) -> None:
        """One message from the coordinator (a push or a heartbeat's answer), decoded; the control thread's."""
        push = parse_push(msg)
        if isinstance(push, SnapshotPush | HeartbeatAck):
            for step in push.snap:
                if step > self.step - 1:  # a step already committed can no longer be snapshotted
                    self.snapshot_steps.add(step)
        if isinstance(push, GenerationPush | HeartbeatAck):
            if push.gen > self.latest_gen:
                self.latest_gen = push.gen
            if not push.planned and push.gen > self.urgent_gen:
                self.urgent_gen = push.gen
                self._announce(push.gen)
        elif isinstance(push, StopPush):
            self.stopped = JobStopped(push.reason, push.done)
            if not push.done:  # a failed job: unblock any collective; a finished one keeps its group
                self._announce(1 << 62)

    def _announce(self, gen: int) -> None:
        callback = self.on_generation
        if callback is not None:
            try:
                callback(gen)
            except Exception:  # the control thread must survive a failing abort
                log.exception("generation callback failed")
        self.cut_off_gen = max(self.cut_off_gen, gen)
