"""``--clockwork-spares=borrow``: when the job needs a spare and has none, borrow a node from preemptible work.

The leading agent's coordinator calls :meth:`Borrower.need` when a slot is vacant and no spare is ready. The
borrower then, on its own thread (the coordinator's must never block):

1. asks its node daemon for a node (``borrow``; the daemon checks that the caller owns this job, that the job
   asked for ``borrow`` and what the admin's ``[borrow]`` policy allows, and answers at once with a refusal or
   a request to poll);
2. polls ``borrow_status`` until the daemon's holder allocation runs on the chosen node (slurmctld preempted
   the work there) or the daemon gives up;
3. starts the replacement there as a job step of the holder allocation, ``srun --jobid=HOLDER --overlap
   ... python -m torchpass guest SCRIPT ARGS`` (:mod:`torchpass.launch.guest`): the guest joins this job's
   coordinator with the job key as G spares (the job's ranks per node, one per local index, as a standby
   node offers them), and the coordinator fills the vacant slots with them as with any spares (state from a
   surviving replica, same step, same result): a lost node's G ranks land together on the borrowed node.

When no node can be borrowed the job is told at once: with ``borrow_fallback = "fail"`` the coordinator fails
the job with the daemon's reason; with ``"wait"`` it keeps waiting for a standby spare (``--spares``) until
``spare_timeout_s``. Each part is timed in the ``torchpass.borrowed`` / ``torchpass.borrow_failed`` events;
the daemon's own ``borrow.acquired`` event carries the Slurm side (choice, submission, preemption).

The key reaches the guest only through srun's environment (a process of the job's own user), never a command
line. This module imports no torch.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torchpass.auth import ENV_JOB_KEY
from torchpass.events import EventSink, emit
from torchpass.launch.slurm_layout import ENV_RANKS_PER_NODE

__all__ = [
    "ENV_GUEST_ENDPOINTS",
    "ENV_GUEST_JOB",
    "ENV_GUEST_WORLD",
    "BorrowDaemon",
    "Borrower",
    "guest_command",
    "guest_environment",
    "spawn_guest",
]

log = logging.getLogger("clockwork.torchpass.borrow")

ENV_GUEST_ENDPOINTS = "TORCHPASS_GUEST_ENDPOINTS"  # the job's coordinator replicas, comma separated
ENV_GUEST_WORLD = "TORCHPASS_GUEST_WORLD"  # the job's training slots
ENV_GUEST_JOB = "TORCHPASS_GUEST_JOB"  # the training job's id (the guest runs in the holder's allocation)
#: Variables a guest's srun must not inherit from the agent's step: they describe the *training* job's step
#: and would contradict ``--jobid=HOLDER`` (SLURM_CONF is kept: without it clients try DNS).
_KEEP_SLURM = ("SLURM_CONF",)
#: What ``--gres`` takes (``gpu:8``, ``gpu:h100:8,nic:1``): the daemon's reply is checked before it becomes an
#: option of srun.
_GRES = re.compile(r"[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)*(,[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)*)*")


class BorrowDaemon(Protocol):
    """What the borrower asks of its node daemon (:class:`clockwork.contracts.daemon_client.DaemonClient` does this)."""

    def borrow(self, job_id: int, lost_node: str = "") -> dict[str, Any]: ...
    def borrow_status(self, job_id: int, request: int | None = None) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


def _passed_to_guest(name: str) -> bool:
    """Not the training step's Slurm variables (they would contradict ``--jobid=HOLDER``), and not the job's
    ``--clockwork-*`` options (``CLOCKWORK_FT``, ...): srun's SPANK plugin reads those as options, and the
    holder's step is no Clockwork job step of its own. CLOCKWORK_CONFIG stays (the rank reads it)."""
    if name.startswith(("SLURM_", "SPANK_")):
        return name in _KEEP_SLURM
    if name.startswith("CLOCKWORK_"):
        return name == "CLOCKWORK_CONFIG"
    return True


def guest_environment(
    environ: Mapping[str, str],
    *,
    job_id: int,
    endpoints: Sequence[str],
    world_size: int,
    key_hex: str,
    ranks_per_node: int = 1,
) -> dict[str, str]:
    """The guest step's environment: the agent's, minus the training step's Slurm variables, plus the job's
    coordinator endpoints and key, and G (``ranks_per_node``): how many spare slots the borrowed node offers.
    G is the job's, set here whatever the agent's own environment says (``--nproc-per-node`` on the agents'
    command line never reaches their environment)."""
    env = {k: v for k, v in environ.items() if _passed_to_guest(k)}
    env.update(
        {
            ENV_GUEST_ENDPOINTS: ",".join(endpoints),
            ENV_GUEST_WORLD: str(world_size),
            ENV_GUEST_JOB: str(job_id),
            ENV_JOB_KEY: key_hex,
            ENV_RANKS_PER_NODE: str(ranks_per_node),
        }
    )
    return env


def guest_command(
    srun: str,
    python: str,
    holder: int,
    node: str,
    script: str,
    script_args: Sequence[str],
    container_args: Sequence[str] = (),
    gres: str = "",
) -> list[str]:
    """``srun`` into the holder allocation: one task on the borrowed node running the guest agent, in the job's
    container (``container_args``: :meth:`torchpass.launch.container.ContainerSpec.srun_args`), asking for the GRES
    per node the holder asked for (the job's own, ``gpu:8``). Slurm gives a step the GRES its job asked for anyway,
    but none of those an ``--exclusive`` job got implicitly: the request says which it needs."""
    if gres and not _GRES.fullmatch(gres):
        raise ValueError(f"not a GRES specification: {gres!r}")
    return [
        srun,
        f"--jobid={holder}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=0",
        *container_args,
        "--job-name=torchpass-guest",
        *([f"--gres={gres}"] if gres else []),
        python,
        "-m",
        "torchpass",
        "guest",
        script,
        *script_args,
    ]


@dataclass
class Borrower:
    """Borrows a node for this job when its coordinator needs a spare (see the module docstring)."""

    job_id: int
    connect: Callable[[], BorrowDaemon]  # a fresh daemon client (one per borrowing thread: not thread-safe)
    #: (holder, node, GRES per node) -> the guest's srun
    launch: Callable[[int, str, str], subprocess.Popen[bytes] | None]
    fail: Callable[[str], None]  # fail the job now, with this reason
    lost_node: Callable[[], str] = lambda: ""
    #: whether the coordinator has no vacant slot any more (a guest's spare joined); a guest step that ends before
    #: that never brought its spare (srun refused: say, no Slurm client in a container image)
    filled: Callable[[], bool] = lambda: False
    fallback: str = "fail"  # "fail" or "wait" (for a standby spare)
    timeout_s: float = 120.0  # the whole borrow, daemon and Slurm included
    poll_s: float = 0.2
    event_sink: EventSink | None = None
    guests: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _busy: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False

    def need(self) -> None:
        """The coordinator needs a spare (called on its thread: returns at once)."""
        if not self._busy.acquire(blocking=False):
            log.info("job %d: a borrow is already under way", self.job_id)
            return
        threading.Thread(target=self._run_and_release, name="torchpass-borrow", daemon=True).start()

    def _run_and_release(self) -> None:
        try:
            self.borrow_once()
        finally:
            self._busy.release()

    def borrow_once(self) -> bool:
        """One borrow, start to end (blocking); True when a guest was started on a borrowed node."""
        t0 = time.time()
        lost = self.lost_node()
        try:
            client = self.connect()
        except Exception as exc:
            self._failed(f"no node daemon to borrow through: {type(exc).__name__}: {exc}", t0)
            return False
        try:
            try:
                reply = client.borrow(self.job_id, lost)
            except Exception as exc:  # DaemonError: refused (policy, ownership) or the daemon is unreachable
                self._failed(str(exc), t0)
                return False
            request = int(reply["request"])
            t_asked = time.time()
            deadline = time.monotonic() + self.timeout_s
            state: dict[str, Any] = dict(reply)
            while state.get("state") == "pending":
                if time.monotonic() > deadline:
                    self._failed(f"the node daemon did not finish borrow request {request} in {self.timeout_s:g} s", t0)
                    return False
                time.sleep(self.poll_s)
                try:
                    found = client.borrow_status(self.job_id, request)
                except Exception as exc:
                    self._failed(f"lost the node daemon while borrowing: {exc}", t0)
                    return False
                state = found[0] if found else {"state": "failed", "reason": "the daemon forgot the request"}
        finally:
            client.close()
        if state.get("state") != "acquired":
            self._failed(str(state.get("reason") or f"borrow ended {state.get('state')}"), t0)
            return False
        holder, node, gres = int(state["holder"]), str(state["node"]), str(state.get("gres") or "")
        t_acquired = time.time()
        proc = self.launch(holder, node, gres)
        if proc is not None:
            self.guests.append(proc)
            threading.Thread(
                target=self._watch_guest, args=(proc, holder, node, t0), name="torchpass-guest-watch", daemon=True
            ).start()
        emit(
            self.event_sink,
            log,
            "torchpass.borrowed",
            node=node,
            holder=holder,
            gres=gres,
            from_job=state.get("preempted"),
            lost_node=lost,
            request_ms=round(1000 * (t_asked - t0), 1),
            acquire_ms=round(1000 * (t_acquired - t_asked), 1),
            launch_ms=round(1000 * (time.time() - t_acquired), 1),
            slurm=state.get("timings", {}),
        )
        return proc is not None

    def _watch_guest(self, proc: subprocess.Popen[bytes], holder: int, node: str, t0: float) -> None:
        """A guest step that ends before its spare joined failed to start: say so now, rather than let the job
        wait out spare_timeout_s for a spare that will never come."""
        while True:
            try:
                code = proc.wait(timeout=self.poll_s)
                break
            except subprocess.TimeoutExpired:
                if self.filled():
                    return  # its spare joined: from now on its exit is a member's loss, handled as any other
        if not self.filled() and not self._stopping:
            self._failed(
                f"the guest step on {node} (holder job {holder}) ended with exit {code} before its spare joined "
                "(srun's words are in the job's output)",
                t0,
            )

    def _failed(self, reason: str, t0: float) -> None:
        emit(
            self.event_sink,
            log,
            "torchpass.borrow_failed",
            reason=reason[:500],
            fallback=self.fallback,
            elapsed_ms=round(1000 * (time.time() - t0), 1),
        )
        if self.fallback == "fail":
            self.fail(f"no node could be borrowed ({reason[:300]}); borrow_fallback=fail")
        else:
            print(
                f"torchpass: job {self.job_id}: no node could be borrowed ({reason}); waiting for a standby spare",
                file=sys.stderr,
            )

    def stop(self) -> None:
        """End the guests' sruns (the job is over; the Epilog gives the nodes back)."""
        self._stopping = True
        for proc in self.guests:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.guests:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def spawn_guest(
    srun: str,
    python: str,
    script: str,
    script_args: Sequence[str],
    env: Mapping[str, str],
    container_args: Callable[[str], Sequence[str]] = lambda node: (),
) -> Callable[[int, str, str], subprocess.Popen[bytes] | None]:
    """The real launcher: ``srun`` the guest into the holder allocation (its own session, so a signal meant
    for the agent's step does not reach it before the agent decides), in the job's container
    (``container_args``: the options for a step on that node)."""

    def launch(holder: int, node: str, gres: str = "") -> subprocess.Popen[bytes] | None:
        try:
            cmd = guest_command(srun, python, holder, node, script, script_args, container_args(node), gres)
            return subprocess.Popen(cmd, env=dict(env), start_new_session=True)
        except (OSError, ValueError) as exc:
            log.error("cannot start the guest on %s (holder %d): %s", node, holder, exc)
            return None

    return launch
