"""Rank and spare processes forked from a process that has already imported torch (the launcher's zygote).

Why: ``import torch`` (with ``torch.distributed`` and the ``torch._dynamo`` that DDP pulls in) costs about
5 s of CPU per process on a small node, every rank, every spare and every replacement. A local job with three
ranks and two spares paid it five times at start and once more per failure, and a spare was only useful once
it had paid it. The zygote pays it once: each process is then a ``fork`` (milliseconds) that runs the script
as ``python SCRIPT ARGS`` (or ``python -m torchpass.transparent.bootstrap SCRIPT ARGS``) would, in a process whose
pages it shares until they are written. PyTorch's own DataLoader forks workers after ``import torch`` the
same way; nothing here initialises CUDA or starts a thread pool before the fork.

The zygote (``python -m torchpass.launch.zygote FD MODULE...``, the modules it preloads) reads requests from a socket
(one JSON line each: argv, environment, working directory), answers each with the child's pid, and reports
each child's exit status as ``subprocess.Popen`` would (negative: killed by that signal). It dies with its
launcher (``PR_SET_PDEATHSIG``) and exits when the launcher closes the socket, at once: the interpreter's own
exit with torch loaded costs ~0.6 s that the launcher would wait for. The children die with it (they set the
same on their parent).

:class:`Zygote` is the launcher's (or node agent's) side; :class:`ForkedProcess` the handle it gives out, with
the part of ``Popen``'s interface they use. Under Slurm each node agent has its own zygote (``zygote = true``),
so a rank that dies on a healthy node is replaced by a fork, not a new interpreter. This module imports torch
only in the zygote process itself.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import setproctitle

from torchpass.launch.warmup import framework_modules
from torchpass.rank_env import die_with_parent

__all__ = [
    "ENV_WARM_ZYGOTE",
    "PRELOAD",
    "ForkedProcess",
    "WarmZygoteRefused",
    "Zygote",
    "ZygoteError",
    "fork_from_server",
    "start_process",
    "start_zygote",
]

log = logging.getLogger("clockwork.torchpass.zygote")

# What every rank imports anyway: torch, and TorchPass's rank side (another second of CPU per process, zmq,
# msgpack and h5py with it; none of them starts a thread or opens a file at import, so the fork copies no state)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchpass.rank.start")
OPTIONAL = "--optional"  # on the zygote's command line: the modules after it may fail to import
READY = "ready"
TITLE_ROOM = " " * 512  # the zygote's last argument: room in its argv for the titles of the processes it forks
START_TIMEOUT_S = 120.0  # the zygote's own import of torch on a loaded node


class ZygoteError(RuntimeError):
    """The zygote is not running (it failed to start, or died): the launcher starts processes itself."""


# ----- the zygote process -------------------------------------------------------------------------


def _send(sock: socket.socket, doc: dict[str, Any]) -> None:
    sock.sendall(json.dumps(doc).encode() + b"\n")


def _run_child(sock: socket.socket, request: dict[str, Any], zygote_pid: int) -> None:
    """In the forked child: become ``python ARGV`` in the request's environment; never returns."""
    sock.close()
    die_with_parent(zygote_pid)  # fork cleared it: the child dies with the zygote, which dies with the launcher
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the handlers a fresh interpreter has
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path was built from the zygote's PYTHONPATH at its start: add what the child's adds.
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        argv: list[str] = list(request["argv"])
        # `ps` shows the command the child stands for, not the zygote's (its pages are the zygote's).
        setproctitle.setproctitle(shlex.join([sys.executable, *argv]))
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    # What the interpreter does at exit, in its order: wait for non-daemon threads, run atexit callbacks.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    _exit_now(code & 0xFF)


def _exit_now(code: int) -> NoReturn:
    """Leave at once, streams flushed, without the interpreter's teardown (the children do the same)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def preload_modules(names: Sequence[str]) -> None:
    """Import ``names``; those after ``OPTIONAL`` may fail (logged: each process then imports it itself)."""
    optional = False
    for name in names:
        if name == OPTIONAL:
            optional = True
        elif not optional:
            importlib.import_module(name)
        else:
            try:  # a framework the script imports: without it each child imports it itself (and fails there)
                importlib.import_module(name)
            except Exception as exc:
                log.warning("zygote: preloading %s failed (%s); each process imports it itself", name, exc)


def serve(fd: int, preload: Sequence[str]) -> None:
    """The zygote's main (``python -m torchpass.launch.zygote FD MODULE...``)."""
    die_with_parent()
    # Before any child clears its environment: setproctitle finds its room (argv and environ) the first time.
    named = " ".join(name for name in preload if name != OPTIONAL)
    setproctitle.setproctitle(f"torchpass zygote (preloaded: {named or 'nothing'})")
    preload_modules(preload)
    serve_on(socket.socket(fileno=fd), os.getpid())


def serve_on(sock: socket.socket, zygote_pid: int) -> NoReturn:
    """The zygote's loop on ``sock``: say ready, fork a child per request, report the children's ends."""
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select through the wakeup fd
    _send(sock, {"op": READY, "pid": zygote_pid})
    buffer = b""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            wake_r.recv(4096)
        _reap(sock)
        if sock not in ready:
            continue
        data = sock.recv(1 << 16)
        if not data:
            # The launcher closed its end: the job is over. The zygote holds nothing to clean up, and a normal
            # interpreter exit with torch (and a framework) loaded takes ~0.6 s of CPU that the launcher waits for.
            _exit_now(0)
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                wake_r.close()
                wake_w.close()
                _run_child(sock, request, zygote_pid)
            _send(sock, {"op": "started", "id": request["id"], "pid": pid})


# ----- the launcher's side ------------------------------------------------------------------------


ENV_WARM_ZYGOTE = "TORCHPASS_WARM_ZYGOTE"  # a warm zygote server's socket (zygote_server.py)
ANSWER_TIMEOUT_S = 30.0


class WarmZygoteRefused(RuntimeError):
    """The server cannot give this launcher its zygote (the reason is the message); the launcher starts its own."""


def torchpass_home() -> str:
    """The folder of the TorchPass this process runs (a server serves only launchers of the same)."""
    return str(Path(__file__).resolve().parents[1])


def fork_from_server(
    path: str, python: str, env: Mapping[str, str], preload: Sequence[str], optional: Sequence[str]
) -> tuple[socket.socket, dict[str, Any]]:
    """A socket to a zygote forked from the server at ``path``, for a launcher whose zygote would run ``python``
    in ``env`` and preload ``preload`` and the ``optional`` frameworks, and the zygote's "ready" message (read
    from it). Raises :class:`WarmZygoteRefused` when the server is unreachable or must not serve this launcher."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ANSWER_TIMEOUT_S)
    try:
        sock.connect(path)
        request = {
            "python": os.path.realpath(python),
            "torchpass": torchpass_home(),
            "preload": list(preload),
            "env": dict(env),
            "optional": list(optional),
            "cwd": os.getcwd(),
            "umask": _umask(),
        }
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        first = b""
        while not first.endswith(b"\n"):
            data = sock.recv(1 << 16)
            if not data:
                raise WarmZygoteRefused(f"the warm zygote server at {path} closed the connection")
            first += data
    except OSError as exc:
        sock.close()
        raise WarmZygoteRefused(f"the warm zygote server at {path} is not reachable: {exc}") from None
    except WarmZygoteRefused:
        sock.close()
        raise
    answer = json.loads(first)
    if not isinstance(answer, dict) or answer.get("op") != READY:
        sock.close()
        why = answer.get("why") if isinstance(answer, dict) else answer
        raise WarmZygoteRefused(f"the warm zygote server at {path} refused: {why}")
    sock.settimeout(None)
    return sock, answer


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ForkedProcess:
    """A process the zygote forked: ``pid``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.pump(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if not self.zygote.pump(left) and self.returncode is None:
                raise ZygoteError(f"the zygote died before reporting pid {self.pid}")
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _OtherProcess:
    """A zygote forked from a warm zygote server (:mod:`torchpass.launch.zygote_server`), not this process's
    child: waited for through a pidfd (its exit status is the server's to reap, so it reads as 0)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            self._gone()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0.0)
            self._gone()
        return self.returncode or 0

    def kill(self) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def _gone(self) -> None:
        self.returncode = 0
        os.close(self.pidfd)


class Zygote:
    """Starts ``python -m torchpass.launch.zygote`` (or forks one from a warm zygote server named by
    ``TORCHPASS_WARM_ZYGOTE`` in ``env``: :mod:`torchpass.launch.zygote_server`) and asks it for processes (from
    one thread only)."""

    def __init__(
        self, python: str, env: Mapping[str, str], preload: Sequence[str] = PRELOAD, optional: Sequence[str] = ()
    ) -> None:
        self.children: dict[int, ForkedProcess] = {}
        self._exited: dict[int, int] = {}  # exit reports that came before their "started" answer
        self._answers: dict[int, int] = {}
        self._buffer = b""
        self._next_id = 0
        self.alive = True
        warm = env.get(ENV_WARM_ZYGOTE, "")
        if warm:
            try:
                self.sock, said = fork_from_server(warm, python, env, preload, optional)
                self.proc: subprocess.Popen[bytes] | _OtherProcess = _OtherProcess(int(said["pid"]))
                return
            except WarmZygoteRefused as exc:
                log.info("%s: starting this job's own zygote", exc)
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            [python, "-m", "torchpass.launch.zygote", str(theirs.fileno()), *preload, OPTIONAL, *optional, TITLE_ROOM],
            # setproctitle leaves the environment's memory alone (a title has TITLE_ROOM in the argv): a forked
            # process's /proc/PID/environ is then the zygote's, SLURM_JOB_ID and all, for the tools that map
            # processes to jobs by it, not zeros.
            env={**env, "SPT_NOENV": "1"},
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        ready = self._next_message(START_TIMEOUT_S)
        if ready is None or ready.get("op") != READY:
            self.close()
            raise ZygoteError(f"the zygote did not start (exit status {self.proc.poll()})")

    def fileno(self) -> int:
        return self.sock.fileno()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
        """A new process running ``python ARGV`` (without the interpreter) in ``env``."""
        if not self.alive:
            raise ZygoteError("the zygote is not running")
        request_id = self._next_id
        self._next_id += 1
        try:
            _send(self.sock, {"id": request_id, "argv": list(argv), "env": dict(env), "cwd": os.getcwd()})
        except OSError as exc:
            self.alive = False
            raise ZygoteError(f"the zygote is gone: {exc}") from None
        while request_id not in self._answers:
            if not self.pump(START_TIMEOUT_S):
                raise ZygoteError("the zygote died while starting a process")
        child = ForkedProcess(self, self._answers.pop(request_id))
        child.returncode = self._exited.pop(child.pid, None)
        self.children[child.pid] = child
        return child

    def pump(self, timeout: float | None) -> bool:
        """Read what the zygote said within ``timeout`` seconds; False once it is gone."""
        message = self._next_message(timeout)
        while message is not None:
            if message.get("op") == "started":
                self._answers[int(message["id"])] = int(message["pid"])
            elif message.get("op") == "exited":
                pid, code = int(message["pid"]), int(message["code"])
                child = self.children.get(pid)
                if child is None:
                    self._exited[pid] = code
                else:
                    child.returncode = code
            message = self._next_message(0)
        return self.alive

    def _next_message(self, timeout: float | None) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            if not self.alive:
                return None
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            data = self.sock.recv(1 << 16)
            if not data:
                self._on_death()
                return None
            self._buffer += data
            timeout = 0
        line, self._buffer = self._buffer.split(b"\n", 1)
        doc = json.loads(line)
        return doc if isinstance(doc, dict) else None

    def _on_death(self) -> None:
        self.alive = False
        code = self.proc.wait()
        log.warning("the zygote exited with %s", code)
        for child in self.children.values():  # its children died with it (PR_SET_PDEATHSIG)
            if child.returncode is None:
                child.returncode = -signal.SIGKILL

    def close(self) -> None:
        """End the zygote (its remaining children die with it)."""
        self.alive = False
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_zygote(python: str, env: Mapping[str, str], script: str, *, preload_frameworks: bool) -> Zygote | None:
    """The zygote of a launcher or node agent, preloading the frameworks ``script`` imports (lightning,
    transformers: seconds of CPU per process otherwise) when ``preload_frameworks``; None, logged, when it
    cannot start: every process then starts its own interpreter."""
    try:
        return Zygote(python, env, optional=framework_modules(script) if preload_frameworks else ())
    except ZygoteError as exc:
        log.warning("%s: every process starts its own interpreter", exc)
        return None


def start_process(
    zygote: Zygote | None, argv: Sequence[str], env: Mapping[str, str]
) -> tuple[subprocess.Popen[bytes] | ForkedProcess, int | None]:
    """``argv`` (``[python, ARGS...]``) forked from ``zygote`` while it runs, else a fresh interpreter; and a pidfd
    that turns readable when the fresh interpreter exits (None for a forked process, whose exit the zygote
    reports, or where the kernel has no pidfds: poll then)."""
    if zygote is not None and zygote.alive:
        try:
            return zygote.spawn(argv[1:], env), None
        except ZygoteError as exc:
            log.warning("%s: starting processes without it from now on", exc)
    proc = subprocess.Popen(list(argv), env=dict(env))
    try:
        return proc, os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc, None


if __name__ == "__main__":
    serve(int(sys.argv[1]), [name for name in sys.argv[2:] if name != TITLE_ROOM])
