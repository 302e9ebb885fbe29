"""The warm zygote server gives a launcher a zygote that works as the launcher's own would, and only then.

These servers preload only ``json`` (the suite's own server, tests/conftest.py, preloads torch for every local
job); each test starts one and launches zygotes against it as a local launcher does (``Zygote``), or as another
process would (a session of its own, another user, another import-time environment).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable, until
from torchpass.launch.zygote import Zygote
from torchpass.launch.zygote_server import ENV_WARM_ZYGOTE, import_environment, server_argv

PRELOAD = ("json",)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    path = str(tmp_path / "warm.sock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPT_NOENV": "1"}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(server_argv(sys.executable, path, PRELOAD), env=env, stdout=log, stderr=log)
    until("the server to listen", lambda: os.path.exists(path) or proc.poll() is not None, 60)
    assert proc.poll() is None, (tmp_path / "server.log").read_text()
    yield proc, path
    proc.kill()
    proc.wait()


def _launcher_env(path: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", ENV_WARM_ZYGOTE: path, **extra}


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            print("child says hello", flush=True)
            with open(sys.argv[1], "w") as f:
                seen = {"pgid": os.getpgid(0), "cwd": os.getcwd(), "x": os.environ.get("X"), "umask": os.umask(0)}
                json.dump(seen, f)
            """
        )
    )
    return script


def test_a_launcher_forks_its_zygote_from_the_server_and_it_works_as_its_own(
    server: tuple[subprocess.Popen[bytes], str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    proc, path = server
    env = _launcher_env(path, X="the launcher's")
    script, out = _script(tmp_path), tmp_path / "out.json"
    os.chdir(tmp_path)
    old_umask = os.umask(0o027)
    try:
        zygote = Zygote(sys.executable, env, preload=PRELOAD)
        try:
            assert _ppid(zygote.proc.pid) == proc.pid  # forked from the server, not started here
            child = zygote.spawn([str(script), str(out)], env)
            assert child.wait(30) == 0
        finally:
            zygote.close()
    finally:
        os.umask(old_umask)
    seen = json.loads(out.read_text())
    # the launcher's process group (signals to the job's group reach it), folder, umask and environment
    assert seen == {"pgid": os.getpgid(0), "cwd": str(tmp_path), "x": "the launcher's", "umask": 0o027}
    assert "child says hello" in capfd.readouterr().out  # the launcher's standard output, not the server's
    assert not Path(f"/proc/{zygote.proc.pid}").exists() or _ppid(zygote.proc.pid) != proc.pid  # gone with close


def test_the_forked_zygote_outlives_the_server_and_ends_with_its_launcher(
    server: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    proc, path = server
    env = _launcher_env(path)
    zygote = Zygote(sys.executable, env, preload=PRELOAD)
    pid = zygote.proc.pid
    proc.kill()  # a running job keeps its zygote when the server goes
    proc.wait()
    script, out = _script(tmp_path), tmp_path / "out.json"
    assert zygote.spawn([str(script), str(out)], env).wait(30) == 0
    zygote.close()  # the launcher's end closed: the zygote exits
    until("the forked zygote to exit", lambda: not Path(f"/proc/{pid}").exists(), 30)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"OMP_NUM_THREADS": "3"}, "the environment differs where torch's import reads it: OMP_NUM_THREADS"),
        ({"TORCH_SHOW_CPP_STACKTRACES": "1"}, "TORCH_SHOW_CPP_STACKTRACES"),
    ],
)
def test_a_launcher_whose_import_environment_differs_gets_its_own_zygote(
    server: tuple[subprocess.Popen[bytes], str], extra: dict[str, str], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, path = server
    caplog.set_level("INFO", logger="clockwork.torchpass.zygote")
    zygote = Zygote(sys.executable, _launcher_env(path, **extra), preload=PRELOAD)
    try:
        assert _ppid(zygote.proc.pid) == os.getpid()  # its own, started here
    finally:
        zygote.close()
    assert why in caplog.text and "starting this job's own zygote" in caplog.text


def test_other_preloads_are_refused(
    server: tuple[subprocess.Popen[bytes], str], caplog: pytest.LogCaptureFixture
) -> None:
    _, path = server
    caplog.set_level("INFO", logger="clockwork.torchpass.zygote")
    zygote = Zygote(sys.executable, _launcher_env(path), preload=("json", "csv"))
    try:
        assert _ppid(zygote.proc.pid) == os.getpid()
    finally:
        zygote.close()
    assert "other modules to preload" in caplog.text


DRIVER = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from torchpass.launch.zygote import Zygote, ZygoteError
if os.environ.get("AS_NOBODY"):  # after the imports: the venv may be unreadable to nobody
    os.setgid(65534)
    os.setuid(65534)
try:
    z = Zygote(sys.executable, dict(os.environ), preload=("json",))
except (ZygoteError, OSError) as exc:  # nobody may not run the venv's python: the refusal is what counts
    print("no zygote:", exc)
    sys.exit(0)
stat = open(f"/proc/{z.proc.pid}/stat").read().rsplit(")", 1)[1].split()
print("parent of the zygote:", "me" if stat[1] == str(os.getpid()) else "other")
z.close()
"""


def _drive(path: str, as_nobody: bool = False, **popen: object) -> str:
    env = _launcher_env(path, **({"AS_NOBODY": "1"} if as_nobody else {}))
    result = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=120, **popen
    )  # type: ignore[call-overload]
    assert result.returncode == 0, result.stderr
    return str(result.stdout)


def test_a_launcher_in_another_session_gets_its_own_zygote(server: tuple[subprocess.Popen[bytes], str]) -> None:
    _, path = server
    out = _drive(path, start_new_session=True)
    assert "refused: another session" in out and "parent of the zygote: me" in out
    assert "parent of the zygote: other" in _drive(path)  # the same launcher in the server's session is served


def test_another_user_cannot_reach_the_server(server: tuple[subprocess.Popen[bytes], str]) -> None:
    if os.getuid() != 0:
        unavailable("running a launcher as another user needs root")
    _, path = server
    out = _drive(path, as_nobody=True, cwd="/")
    assert "is not reachable" in out and "Permission denied" in out, out


def test_a_malformed_request_is_dropped_and_the_next_launcher_served(
    server: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    proc, path = server
    for junk in (b"not json at all\n", json.dumps({"python": sys.executable}).encode() + b"\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(path)
            sock.sendall(junk)  # and no file descriptors
            answer = sock.recv(4096)
        assert answer in (b"", b'{"op": "refused", "why": "a malformed request"}\n')
    zygote = Zygote(sys.executable, _launcher_env(path), preload=PRELOAD)
    try:
        assert _ppid(zygote.proc.pid) == proc.pid
    finally:
        zygote.close()


def test_import_environment_is_what_torch_reads_at_import_time() -> None:
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TORCH_LOGS": "x",
        "LD_PRELOAD": "y",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": "/a",  # the zygote's children add it themselves
        "TORCHPASS_EVENTS": "/e",  # read by TorchPass at run time, not at import
        "SLURM_JOB_ID": "7",
        "HOME": "/root",
    }
    assert import_environment(env) == {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TORCH_LOGS": "x",
        "LD_PRELOAD": "y",
        "PYTHONHASHSEED": "0",
    }


def test_the_suites_local_jobs_fork_from_the_suites_server() -> None:
    """The session's server (tests/conftest.py) is up, named in the environment every local job inherits, and
    serves a launcher's zygote (torch preloaded) as a local job's launcher asks for it."""
    if os.environ.get("CLOCKWORK_TEST_WARM_ZYGOTE") == "0":
        pytest.skip("the suite runs without its warm zygote server (CLOCKWORK_TEST_WARM_ZYGOTE=0)")
    path = os.environ.get(ENV_WARM_ZYGOTE, "")
    assert path and os.path.exists(path), "tests/conftest.py's warm zygote server is not running"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # what a local launcher's zygote gets (_base_environment)
    zygote = Zygote(sys.executable, env)
    try:
        assert _ppid(zygote.proc.pid) != os.getpid()
        title = Path(f"/proc/{zygote.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert "forked warm: torch torch.distributed" in title, title
    finally:
        zygote.close()
