"""The GPU health watch the node daemon hosts: read, judge, act, and answer ``clockwork node gpus``.

Every ``interval_s`` the watch reads every GPU from its source and lets the policy judge the readings. For each
signal raised or cleared at ``warn`` or above it records a ``gpu.health`` event in the jobs whose ranks use that
GPU (every running job of the node when no rank is known to use it: they share the node). While a ``migrate``
signal is raised, every live TorchPass rank on that GPU is moved: the watch asks the job's coordinator for a
planned migration, as ``clockwork migrate`` does, and records ``gpu.migration`` events (requested, then accepted
or failed) naming the signal, its value and its threshold. A refused request (no spare ready yet, another change
under way) is repeated every ``migrate_retry_s`` while the signal stays raised.

A fault of the whole node (:meth:`~clockworkd.gpuhealth.policy.Policy.node_fault`: the NVLink fabric, every GPU
at once, a NIC LinkPass has seen down too long) moves every live rank of each job on the node instead, together
to one spare node, the way ``clockwork migrate --ranks-on`` does: one request per rank in slot order, the first
asking for a node with room for them all, each next one following the spare the previous one took and waiting
while the previous move is under way. Its ``gpu.migration`` events carry ``scope = node`` and the slots.

The request is a network round trip with timeouts, so it runs on a worker thread; its outcome is recorded by the
daemon's loop at the next tick (the registry is only ever touched from the loop). Nothing here may stop the
daemon: a source or policy failure is logged and the watch goes on at the next interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clockwork.contracts.config.health import HealthConfig
from clockwork.contracts.config.health_signals import ACTION_RANK, SIGNALS
from clockwork.contracts.coordinator_client import coordinator_record, request_migration
from clockworkd.gpuhealth.policy import Change, NodeFault, Policy
from clockworkd.gpuhealth.ranks import LiveRank, gpu_of, pid_alive, ranks_in, read_environ
from clockworkd.gpuhealth.readings import GpuReading, GpuSource, SourceBusyError
from clockworkd.registry import RUNNING, Registry

log = logging.getLogger("clockwork.daemon.health")

HEALTH_EVENT = "gpu.health"
MIGRATION_EVENT = "gpu.migration"
MIGRATIONS_KEPT = 20


@dataclass
class _Request:
    """One migration request of one rank, in flight or done."""

    rank: LiveRank
    change: dict[str, Any]
    future: Future[dict[str, Any]] | None
    asked_at: float
    outcome: str = "requested"
    detail: str = ""
    slots: tuple[int, ...] = ()  # a whole-node move: every slot it moves (one rank's move: empty)

    def what(self) -> str:
        """``slot 3`` or ``slots 2, 3 (the whole node)``, for the log."""
        if not self.slots:
            return f"slot {self.rank.slot}"
        return f"slots {', '.join(map(str, self.slots))} (the whole node)"


class HealthWatch:
    """The daemon component (see the module docstring); ``emit(job_id, kind, fields)`` records a job event."""

    def __init__(
        self,
        cfg: HealthConfig,
        node: str,
        source: GpuSource,
        registry: Registry,
        emit: Callable[[int, str, dict[str, Any]], None],
        *,
        clock: Callable[[], float] = time.time,
        alive: Callable[[int], bool] = pid_alive,
        environ: Callable[[int], dict[str, str] | None] = read_environ,
        nics_down: Callable[[], dict[str, str]] = dict,
        hcas_down: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.source = source
        self.registry = registry
        self.emit = emit
        self.policy = Policy(cfg)
        self.clock = clock
        self.alive = alive
        self.environ = environ
        self.nics_down = nics_down  # fabric NIC -> why it is down (LinkPass's view; none without LinkPass)
        self._nic_down_since: dict[str, tuple[float, str]] = {}
        self.hcas_down = hcas_down  # HCA -> why new communicators must avoid it (LinkPass's avoid_hcas)
        self._hca_down_since: dict[str, tuple[float, str]] = {}
        self.readings: list[GpuReading] = []
        self.read_at = 0.0
        self.reads = 0
        self.failures = 0
        self.busy_rounds = 0  # rounds skipped because the source's read hung (SourceBusyError)
        self._next = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpu-health-migrate")
        self._requests: dict[tuple[int, int], _Request] = {}  # (job, pid) -> latest request
        self._node_moves: dict[tuple[int, tuple[int, ...]], _Request] = {}  # (job, its pids here) -> latest
        self._done: list[_Request] = []

    # ----- Component --------------------------------------------------------------------------

    def fds(self) -> list[int]:
        return []

    def on_readable(self, fd: int) -> None:
        return None

    def next_deadline(self) -> float:
        return self._next

    def tick(self) -> None:
        self._next = time.monotonic() + self.cfg.interval_s
        try:
            self.step()
        except SourceBusyError as exc:  # a hung NVML call: skip this round, say so once per hang
            if self.busy_rounds == 0:
                log.warning("node %s: GPU health watch skips its rounds while a read hangs: %s", self.node, exc)
            self.busy_rounds += 1
            return
        except Exception:  # the watch must never take the daemon down
            self.failures += 1
            log.exception("node %s: GPU health watch failed this round (goes on at the next)", self.node)
        if self.busy_rounds:
            log.warning("node %s: GPU reads return again (%d rounds skipped)", self.node, self.busy_rounds)
            self.busy_rounds = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.source.close()

    def status(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "source": self.source.describe(),
            "gpus": len(self.readings),
            "health": {f"gpu{r.index}": self.policy.health(r.index)[0] for r in self.readings},
            "reads": self.reads,
            "busy_rounds": self.busy_rounds,
        }

    # ----- one round ---------------------------------------------------------------------------

    def step(self) -> None:
        """Read, judge, act; record finished migration requests."""
        now = self.clock()
        self.readings = self.source.read()
        self.read_at = now
        self.reads += 1
        changes = self.policy.evaluate(self.readings, now)
        self._collect_requests()
        acting = any(
            ACTION_RANK[s.action] >= ACTION_RANK["warn"] for g in self.policy.gpus.values() for s in g.raised.values()
        )
        fault = self.policy.node_fault(self._nics_down(now), now, self._hcas_down(now))
        ranks = self.live_ranks() if (changes or acting or fault) else []
        for change in changes:
            self._record(change, ranks)
        moving = self._move_node(fault, ranks, now) if fault is not None else set()
        ranks = [rank for rank in ranks if rank.job_id not in moving]  # their node moves: no one-GPU moves
        for index, state in self.policy.gpus.items():
            movers = [s for s in state.raised.values() if s.action == "migrate"]
            if not movers:
                continue
            worst = min(movers, key=lambda s: (s.since, s.name))  # the signal that first called for the move
            cause = {"signal": worst.name, "value": worst.value, "threshold": worst.threshold, "gpu": index}
            for rank in ranks:
                if rank.gpu == index:
                    self._migrate(rank, cause, now)

    def _record(self, change: Change, ranks: list[LiveRank]) -> None:
        level = logging.WARNING if ACTION_RANK[change.action] >= ACTION_RANK["warn"] else logging.INFO
        log.log(
            level,
            "node %s: gpu%d %s %s (value %s, threshold %s): action %s",
            self.node,
            change.gpu,
            change.signal,
            change.state,
            change.value,
            change.threshold,
            change.action,
        )
        if ACTION_RANK[change.action] < ACTION_RANK["warn"]:
            return
        on_gpu = [r for r in ranks if r.gpu == change.gpu]
        jobs = sorted({r.job_id for r in on_gpu}) if on_gpu else self._running_jobs()
        fields = {**change.to_dict(), "node": self.node, "about": SIGNALS.get(change.signal, ("", "XID event"))[1]}
        fields["ranks"] = [r.slot for r in on_gpu]
        for job_id in jobs:
            self.emit(job_id, HEALTH_EVENT, fields)

    def _running_jobs(self) -> list[int]:
        return [j.job_id for j in self.registry.jobs() if j.state == RUNNING]

    # ----- ranks --------------------------------------------------------------------------------

    def live_ranks(self) -> list[LiveRank]:
        """Every live TorchPass rank of a running job on this node, with its GPU."""
        out = []
        for job_id in self._running_jobs():
            try:
                events, _ = self.registry.events(job_id)
            except Exception as exc:
                log.warning("job %d (node %s): events unreadable for the GPU health watch: %s", job_id, self.node, exc)
                continue
            for slot, pid, gen in ranks_in(events, self.node, self.alive):
                gpu, how = gpu_of(pid, self.readings, self.environ)
                out.append(LiveRank(job_id, slot, pid, gen, gpu, how))
        return out

    # ----- migration ------------------------------------------------------------------------------

    def _migrate(self, rank: LiveRank, cause: dict[str, Any], now: float) -> None:
        key = (rank.job_id, rank.pid)
        previous = self._requests.get(key)
        if previous is not None:
            if previous.future is not None or previous.outcome == "accepted":
                return  # in flight, or the coordinator took it: the rank leaves at its next step
            if now - previous.asked_at < self.cfg.migrate_retry_s:
                return
        fields = {**cause, "slot": rank.slot, "pid": rank.pid, "node": self.node, "mapping": rank.how}
        record = self._record_of(rank.job_id)
        if record is None:
            request = _Request(rank, fields, None, now, "failed", "no TorchPass coordinator record on this node")
            self._requests[key] = request
            self._finish(request)
            return
        requester = (
            f"clockworkd GPU health on {self.node}: gpu{cause['gpu']} {cause['signal']} "
            f"{cause['value']} (threshold {cause['threshold']})"
        )
        future = self._pool.submit(request_migration, record, rank.slot, self.cfg.migrate_timeout_s, requester)
        self._requests[key] = _Request(rank, fields, future, now)
        log.warning(
            "job %d (node %s): migrating slot %d (pid %d) off gpu%d: %s = %s (threshold %s)",
            rank.job_id,
            self.node,
            rank.slot,
            rank.pid,
            cause["gpu"],
            cause["signal"],
            cause["value"],
            cause["threshold"],
        )
        self.emit(rank.job_id, MIGRATION_EVENT, {**fields, "state": "requested"})

    # ----- whole-node moves -----------------------------------------------------------------------

    def _nics_down(self, now: float) -> dict[str, tuple[float, str]]:
        """Fabric NIC -> (down since, why), since this watch first saw each down (LinkPass's view)."""
        try:
            down = self.nics_down()
        except Exception as exc:  # LinkPass's state unreadable: no NIC verdict this round
            log.warning("node %s: NIC state unreadable for the GPU health watch: %s", self.node, exc)
            down = {}
        self._nic_down_since = {nic: self._nic_down_since.get(nic, (now, why)) for nic, why in down.items()}
        return self._nic_down_since

    def _hcas_down(self, now: float) -> dict[str, tuple[float, str]]:
        """HCA -> (unusable since, why), since this watch first saw each (LinkPass's ``avoid_hcas``)."""
        try:
            down = self.hcas_down()
        except Exception as exc:
            log.warning("node %s: HCA state unreadable for the GPU health watch: %s", self.node, exc)
            down = {}
        self._hca_down_since = {hca: self._hca_down_since.get(hca, (now, why)) for hca, why in down.items()}
        return self._hca_down_since

    def _move_node(self, fault: NodeFault, ranks: list[LiveRank], now: float) -> set[int]:
        """Ask each job with ranks here to move them all, together (see the module docstring); the jobs."""
        jobs: dict[int, list[LiveRank]] = {}
        for rank in ranks:
            jobs.setdefault(rank.job_id, []).append(rank)
        for job_id, mine in jobs.items():
            mine.sort(key=lambda r: r.slot)
            key = (job_id, tuple(sorted(r.pid for r in mine)))
            previous = self._node_moves.get(key)
            if previous is not None and (
                previous.future is not None
                or previous.outcome == "accepted"
                or now - previous.asked_at < self.cfg.migrate_retry_s
            ):
                continue
            slots = tuple(r.slot for r in mine)
            fields = {**fault.cause(), "why": fault.why, "slots": list(slots), "node": self.node}
            fields["pids"] = [r.pid for r in mine]
            record = self._record_of(job_id)
            if record is None:
                request = _Request(mine[0], fields, None, now, "failed", "no TorchPass coordinator record on this node")
                self._node_moves[key] = request
                self._finish(request)
                continue
            requester = f"clockworkd GPU health on {self.node}: {fault.why}"
            future = self._pool.submit(self._move_all, record, list(slots), requester)
            self._node_moves[key] = _Request(mine[0], fields, future, now, slots=slots)
            log.warning("job %d (node %s): moving slots %s together: %s", job_id, self.node, list(slots), fault.why)
            self.emit(job_id, MIGRATION_EVENT, {**fields, "state": "requested"})
        return set(jobs)

    def _move_all(self, record: dict[str, Any], slots: list[int], requester: str) -> dict[str, Any]:
        """One request per rank, in slot order, as ``clockwork migrate --ranks-on`` asks (on a worker thread)."""
        near, targets, generation = "", [], None
        for k, slot in enumerate(slots):
            reply = request_migration(
                record,
                slot,
                self.cfg.migrate_timeout_s,
                requester,
                wait_s=self.cfg.node_move_wait_s,  # the previous rank's move must complete first
                group=len(slots) - k,
                near=near,
            )
            near = str(reply.get("target") or "")
            targets.append(near)
            generation = reply.get("generation")
        return {"target": ", ".join(targets), "targets": targets, "generation": generation}

    def _record_of(self, job_id: int) -> dict[str, Any] | None:
        """The job's TorchPass coordinator record on this node (None: none, or unreadable)."""
        try:
            events, _ = self.registry.events(job_id)
            return coordinator_record(events)
        except Exception as exc:
            log.warning("job %d (node %s): no coordinator record: %s", job_id, self.node, exc)
            return None

    def _collect_requests(self) -> None:
        for request in [*self._requests.values(), *self._node_moves.values()]:
            future = request.future
            if future is None or not future.done():
                continue
            request.future = None
            try:
                reply = future.result()
                request.outcome = "accepted"
                request.detail = f"to {reply.get('target')} in generation {reply.get('generation')}"
                request.change = {**request.change, "target": reply.get("target")}
                request.change["generation"] = reply.get("generation")
            except Exception as exc:
                request.outcome = "failed"
                request.detail = str(exc)
            self._finish(request)

    def _finish(self, request: _Request) -> None:
        fields = {**request.change, "state": request.outcome}
        if request.outcome == "failed":
            fields["error"] = request.detail
            if fields.get("signal") == "hca.down":  # say what staying means: the RDMA path has no other way out
                fields["consequence"] = (
                    f"TorchPass cannot act: the node's ranks stay in processes whose NCCL still uses {fields['value']} "
                    "(NCCL reads NCCL_IB_HCA once per process); their collectives fail over it until a spare is "
                    "ready (the move is asked again every migrate_retry_s) or the job's resets run out"
                )
        level = logging.INFO if request.outcome == "accepted" else logging.WARNING
        log.log(
            level,
            "job %d (node %s): migration of %s %s: %s",
            request.rank.job_id,
            self.node,
            request.what(),
            request.outcome,
            request.detail,
        )
        self.emit(request.rank.job_id, MIGRATION_EVENT, fields)
        self._done.append(request)
        del self._done[:-MIGRATIONS_KEPT]

    # ----- what `clockwork node gpus` shows -----------------------------------------------------

    def snapshot(self, visible: Callable[[int], bool] = lambda _job: True) -> dict[str, Any]:
        """Each GPU's reading, health, raised signals, recent changes, ranks and drain verdict.

        ``visible(job_id)``: whether the caller may see that job (ranks and migrations of other users' jobs are
        left out)."""
        ranks = self.live_ranks()
        unmapped = [r for r in ranks if r.gpu is None]
        gpus = []
        for r in self.readings:
            state = self.policy.gpus.get(r.index)
            severity, action = self.policy.health(r.index)
            raised = sorted((state.raised.values() if state else []), key=lambda s: s.name)
            on_gpu = [x for x in ranks if x.gpu == r.index]
            worst = max(raised, key=lambda s: ACTION_RANK[s.action], default=None)
            drain_reason = ""
            if worst is not None and ACTION_RANK[worst.action] >= ACTION_RANK["drain"]:
                drain_reason = f"gpu{r.index} {worst.name} {worst.value}" + (
                    f" (threshold {worst.threshold})" if worst.threshold is not None else ""
                )
            gpus.append(
                {
                    "index": r.index,
                    "uuid": r.uuid,
                    "name": r.name,
                    "health": severity,
                    "action": action or "none",
                    "reading": r.to_dict(),
                    "signals": [s.to_dict() for s in raised],
                    "history": [c.to_dict() for c in (state.history if state else [])],
                    "ranks": [x.to_dict() for x in on_gpu if visible(x.job_id)],
                    "drain_reason": drain_reason,
                    "drain_ready": bool(self.cfg.drain and drain_reason and not on_gpu and not unmapped),
                }
            )
        migrations = [
            {**q.change, "job_id": q.rank.job_id, "state": q.outcome, "detail": q.detail}
            for q in [*self._done, *(q for q in [*self._requests.values(), *self._node_moves.values()] if q.future)]
            if visible(q.rank.job_id)
        ]
        return {
            "node": self.node,
            "enabled": True,
            "source": self.source.name,
            "source_state": self.source.describe(),
            "interval_s": self.cfg.interval_s,
            "read_at": self.read_at,
            "gpus": gpus,
            "migrations": migrations[-MIGRATIONS_KEPT:],
        }
