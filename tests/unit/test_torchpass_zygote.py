"""The zygote runs a script as ``python SCRIPT`` would, and reports each child's end as ``Popen`` would.

These zygotes preload only ``json`` (the launcher's preloads torch); the oracle tests run every local job
through the real one, and one job with ``zygote=false`` (fresh interpreters) against the same reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchpass.launch.zygote import Zygote, ZygoteError


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote(sys.executable, dict(os.environ), preload=("json",))
    yield z
    z.close()


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_child_runs_the_script_as_main_with_its_argv_env_cwd_and_path(
    zygote: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "helper.py").write_text("VALUE = 'from the script folder'\n")
    out = tmp_path / "out.txt"
    script = _script(
        tmp_path,
        f"""
        import os, sys, helper
        assert __name__ == "__main__"
        open({str(out)!r}, "w").write(repr((sys.argv, os.environ["CW_ZYGOTE_TEST"], os.getcwd(), helper.VALUE)))
        """,
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    child = zygote.spawn([str(script), "--lr", "1"], {**os.environ, "CW_ZYGOTE_TEST": "yes"})
    assert child.wait(timeout=60) == 0
    assert out.read_text() == repr(([str(script), "--lr", "1"], "yes", str(work), "from the script folder"))


def test_module_mode_runs_the_module_as_main(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    _script(tmp_path, f"import sys\nopen({str(out)!r}, 'w').write(repr((__name__, sys.argv[1:])))\n", "cwmod.py")
    # A module the zygote never imported, found through sys.path as `python -m` finds it.
    child = zygote.spawn(["-m", "cwmod", "a", "b"], {**os.environ, "PYTHONPATH": str(tmp_path)})
    assert child.wait(timeout=60) == 0
    assert out.read_text() == repr(("__main__", ["a", "b"]))


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("pass", 0),
        ("import sys; sys.exit(3)", 3),
        ("raise SystemExit('bad input')", 1),
        ("raise RuntimeError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ],
    ids=["ok", "exit-3", "exit-message", "exception", "sigkill"],
)
def test_exit_status_is_popens(zygote: Zygote, tmp_path: Path, body: str, code: int) -> None:
    child = zygote.spawn([str(_script(tmp_path, body))], dict(os.environ))
    assert child.wait(timeout=60) == code
    assert child.poll() == code


def test_atexit_callbacks_and_non_daemon_threads_finish_before_the_exit(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = _script(
        tmp_path,
        f"""
        import atexit, threading, time
        def late():
            time.sleep(0.2)
            open({str(out)!r}, "a").write("thread\\n")
        threading.Thread(target=late).start()
        atexit.register(lambda: open({str(out)!r}, "a").write("atexit\\n"))
        """,
    )
    assert zygote.spawn([str(script)], dict(os.environ)).wait(timeout=60) == 0
    assert out.read_text() == "thread\natexit\n"


def test_kill_and_terminate_and_wait_timeout(zygote: Zygote, tmp_path: Path) -> None:
    script = _script(tmp_path, "import time\nwhile True: time.sleep(1)\n")
    child = zygote.spawn([str(script)], dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    # What `ps` shows is the command the child stands for (setproctitle), not the zygote's.
    title = f"{sys.executable} {script}"
    deadline = time.monotonic() + 60
    while title not in Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
        assert time.monotonic() < deadline, Path(f"/proc/{child.pid}/cmdline").read_bytes()
        time.sleep(0.05)
    child.terminate()
    assert child.wait(timeout=60) == -signal.SIGTERM
    other = zygote.spawn([str(script)], dict(os.environ))
    other.kill()
    assert other.wait(timeout=60) == -signal.SIGKILL


def test_a_childs_proc_environ_is_the_zygotes_not_zeros(tmp_path: Path) -> None:
    """Tools that map processes to jobs read /proc/PID/environ (SLURM_JOB_ID); setting a child's title must not
    wipe it, even with a title longer than the zygote's own command line."""
    z = Zygote(sys.executable, {**os.environ, "SLURM_JOB_ID": "4242"}, preload=("json",))
    try:
        script = _script(tmp_path, "import time\nwhile True: time.sleep(1)\n", "a" * 150 + ".py")
        child = z.spawn([str(script), "--steps", "1000"], dict(os.environ))
        title = f"{sys.executable} {script} --steps 1000"
        deadline = time.monotonic() + 60
        while title not in Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
            assert time.monotonic() < deadline, Path(f"/proc/{child.pid}/cmdline").read_bytes()
            time.sleep(0.05)
        assert b"SLURM_JOB_ID=4242" in Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
        child.kill()
        child.wait(timeout=60)
    finally:
        z.close()


def test_children_die_with_the_zygote(tmp_path: Path) -> None:
    z = Zygote(sys.executable, dict(os.environ), preload=("json",))
    child = z.spawn([str(_script(tmp_path, "import time\nwhile True: time.sleep(1)\n"))], dict(os.environ))
    started = _start_time(child.pid)
    assert started is not None
    z.proc.kill()
    assert child.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(ZygoteError):
        z.spawn(["x.py"], dict(os.environ))
    z.close()
    deadline = time.monotonic() + 60
    while _start_time(child.pid) == started:  # the kernel kills it when the zygote dies (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, f"pid {child.pid} outlived its zygote"
        time.sleep(0.05)


def _start_time(pid: int) -> int | None:
    """When the live process ``pid`` started (None: gone, or a zombie): tells it apart from a reused pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def test_closing_ends_the_zygote_at_once_without_its_interpreters_teardown(tmp_path: Path) -> None:
    """When the launcher closes its end, the zygote leaves with status 0 and skips the interpreter's exit (the
    atexit callbacks and module teardown of torch and a framework: ~0.6 s of CPU that every local job waited
    for at its end)."""
    marker = tmp_path / "teardown-ran"
    (tmp_path / "registers_atexit_cw.py").write_text(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).write_text, 'x')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    z = Zygote(sys.executable, env, preload=("json", "registers_atexit_cw"))
    z.close()
    assert z.proc.returncode == 0
    assert not marker.exists(), "the zygote ran its interpreter's exit"


def test_a_zygote_that_cannot_preload_says_so() -> None:
    with pytest.raises(ZygoteError, match="did not start"):
        Zygote(sys.executable, dict(os.environ), preload=("no_such_module_cw",))


def test_a_framework_the_zygote_cannot_preload_is_left_to_each_process(tmp_path: Path) -> None:
    """The script's frameworks are preloaded as optional: one that fails to import leaves the zygote running
    (each forked process then imports it itself, and fails where the user expects it)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.exit(0 if 'colorsys' in sys.modules else 3)\n")
    zygote = Zygote(sys.executable, dict(os.environ), preload=("json",), optional=("no_such_framework_cw", "colorsys"))
    try:
        child = zygote.spawn([str(probe)], dict(os.environ))
        assert child.wait(timeout=60) == 0, "the optional module that imports was not preloaded"
    finally:
        zygote.close()
