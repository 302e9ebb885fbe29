"""``torchpass run --local``: the job's ranks and spares as processes on this machine, plus the coordinator.

The launcher is the local stand-in for what Slurm and the node daemon do in production:

* it starts the coordinator (a thread here; one replica per node agent under Slurm) on a free port;
* it starts N rank processes (``TORCHPASS_ROLE=slot:K``) and S spares (``TORCHPASS_ROLE=spare``) running
  the same script, each told the coordinator's address, its worker id and the configuration;
* it forks every child from a zygote that imported torch once (:mod:`torchpass.launch.zygote`; a fresh interpreter
  per child with ``zygote = false``, or when the zygote cannot start);
* it watches every child (through the zygote's reports, or a pidfd), so a process that exits or is killed is
  reported to the coordinator within milliseconds (under Slurm the node daemon sees the process exit);
* when the coordinator hands a spare to a slot it starts a new spare, keeping the pool at S (a standby
  pool of nodes under Slurm is fixed instead), and it kills processes the coordinator evicted as silent;
* it returns 0 when the job finished and every final member exited with 0.

Children are started from the launcher's main thread only: they set ``PR_SET_PDEATHSIG`` and so die with it
(or with the zygote, which dies with the launcher).
This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from torchpass.auth import ENV_JOB_KEY, JobKey, write_coordinator_file
from torchpass.config import ENV_CONFIG, TorchPassConfig
from torchpass.coordinator.service import DONE, Coordinator
from torchpass.events import EventSink
from torchpass.launch.zygote import ForkedProcess, Zygote, start_process, start_zygote
from torchpass.rank_env import LaunchEnv, rank_argv, thread_default

__all__ = ["LocalLauncher", "loopback_interface"]

log = logging.getLogger("clockwork.torchpass.launcher")


def loopback_interface() -> str | None:
    """Name of the loopback interface, so gloo keeps local traffic on 127.0.0.1."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)


@dataclass
class _Child:
    wid: str
    role: str
    proc: subprocess.Popen[bytes] | ForkedProcess
    pidfd: int | None
    code: int | None = None


class LocalLauncher:
    """Runs one TorchPass job locally; :meth:`run` blocks until it ends and returns the exit status."""

    def __init__(
        self,
        script: str,
        script_args: list[str],
        *,
        nproc: int,
        spares: int,
        config: TorchPassConfig,
        event_sink: EventSink | None = None,
        respawn_spares: bool = True,
        python: str = sys.executable,
        host: str = "127.0.0.1",
        coordinator_file: str | None = None,
        exit_grace_s: float = 30.0,
        transparent: bool = False,
    ) -> None:
        if nproc < 1 or spares < 0:
            raise ValueError("need --nproc >= 1 and --spares >= 0")
        self.script = script
        self.script_args = script_args
        self.nproc = nproc
        self.spares = spares
        self.config = config
        self.event_sink = event_sink
        self.respawn_spares = respawn_spares
        self.python = python
        self.host = host
        # The job's key: every socket of the job is CURVE-authenticated with it (torchpass.auth). The
        # coordinator thread reads it from this process's environment, the children inherit it.
        self.key = JobKey.from_environ() or JobKey.new()
        os.environ[ENV_JOB_KEY] = self.key.hex
        self.coordinator_file = Path(
            coordinator_file or Path(tempfile.gettempdir()) / f"torchpass-{os.getpid()}.coordinator"
        )
        self.exit_grace_s = exit_grace_s
        self.transparent = transparent  # ranks run the unmodified script under torchpass.transparent.bootstrap
        self.children: dict[str, _Child] = {}
        self._next_id = 0
        self._spawned_spares = 0
        self._requests: queue.Queue[tuple[str, str]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._signal: int | None = None
        self.zygote: Zygote | None = None
        self.coordinator = Coordinator(
            nproc,
            config,
            event_sink=event_sink,
            bind_host=host,
            on_spare_taken=lambda wid: self._request("spare_taken", wid),
            on_spare_needed=lambda: self._request("spare_needed", ""),
            on_evict=lambda wid: self._request("kill", wid),
        )

    def _request(self, what: str, wid: str) -> None:
        """From the coordinator's thread: ask the main thread to act (it alone forks)."""
        self._requests.put((what, wid))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _base_environment(self) -> dict[str, str]:
        """The launcher's environment, with the thread default every process of the job gets (the zygote's too:
        torch sizes its thread pools when it is imported there)."""
        env = dict(os.environ)
        env.update(thread_default(env, self.nproc))
        env.setdefault("PYTHONUNBUFFERED", "1")  # the children's streams are the launcher's (or the zygote's)
        return env

    def _environment(self, wid: str, role: str, endpoint: str) -> dict[str, str]:
        env = self._base_environment()
        launch = LaunchEnv(endpoint, wid, role, self.nproc, self.host, env.get("SLURM_JOB_ID", ""), True)
        env.update(launch.to_environ())
        env[ENV_CONFIG] = self.config.to_json()
        interface = loopback_interface()
        if interface is not None and self.host.startswith("127."):
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
        return env

    def _spawn(self, role: str) -> _Child:
        wid = f"w{self._next_id}"
        self._next_id += 1
        self.coordinator.expect_worker(wid, role)
        argv = rank_argv(self.python, self.script, self.script_args, transparent=self.transparent)
        env = self._environment(wid, role, self.coordinator.endpoint)
        proc, pidfd = start_process(self.zygote, argv, env)
        child = _Child(wid, role, proc, pidfd)
        self.children[wid] = child
        if role == "spare":
            self._spawned_spares += 1
        log.info("started %s (%s) pid %d", wid, role, proc.pid)
        return child

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signal = signum
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass

    def run(self) -> int:
        """Start everything, supervise until the job ends, and return the launcher's exit status."""
        endpoint = self.coordinator.start()
        write_coordinator_file(self.coordinator_file, endpoint, self.key)
        print(
            f"torchpass: coordinator {endpoint} ({self.nproc} ranks, {self.spares} spares); its address and the "
            f"job key are in {self.coordinator_file} (torchpass status --coordinator FILE; clockwork migrate "
            "--coordinator FILE --rank R)",
            file=sys.stderr,
        )
        if thread_default(os.environ, self.nproc):
            log.info("OMP_NUM_THREADS is unset: each rank runs one intra-op thread, as under torchrun (set it to tune)")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.config.zygote:
                env = self._base_environment()
                self.zygote = start_zygote(self.python, env, self.script, preload_frameworks=self.config.spare_warmup)
            for slot in range(self.nproc):
                self._spawn(f"slot:{slot}")
            for _ in range(self.spares):
                self._spawn("spare")
            return self._supervise()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._terminate_all(grace_s=5.0)
            if self.zygote is not None:
                self.zygote.close()
            self.coordinator.stop()

    def _live(self) -> list[_Child]:
        return [c for c in self.children.values() if c.code is None]

    def _supervise(self) -> int:
        ending_since: float | None = None
        while True:
            live = self._live()
            fds = [c.pidfd for c in live if c.pidfd is not None] + [self._wake_r]
            if self.zygote is not None and self.zygote.alive:
                fds.append(self.zygote.fileno())  # it reports its children's exits
            unwatched = any(c.pidfd is None and not isinstance(c.proc, ForkedProcess) for c in live)
            select.select(fds, [], [], 0.1 if unwatched else 1.0)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            for child in live:
                code = child.proc.poll()
                if code is not None:
                    child.code = code
                    if child.pidfd is not None:
                        os.close(child.pidfd)
                        child.pidfd = None
                    log.info("%s (%s) exited with %d", child.wid, child.role, code)
                    self.coordinator.worker_exited(child.wid, child.role, code)
            self._serve_requests()
            if self._signal is not None:
                print(f"torchpass: signal {self._signal}: stopping the job", file=sys.stderr)
                return 128 + self._signal
            if self.coordinator.finished_event.is_set():
                if not self._live():
                    return self._status()
                ending_since = ending_since or time.monotonic()
                if time.monotonic() - ending_since > self.exit_grace_s:
                    log.warning("processes still running %.0f s after the job ended: stopping them", self.exit_grace_s)
                    return self._status()
            elif not self._live():
                print("torchpass: every process exited before the job finished", file=sys.stderr)
                return 1

    def _serve_requests(self) -> None:
        while True:
            try:
                what, wid = self._requests.get_nowait()
            except queue.Empty:
                return
            if what in ("spare_taken", "spare_needed"):
                limit = self.spares + self.config.max_failures
                ended = self.coordinator.finished_event.is_set()
                if self.respawn_spares and self._spawned_spares < limit and not ended:
                    self._spawn("spare")
            elif what == "kill":
                child = self.children.get(wid)
                if child is not None and child.code is None:
                    child.proc.kill()

    def _status(self) -> int:
        if self.coordinator.state != DONE:
            print(f"torchpass: job failed: {self.coordinator.failure_reason}", file=sys.stderr)
            return 1
        bad = {
            wid: self.children[wid].code
            for wid in self.coordinator.members.values()
            if wid in self.children and self.children[wid].code not in (0, None)
        }
        if bad:
            print(f"torchpass: job finished but some ranks exited with errors: {bad}", file=sys.stderr)
            return 1
        return 0

    def _terminate_all(self, grace_s: float) -> None:
        live = self._live()
        for child in live:
            child.proc.terminate()
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        for child in self.children.values():
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None
