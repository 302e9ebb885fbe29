"""The daemon's side of borrowed spares: privileged acquisition of a node through Slurm, and giving it back.

A request comes from the owner of a running ``--clockwork-spares=borrow`` job (the daemon has checked the
caller's kernel credentials against the job's registered uid before this module sees it). What happens:

1. **Checks that need no Slurm**, answered at once: borrowing enabled, the job asked for ``borrow``, its user
   is allowed, and it does not already hold ``max_nodes_per_job`` borrowed nodes (as far as this daemon knows).
   A refusal is raised as :class:`BorrowRefused` (the daemon answers ``forbidden`` and logs it).
2. **The acquisition**, in a worker thread (Slurm commands take seconds and the daemon's loop also carries
   LinkPass and Fleet Lens): the queue is read once; the job's account and partition are checked against
   ``allow_*`` and its holders in Slurm against the limit; :func:`~clockworkd.borrow.candidates.choose` picks
   the job that loses least work; a *holder allocation* (``clockwork-hold-JOBID``, the training job's user,
   pinned to the node, whole node, the high partition or QOS, with the job's GRES per node, account, QOS (unless
   the policy names one) and at most its remaining time) is submitted, and slurmctld preempts (requeues)
   whatever the node ran. Slurm's policy and accounting stay the truth: the daemon never kills a job itself.
   The holder is submitted held; the job it will preempt gets the AdminComment ``clockwork: preempted for
   job X ...`` before the holder is released (so that the preempted run's accounting record carries it).
   When the holder runs on the node, the training job gets the event ``borrow.acquired`` with the timings of
   each part. No candidate, Slurm refusing, or ``timeout_s`` passing: the holder (if any) is cancelled, the
   label taken back, and the request fails at once with the reason (``borrow.failed``), so the job can fall
   back without waiting.
3. **Give-back**: :meth:`BorrowManager.release` (the training job's Epilog) cancels the job's holders, found
   by name in Slurm, so a node borrowed through another node's daemon is given back too. With ``give_back =
   node_return`` the daemon also releases a holder as soon as the job's failed node is back in service and
   no job step of the holder still runs (the replacement rank has left it).

The requester polls :meth:`BorrowManager.requests_of` (``borrow_status``); results reach the registry through
:meth:`on_readable` on the daemon's own thread, because the registry is not thread-safe.
"""

from __future__ import annotations

import logging
import os
import pwd
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clockwork.contracts.borrow_comments import add_borrowed, preempted_comment
from clockwork.contracts.config.borrow import BorrowConfig, names
from clockwork.contracts.errors import SlurmError
from clockwork.contracts.job_options import JobOptions, JobOptionsError, SpareMode
from clockworkd.borrow.candidates import HOLDER_PREFIX, UNUSABLE_NODE_STATES, QueueJob, choose, holders_of, why_not
from clockworkd.borrow.slurm_ops import BorrowSlurm, HolderSpec
from clockworkd.registry import RUNNING, JobRecord

__all__ = ["BorrowManager", "BorrowRefused", "BorrowRequest"]

log = logging.getLogger("clockwork.daemon.borrow")

PENDING, ACQUIRED, FAILED, RELEASED = "pending", "acquired", "failed", "released"
WATCH_INTERVAL_S = 5.0
#: After a failed request, the same job's next one waits this long: every request costs slurmctld a full
#: queue listing, and a job looping on "no node" must not turn into a load on the controller.
RETRY_AFTER_S = 5.0

Recorder = Callable[[int, str, dict[str, Any]], None]


class BorrowRefused(Exception):
    """A borrow request the policy does not allow; the message says why (it goes back to the requester)."""


@dataclass
class BorrowRequest:
    """One borrow request and what became of it (what ``borrow_status`` returns)."""

    request: int
    job_id: int
    uid: int
    user: str
    lost_node: str
    state: str = PENDING
    reason: str = ""
    node: str = ""
    holder: int = 0
    preempted: int = 0
    #: The GRES per node the holder asked for (the job's own): the guest's step asks for the same.
    gres: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    #: Wall-clock time of the request (seconds since the epoch), for people and other hosts reading
    #: ``borrow_status``; never used to measure a duration (a wall clock may jump).
    requested_at: float = 0.0
    #: The manager's monotonic clock at the request (``held_s`` is measured from it) and when the request
    #: failed (the retry delay is measured from that).
    requested_mono: float = 0.0
    ended_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "job_id": self.job_id,
            "state": self.state,
            "reason": self.reason,
            "node": self.node,
            "holder": self.holder,
            "preempted": self.preempted,
            "gres": self.gres,
            "lost_node": self.lost_node,
            "timings": dict(self.timings),
            "requested_at": self.requested_at,
        }


def _ms(start: float, end: float) -> float:
    return round(1000 * (end - start), 1)


class BorrowManager:
    """Borrow requests of the jobs on this node; hosted in the daemon's loop as a component.

    Time comes from three injected functions, so that a test drives every timeout without waiting:
    ``monotonic`` measures every duration and deadline (the holder's ``timeout_s``, the retry delay, the
    give-back watch, the timings and ``held_s``) and must be the daemon loop's clock, which compares
    :meth:`next_deadline` with its own; ``wall`` only stamps ``requested_at`` and is what Slurm's job start
    times (seconds since the epoch) are compared with to tell how much work a preemption loses; ``sleep``
    waits between two looks at the holder.
    """

    def __init__(
        self,
        cfg: BorrowConfig,
        slurm: BorrowSlurm,
        node: str,
        record: Recorder,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        poll_s: float = 0.25,
        threaded: bool = True,
    ) -> None:
        self.cfg = cfg
        self.slurm = slurm
        self.node = node
        self.record = record
        self.monotonic = monotonic
        self.wall = wall
        self.sleep = sleep
        self.poll_s = poll_s
        self.threaded = threaded
        self._lock = threading.Lock()
        self._requests: dict[int, BorrowRequest] = {}
        self._next = 1
        self._results: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._next_watch = monotonic() + WATCH_INTERVAL_S
        self._watching = False
        self._closed = False

    # ----- requests (daemon thread) ------------------------------------------------------------

    def request(self, job: JobRecord, *, by: str, lost_node: str = "") -> dict[str, Any]:
        """Start borrowing a node for ``job`` (its owner asked); BorrowRefused when the policy says no."""
        reason = self._refusal(job)
        if reason:
            log.warning("job %d (node %s): borrow refused for %s: %s", job.job_id, self.node, by, reason)
            self._emit(job.job_id, "borrow.refused", {"by": by, "reason": reason})
            raise BorrowRefused(reason)
        with self._lock:
            req = BorrowRequest(
                self._next,
                job.job_id,
                job.uid,
                job.user,
                lost_node,
                requested_at=self.wall(),
                requested_mono=self.monotonic(),
            )
            self._next += 1
            self._requests[req.request] = req
        log.info(
            "job %d (node %s): borrow request %d from %s (lost node %s)",
            job.job_id,
            self.node,
            req.request,
            by,
            lost_node or "?",
        )
        if self.threaded:
            threading.Thread(target=self.acquire, args=(req,), name=f"borrow-{job.job_id}", daemon=True).start()
        else:
            self.acquire(req)
        return req.to_dict()

    def _refusal(self, job: JobRecord) -> str:
        cfg = self.cfg
        if not cfg.enabled:
            return "borrowing is disabled on this cluster ([borrow] enabled = false)"
        if job.state != RUNNING:
            return f"job {job.job_id} has ended"
        try:
            options = JobOptions.from_registered(job.options)
        except JobOptionsError as error:
            return f"job {job.job_id}: {error}"
        if options.spares is not SpareMode.BORROW:
            spares = options.spares.value if options.spares else "none"
            return f"job {job.job_id} was not submitted with --clockwork-spares=borrow (its spares mode is {spares})"
        if not options.enabled:
            return f"job {job.job_id} was not submitted with --clockwork-ft"
        allowed = names(cfg.allow_users)
        if allowed and job.user not in allowed:
            return f"user {job.user} may not borrow nodes ([borrow] allow_users = {cfg.allow_users!r})"
        with self._lock:
            ended = [r.ended_at for r in self._requests.values() if r.job_id == job.job_id and r.state == FAILED]
        wait = max(ended) + RETRY_AFTER_S - self.monotonic() if ended else 0.0
        if wait > 0:
            return f"job {job.job_id}'s last borrow failed moments ago: ask again in {wait:.1f} s"
        if cfg.max_nodes_per_job == 0:
            return "no job may borrow nodes on this cluster ([borrow] max_nodes_per_job = 0)"
        held = self.active(job.job_id)
        if len(held) >= cfg.max_nodes_per_job:
            return (
                f"job {job.job_id} already holds {len(held)} borrowed node(s) "
                f"({', '.join(r.node or '?' for r in held)}): "
                f"the limit is {cfg.max_nodes_per_job} ([borrow] max_nodes_per_job)"
            )
        return ""

    def active(self, job_id: int) -> list[BorrowRequest]:
        """This daemon's requests for ``job_id`` that hold (or are getting) a node."""
        with self._lock:
            return [r for r in self._requests.values() if r.job_id == job_id and r.state in (PENDING, ACQUIRED)]

    def requests_of(self, job_id: int, request: int | None = None) -> dict[str, Any]:
        """The requests of ``job_id`` on this daemon (one of them with ``request``)."""
        with self._lock:
            reqs = [r.to_dict() for r in self._requests.values() if r.job_id == job_id]
        if request is not None:
            reqs = [r for r in reqs if r["request"] == request]
        return {"job_id": job_id, "requests": reqs}

    # ----- the acquisition (worker thread) -------------------------------------------------------

    def acquire(self, req: BorrowRequest) -> None:
        """Choose, submit the holder, wait for Slurm to preempt; every outcome ends in one event."""
        t0 = self.monotonic()
        try:
            self._acquire(req, t0)
        except BorrowRefused as exc:
            self._finish(req, FAILED, str(exc), t0, kind="borrow.refused")
        except SlurmError as exc:
            self._finish(req, FAILED, f"Slurm refused: {exc}", t0)
        except Exception as exc:  # never leave a request pending forever
            log.exception("job %d: borrow request %d failed", req.job_id, req.request)
            self._finish(req, FAILED, f"internal error: {type(exc).__name__}: {exc}", t0)

    def _acquire(self, req: BorrowRequest, t0: float) -> None:
        cfg = self.cfg
        queue_now = self.slurm.queue()
        nodes = self.slurm.nodes()
        t_query, now = self.monotonic(), self.wall()
        req.timings["query_ms"] = _ms(t0, t_query)
        me = next((j for j in queue_now if j.job_id == req.job_id), None)
        if me is None or me.state != "RUNNING":
            raise BorrowRefused(f"job {req.job_id} is not running in Slurm ({me.state if me else 'unknown'})")
        self._check_allowed(me)
        held = holders_of(queue_now, req.job_id)
        if len(held) >= cfg.max_nodes_per_job:
            raise BorrowRefused(
                f"job {req.job_id} already holds {len(held)} borrowed node(s) in Slurm "
                f"(holders {', '.join(str(h.job_id) for h in held)}): the limit is {cfg.max_nodes_per_job}"
            )
        resources = self.slurm.job_resources(req.job_id)
        if resources is None:
            raise BorrowRefused(f"job {req.job_id} is not known to slurmctld")
        minutes = resources.time_option_minutes(now)
        if minutes == 0:
            raise BorrowRefused(
                f"job {req.job_id} has less than a minute of its time limit left: no node is borrowed for it"
            )
        choice = choose(
            queue_now, cfg, borrower=me, borrower_id=req.job_id, borrower_nodes=me.nodes, nodes=nodes, now=now
        )
        req.timings["choose_ms"] = _ms(t_query, self.monotonic())
        if choice is None:
            raise BorrowRefused(self._none_reason(queue_now, me, now))
        victim = choice.job
        req.node, req.preempted = choice.node, victim.job_id
        partition = (
            cfg.holder_partition.strip()
            if cfg.method == "partition_prio"
            else (cfg.holder_partition.strip() or victim.partition)
        )
        spec = HolderSpec(
            job_id=req.job_id,
            node=choice.node,
            uid=req.uid,
            gid=self._gid(req.uid),
            partition=partition,
            qos=cfg.holder_qos.strip() or (resources.qos if cfg.holder_qos_from_job else ""),
            comment=f"clockwork: holds {choice.node} for job {req.job_id}",
            account=resources.account,
            gres=resources.gres,
            time_minutes=minutes,
        )
        req.gres = resources.gres
        t_submit = self.monotonic()
        req.holder = self.slurm.submit_holder(spec)  # held: nothing is preempted yet
        # The victim is labelled before Slurm preempts it: slurmctld writes a job's AdminComment into the
        # accounting record of the run it ends (the PREEMPTED one) and keeps it for the requeued run. Written
        # afterwards, `sacctmgr modify job` reaches only the newest record, which may already be the next run.
        preempted = preempted_comment(req.job_id, choice.node, req.holder)
        self._comment(req.job_id, victim.job_id, preempted)
        try:
            self.slurm.release(req.holder)
        except SlurmError:
            self._cancel_quietly(req.holder)
            self._comment(req.job_id, victim.job_id, victim.admin_comment)
            raise
        t_submitted = self.monotonic()
        req.timings["submit_ms"] = _ms(t_submit, t_submitted)
        log.info(
            "job %d: holder %d submitted for %s (preempts job %d of %s, %s, work lost %.0f s)",
            req.job_id,
            req.holder,
            choice.node,
            victim.job_id,
            victim.user,
            victim.partition,
            choice.work_lost_s,
        )
        deadline = t_submitted + cfg.timeout_s
        while True:
            info = self.slurm.job(req.holder)
            if info is not None and info.state == "RUNNING" and choice.node in info.nodes:
                break
            if info is None or info.finished:
                self._comment(req.job_id, victim.job_id, victim.admin_comment)
                raise BorrowRefused(
                    f"the holder allocation {req.holder} on {choice.node} ended before it ran "
                    f"({info.state if info else 'gone'})"
                )
            if self.monotonic() >= deadline:
                self._cancel_quietly(req.holder)
                self._comment(req.job_id, victim.job_id, victim.admin_comment)
                raise BorrowRefused(
                    f"Slurm did not start the holder allocation {req.holder} on {choice.node} within "
                    f"{cfg.timeout_s:g} s ([borrow] timeout_s; is preemption configured for partition "
                    f"{victim.partition}? pending reason in `scontrol show job {req.holder}`)"
                )
            self.sleep(self.poll_s)
        t_running = self.monotonic()
        req.timings["preempt_ms"] = _ms(t_submitted, t_running)
        after = self.slurm.job(victim.job_id)
        mine = self.slurm.job(req.job_id)
        for job_id, text in (
            (req.holder, f"clockwork: holds {choice.node} for job {req.job_id}, preempted job {victim.job_id}"),
            (req.job_id, add_borrowed(mine.admin_comment if mine else "", choice.node, victim.job_id, req.holder)),
        ):
            self._comment(req.job_id, job_id, text)
        req.timings["total_ms"] = _ms(t0, self.monotonic())
        self._emit(  # before the state changes: whoever sees 'acquired' finds the event recorded
            req.job_id,
            "borrow.acquired",
            {
                "request": req.request,
                "node": choice.node,
                "holder": req.holder,
                "from_job": victim.job_id,
                "from_user": victim.user,
                "from_partition": victim.partition,
                "from_qos": victim.qos,
                "from_state": after.state if after is not None else "gone",
                "work_lost_s": choice.work_lost_s,
                "candidates": choice.considered,
                "excluded": choice.excluded,
                "lost_node": req.lost_node,
                "method": cfg.method,
                **req.timings,
            },
        )
        with self._lock:
            req.state = ACQUIRED

    def _check_allowed(self, me: QueueJob) -> None:
        accounts, partitions = names(self.cfg.allow_accounts), names(self.cfg.allow_partitions)
        if accounts and me.account not in accounts:
            raise BorrowRefused(f"account {me.account or '?'} may not borrow ([borrow] allow_accounts)")
        if partitions and me.partition not in partitions:
            raise BorrowRefused(f"jobs of partition {me.partition} may not borrow ([borrow] allow_partitions)")

    def _none_reason(self, queue_now: list[QueueJob], me: QueueJob, now: float) -> str:
        where = ", ".join(filter(None, (self.cfg.partitions, self.cfg.qos)))
        borrowable = set(names(self.cfg.partitions)), set(names(self.cfg.qos))
        excluded = []
        for job in queue_now:
            if job.job_id == me.job_id or job.name.startswith(HOLDER_PREFIX):
                continue
            if job.partition in borrowable[0] or job.qos in borrowable[1]:
                excluded.append(f"job {job.job_id}: {why_not(job, self.cfg, now) or 'no usable node'}")
        tail = f"; excluded: {'; '.join(excluded[:5])}" if excluded else ""
        return f"no node can be borrowed: no eligible running job on borrowable work ({where}){tail}"

    @staticmethod
    def _gid(uid: int) -> int:
        try:
            return pwd.getpwuid(uid).pw_gid
        except KeyError:
            raise BorrowRefused(f"uid {uid} is not a known user on this node: cannot submit as it") from None

    def _comment(self, for_job: int, job_id: int, text: str) -> None:
        """Set a job's AdminComment; a comment not written is logged, never a reason to fail the borrow."""
        try:
            self.slurm.set_admin_comment(job_id, text)
        except (SlurmError, ValueError) as exc:
            log.warning("job %d: AdminComment of job %d not written: %s", for_job, job_id, exc)

    def _cancel_quietly(self, job_id: int) -> None:
        try:
            self.slurm.cancel(job_id)
        except SlurmError as exc:
            log.warning("holder %d not cancelled: %s", job_id, exc)

    def _finish(self, req: BorrowRequest, state: str, reason: str, t0: float, kind: str = "borrow.failed") -> None:
        req.timings["total_ms"] = _ms(t0, self.monotonic())
        log.warning("job %d (node %s): borrow request %d failed: %s", req.job_id, self.node, req.request, reason)
        fields: dict[str, Any] = {"request": req.request, "reason": reason, "lost_node": req.lost_node, **req.timings}
        if req.holder:
            fields["holder"] = req.holder
        self._emit(req.job_id, kind, fields)  # before the state changes (see above)
        with self._lock:
            req.state, req.reason, req.ended_at = state, reason, self.monotonic()

    # ----- give-back -----------------------------------------------------------------------------

    def release(self, job_id: int, why: str) -> list[int]:
        """Cancel every holder of ``job_id`` (found in Slurm by name): the nodes go back to the preempted work."""
        try:
            held = holders_of(self.slurm.queue(), job_id)
        except SlurmError as exc:
            log.warning("job %d: holders not looked up (%s); cancelling this daemon's own", job_id, exc)
            held = []
        ids = {h.job_id: (h.nodes[0] if h.nodes else "") for h in held}
        with self._lock:
            for r in self._requests.values():
                if r.job_id == job_id and r.state == ACQUIRED and r.holder:
                    ids.setdefault(r.holder, r.node)
        released = []
        for holder, node in sorted(ids.items()):
            try:
                self.slurm.cancel(holder)
            except SlurmError as exc:
                log.warning("job %d: holder %d on %s not cancelled: %s", job_id, holder, node, exc)
                continue
            released.append(holder)
            held_s = None
            with self._lock:
                for r in self._requests.values():
                    if r.holder == holder:
                        r.state = RELEASED
                        held_s = round(self.monotonic() - r.requested_mono, 1)
            log.info("job %d: gave back %s (holder %d cancelled: %s)", job_id, node, holder, why)
            self._emit(job_id, "borrow.released", {"holder": holder, "node": node, "why": why, "held_s": held_s})
        return released

    def _watch(self) -> None:
        """give_back = node_return: release holders whose job's failed node is back and that run no step."""
        try:
            with self._lock:
                held = [r for r in self._requests.values() if r.state == ACQUIRED and r.lost_node]
            if not held:
                return
            state = {n.name: n for n in self.slurm.nodes()}
            for r in held:
                home = state.get(r.lost_node)
                if home is None or any(home.has(s) for s in UNUSABLE_NODE_STATES):
                    continue
                if self.slurm.running_steps(r.holder):
                    continue
                self.release(r.job_id, f"the job's own node {r.lost_node} is back in service")
        except SlurmError as exc:
            log.warning("borrow give-back watch: %s", exc)
        finally:
            self._watching = False

    # ----- hosted in the daemon's loop -----------------------------------------------------------

    def _emit(self, job_id: int, kind: str, fields: dict[str, Any]) -> None:
        self._results.put((job_id, kind, fields))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def fds(self) -> list[int]:
        return [self._wake_r]

    def on_readable(self, fd: int) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        self.drain()

    def drain(self) -> None:
        """Record every finished step in the job's event log (daemon thread only)."""
        while True:
            try:
                job_id, kind, fields = self._results.get_nowait()
            except queue.Empty:
                return
            try:
                self.record(job_id, kind, fields)
            except Exception as exc:  # an ended or unknown job: the log line above still tells
                log.warning("job %d: %s not recorded: %s", job_id, kind, exc)

    def next_deadline(self) -> float:
        return self._next_watch if self.cfg.give_back == "node_return" else self.monotonic() + 3600.0

    def tick(self) -> None:
        self._next_watch = self.monotonic() + WATCH_INTERVAL_S
        if self.cfg.give_back == "node_return" and not self._watching:
            self._watching = True
            threading.Thread(target=self._watch, name="borrow-watch", daemon=True).start()

    def status(self) -> dict[str, Any]:
        """What ``clockwork node status`` shows: counts only (any local user may ask; job ids are private)."""
        with self._lock:
            reqs = list(self._requests.values())
        return {
            "enabled": self.cfg.enabled,
            "give_back": self.cfg.give_back,
            "held": sum(1 for r in reqs if r.state == ACQUIRED),
            "requests": len(reqs),
            "failed": sum(1 for r in reqs if r.state == FAILED),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
