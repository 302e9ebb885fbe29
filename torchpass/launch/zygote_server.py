"""A warm zygote server: one process that imported torch once, from which local launchers fork their zygotes.

Why: every local job's zygote imports torch (with ``torch.distributed``, ``torch._dynamo`` and TorchPass's rank
side), about 4-5 s of CPU on a small machine, before its first rank can start. A host that launches many short
local jobs in a row (a CI suite: a few hundred jobs; a notebook trying settings) pays it every time. With
``TORCHPASS_WARM_ZYGOTE=SOCKET`` in the launcher's environment, and the server below listening there
(``python -m torchpass.launch.zygote_server SOCKET``), the launcher's zygote is a ``fork`` of the server instead:
it then works exactly as a zygote started by the launcher (:mod:`torchpass.launch.zygote`), over the same socket
protocol.

The forked zygote must be indistinguishable from one the launcher would have started, so the server serves a
launcher only when that holds, and says why not otherwise (the launcher then starts its own, and logs the reason):

* the same user, the same namespaces (network, mount, UTS, PID, IPC, user, cgroup) and the same session: a
  Slurm node agent, a container's launcher or a launcher in a session of its own gets its own zygote;
* the same interpreter and the same TorchPass (the server preloaded it);
* the same environment where it matters at import time (``OMP_*``, ``MKL_*``, ``OPENBLAS_*``, ``KMP_*``,
  ``GOMP_*``, ``TORCH_*``, ``LD_*``, ``PYTHON*`` but ``PYTHONPATH``, which the zygote's children add themselves).

The forked zygote takes the launcher's standard streams (passed over the socket), working directory, umask and
process group, so what its children print and which signals reach them are as before; it exits when the launcher
closes the socket (or dies), not with the server. Only ``/proc/PID/environ`` differs: the server's memory, not
the launcher's (local jobs only; no Slurm job is ever served). Not for production nodes; meant for CI and
development hosts (the test suite runs one per pytest worker: tests/conftest.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import setproctitle

from torchpass.launch.zygote import (
    ANSWER_TIMEOUT_S,
    ENV_WARM_ZYGOTE,
    OPTIONAL,
    PRELOAD,
    TITLE_ROOM,
    preload_modules,
    serve_on,
    torchpass_home,
)

__all__ = ["ENV_WARM_ZYGOTE", "import_environment", "serve_warm", "server_argv"]

log = logging.getLogger("clockwork.torchpass.zygote")

IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH_", "LD_", "PYTHON")
ADAPTED = frozenset({"PYTHONPATH"})  # the zygote's children add the launcher's entries to sys.path themselves
NAMESPACES = ("net", "mnt", "uts", "pid", "ipc", "user", "cgroup")


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that a process importing torch reads at import time (thread pools, libraries, the
    interpreter's own flags): what must match between the server and a launcher it serves."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in ADAPTED}


# ----- the server ----------------------------------------------------------------------------------


def _peer(conn: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _why_not(request: dict[str, Any], pid: int, uid: int, preloaded: Sequence[str]) -> str:
    """Why the server, which preloaded ``preloaded``, must not serve the launcher ``pid`` (empty: it may)."""
    if uid != os.getuid():
        return f"uid {uid} is not the server's ({os.getuid()})"
    for ns in NAMESPACES:
        try:
            theirs, ours = os.stat(f"/proc/{pid}/ns/{ns}").st_ino, os.stat(f"/proc/self/ns/{ns}").st_ino
        except OSError as exc:
            return f"cannot compare the {ns} namespace: {exc}"
        if theirs != ours:
            return f"another {ns} namespace"
    if os.getsid(pid) != os.getsid(0):
        return "another session"
    if request.get("python") != os.path.realpath(sys.executable):
        return f"another interpreter ({request.get('python')}, the server runs {os.path.realpath(sys.executable)})"
    if request.get("preload") != list(preloaded):
        return f"other modules to preload ({request.get('preload')}, the server preloaded {list(preloaded)})"
    if request.get("torchpass") != torchpass_home():
        return f"another TorchPass ({request.get('torchpass')}, the server preloaded {torchpass_home()})"
    theirs_env, ours_env = import_environment(request.get("env", {})), import_environment(os.environ)
    differ = sorted(k for k in theirs_env.keys() | ours_env.keys() if theirs_env.get(k) != ours_env.get(k))
    if differ:
        return f"the environment differs where torch's import reads it: {', '.join(differ)}"
    return ""


def _become_zygote(
    conn: socket.socket, fds: list[int], request: dict[str, Any], launcher: int, preloaded: Sequence[str]
) -> NoReturn:
    """In the forked child: take the launcher's streams, folder, umask and process group, then serve it as its
    zygote until it closes the socket."""
    try:
        os.setpgid(0, os.getpgid(launcher))
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        os.environ.clear()
        os.environ.update(request["env"])
        optional = [str(name) for name in request.get("optional", [])]
        setproctitle.setproctitle(f"torchpass zygote (forked warm: {' '.join([*preloaded, *optional])})")
        preload_modules([OPTIONAL, *optional])
    except BaseException as exc:
        try:
            why = f"the forked zygote failed to start: {exc}"
            conn.sendall(json.dumps({"op": "refused", "why": why}).encode() + b"\n")
        finally:
            os._exit(1)
    serve_on(conn, os.getpid())


def server_argv(python: str, path: str, preload: Sequence[str] = ()) -> list[str]:
    """The server's command line: ``path``, the modules to preload (default: a launcher's zygote's,
    ``zygote.PRELOAD``), and room in its argv for the titles of the processes forked from it (setproctitle must
    leave the environment's memory alone: run it with ``SPT_NOENV=1``)."""
    return [python, "-m", "torchpass.launch.zygote_server", path, *preload, TITLE_ROOM]


def serve_warm(path: str, preload: Sequence[str]) -> NoReturn:
    """The server's loop (``python -m torchpass.launch.zygote_server SOCKET [MODULE...]``): preload, listen,
    fork a zygote per launcher it may serve."""
    preloaded = tuple(preload) or PRELOAD
    os.environ.setdefault("SPT_NOENV", "1")
    setproctitle.setproctitle(f"torchpass warm zygote server {path}")
    preload_modules(preloaded)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked zygotes are reaped by the kernel
    old = os.umask(0o077)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    os.umask(old)
    listener.listen(64)
    print(f"torchpass: warm zygote server ready at {path}", file=sys.stderr, flush=True)
    while True:
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(ANSWER_TIMEOUT_S)
            pid, uid = _peer(conn)
            data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            while not data.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    raise ConnectionError("the launcher closed the connection mid-request")
                data += more
            request = json.loads(data)
            ok = isinstance(request, dict) and len(fds) == 3
            why = _why_not(request, pid, uid, preloaded) if ok else "a malformed request"
            if why:
                conn.sendall(json.dumps({"op": "refused", "why": why}).encode() + b"\n")
            elif os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                conn.settimeout(None)
                _become_zygote(conn, fds, request, pid, preloaded)
        except Exception as exc:  # one bad launcher never stops the server
            log.warning("warm zygote server: a request failed: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_warm(sys.argv[1], [name for name in sys.argv[2:] if name.strip()])
