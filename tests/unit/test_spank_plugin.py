"""The SPANK plugin (spank/): it builds with the hardening flags, its C unit tests pass, it exports only
what Slurm looks up, and the real sbatch client lists and validates its options.

sbatch runs against a throwaway slurm.conf whose controller is 127.0.0.1 on a port nothing serves:
``--help`` and option validation happen before any controller is contacted, so a rejected submission
fails with the plugin's message and a valid one fails only at "Unable to contact slurm controller".
No daemon is started. One test replaces the controller with a loopback socket of its own to read
what sbatch would submit (the job's environment under ``--export=NONE``).

Needs gcc, make, the Slurm headers and sbatch (``make venv`` installs them): missing ones fail the
tests in CI (``CI`` set) and skip them elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from clockwork.sandbox.slurm_release import release
from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parents[2]
SPANK = ROOT / "spank"
PLUGIN = SPANK / "clockwork.so"
OPTIONS = ("clockwork-ft", "clockwork-spares", "clockwork-snapshot", "clockwork-linkpass")
#: What Slurm dlsym()s in a SPANK plugin: the callbacks and the SPANK_PLUGIN() symbols.
ALLOWED_EXPORTS = re.compile(r"slurm_spank_\w+|plugin_name|plugin_type|plugin_version|spank_plugin_version")
#: Nothing listens here (see the module docstring); submissions that pass validation fail fast.
UNSERVED_PORT = 16999
NO_CONTROLLER = "Unable to contact slurm controller"
SPARES_MAYBE = "clockwork: --clockwork-spares: invalid value 'maybe' (expected none, standby, borrow)"


def _require(problem: str | None) -> None:
    if problem is None:
        return
    if in_ci():
        pytest.fail(problem + " (CI must run everything)")
    pytest.skip(problem + " (skipped on a developer machine only)")


def _build_problem() -> str | None:
    missing = [tool for tool in ("make", "cc", "nm") if shutil.which(tool) is None]
    if not Path("/usr/include/slurm/spank.h").exists():
        missing.append("the Slurm headers (libslurm-dev)")
    return f"building the SPANK plugin needs {', '.join(missing)}" if missing else None


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(SPANK), *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def plugin() -> Path:
    """spank/clockwork.so, built the way CI builds it."""
    _require(_build_problem())
    build = _make()
    assert build.returncode == 0, f"make -C spank failed:\n{build.stdout}\n{build.stderr}"
    assert PLUGIN.is_file()
    return PLUGIN


def test_unit_tests_pass(plugin: Path) -> None:
    result = _make("test")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"make -C spank test failed:\n{output}"
    summaries = [line for line in result.stdout.splitlines() if re.fullmatch(r"\d+ passed, \d+ failed", line)]
    assert summaries, output
    assert re.fullmatch(r"[1-9]\d* passed, 0 failed", summaries[-1]), output


def test_built_with_hardening_flags(plugin: Path) -> None:
    flags = (SPANK / "Makefile").read_text()
    for flag in ("-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-Werror", "-z,relro", "-z,now"):
        assert flag in flags
    dynamic = subprocess.run(["readelf", "-d", str(plugin)], capture_output=True, text=True, check=True).stdout
    assert "BIND_NOW" in dynamic or re.search(r"FLAGS_1.*\bNOW\b", dynamic)


def _exports(so: Path) -> set[str]:
    nm = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in nm.stdout.splitlines() if line.strip()}


def _plugin_version(so: Path) -> tuple[int, int, int]:
    """The SLURM_VERSION_NUMBER a plugin was built against (its ``plugin_version``, which Slurm checks)."""
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True)
    address = next(int(line.split()[0], 16) for line in symbols.stdout.splitlines() if line.endswith(" plugin_version"))
    sections = subprocess.run(["readelf", "-SW", str(so)], capture_output=True, text=True, check=True).stdout
    for line in sections.splitlines():
        fields = line.replace("[ ", "[").split()
        if len(fields) > 5 and fields[1] == ".rodata":
            start, offset = int(fields[3], 16), int(fields[4], 16)
            data = so.read_bytes()[offset + address - start : offset + address - start + 4]
            number = int.from_bytes(data, "little")
            return number >> 16, (number >> 8) & 0xFF, number & 0xFF
    raise AssertionError(f"no .rodata in {so}")


def test_one_build_per_slurm_release(plugin: Path) -> None:
    """The default build is for the host's headers; ``SLURM_HEADERS``/``OUT`` build another release's plugin beside
    it (here Slurm 24.11's, from the sandbox's root), each stamped with its own version (Slurm refuses another's)."""
    headers = release("24.11").root / "usr" / "include" / "slurm"
    _require(None if (headers / "spank.h").exists() else f"{headers} is missing (make slurm-24.11 builds it)")
    build = _make(f"SLURM_HEADERS={headers}", "OUT=slurm-24.11")
    assert build.returncode == 0, f"{build.stdout}\n{build.stderr}"
    other = SPANK / "slurm-24.11" / "clockwork.so"
    assert _plugin_version(other)[:2] == (24, 11)
    host = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libslurm-dev"], capture_output=True, text=True)
    assert _plugin_version(plugin)[:2] == tuple(int(v) for v in host.stdout.split(".")[:2])
    assert _exports(other) == _exports(plugin)  # the same plugin, only the headers differ


def test_exports_only_the_symbols_slurm_needs(plugin: Path) -> None:
    names = _exports(plugin)
    assert {n for n in names if not ALLOWED_EXPORTS.fullmatch(n)} == set()
    required = {"slurm_spank_init", "slurm_spank_init_post_opt", "plugin_name", "plugin_type", "plugin_version"}
    assert required <= names


# ----- the real sbatch ------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    """The caller's environment without anything Slurm or Clockwork (pytest may run inside a job)."""
    prefixes = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SPANK_", "_SLURM", "CLOCKWORK_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def _cluster(tmp_path: Path, plugstack: str, *, port: int = UNSERVED_PORT, auth: str = "auth/munge") -> dict[str, str]:
    """A slurm.conf + plugstack.conf just complete enough for sbatch; returns the environment to run it in."""
    (tmp_path / "plugstack.conf").write_text(plugstack + "\n")
    lines = [
        "ClusterName=cwtest",
        "SlurmctldHost=cwctl(127.0.0.1)",
        f"SlurmctldPort={port}",
        f"AuthType={auth}",
        "AuthInfo=socket=/nonexistent",
        f"PlugStackConfig={tmp_path / 'plugstack.conf'}",
        "MessageTimeout=2",
    ]
    (tmp_path / "slurm.conf").write_text("\n".join(lines) + "\n")
    return {**_clean_env(), "SLURM_CONF": str(tmp_path / "slurm.conf")}


@pytest.fixture
def sbatch(plugin: Path) -> str:
    path = shutil.which("sbatch")
    _require(None if path else "the sbatch tests need the Slurm client (slurm-client)")
    assert path is not None
    return path


def _run(sbatch: str, env: dict[str, str], *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["timeout", "20", sbatch, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )


def test_help_lists_the_four_options(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    env = _cluster(tmp_path, f"required {plugin}")
    result = _run(sbatch, env, "--help", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("Options provided by plugins:", 1)[1]
    for name in OPTIONS:
        # Slurm puts a long option on its own line and the help text under it.
        match = re.search(rf"--{name}=\S+\s+\[clockwork\] \S", section)
        assert match, f"--{name} with a [clockwork] help text is missing from:\n{section}"
    assert "--clockwork-spares=none|standby|borrow" in section
    assert section.count("[clockwork]") == len(OPTIONS)


def test_bad_option_value_is_rejected_before_submission(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    env = _cluster(tmp_path, f"required {plugin}")
    result = _run(sbatch, env, "--clockwork-spares=maybe", "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert SPARES_MAYBE in result.stderr
    assert NO_CONTROLLER not in result.stderr  # rejected before any submission was attempted


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--clockwork-ft=maybe"],
            "clockwork: --clockwork-ft: invalid value 'maybe' (expected aware, transparent, off)",
        ),
        (
            ["--clockwork-snapshot=0m"],
            "clockwork: --clockwork-snapshot: invalid value '0m' (expected off or a duration like 20m, 1h)",
        ),
        (["--clockwork-linkpass=yes"], "clockwork: --clockwork-linkpass: invalid value 'yes' (expected on, off)"),
    ],
)
def test_every_option_is_validated(sbatch: str, plugin: Path, tmp_path: Path, args: list[str], message: str) -> None:
    env = _cluster(tmp_path, f"required {plugin}")
    result = _run(sbatch, env, *args, "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize("mode", ["required", "optional"])
def test_bad_environment_value_is_rejected(sbatch: str, plugin: Path, tmp_path: Path, mode: str) -> None:
    """Even an `optional` plugin (whose failing hooks Slurm ignores) stops the command."""
    env = {**_cluster(tmp_path, f"{mode} {plugin}"), "CLOCKWORK_SPARES": "maybe"}
    result = _run(sbatch, env, "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert "clockwork: CLOCKWORK_SPARES: invalid value 'maybe' (expected none, standby, borrow)" in result.stderr
    assert NO_CONTROLLER not in result.stderr


def test_command_line_beats_a_bad_environment_value(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    env = {**_cluster(tmp_path, f"required {plugin}"), "CLOCKWORK_SPARES": "maybe"}
    result = _run(sbatch, env, "--clockwork-spares=standby", "--wrap", "true", tmp_path=tmp_path)
    assert "clockwork:" not in result.stderr
    assert NO_CONTROLLER in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--clockwork-ft"],
        ["--clockwork-ft=transparent", "--clockwork-spares=borrow", "--clockwork-snapshot=20m"],
        ["--clockwork-ft=off", "--clockwork-linkpass=off"],
    ],
)
def test_valid_options_reach_the_controller(sbatch: str, plugin: Path, tmp_path: Path, args: list[str]) -> None:
    env = _cluster(tmp_path, f"required {plugin}")
    result = _run(sbatch, env, *args, "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert "clockwork:" not in result.stderr
    assert NO_CONTROLLER in result.stderr


def test_unknown_plugstack_argument_fails_loudly(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    env = _cluster(tmp_path, f"required {plugin} default_ft=off foo=1")
    result = _run(sbatch, env, "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert (
        "clockwork: plugstack.conf: unknown argument 'foo=1' (known: default_ft, allow_borrow, max_spares, config)"
        in result.stderr
    )


def test_borrow_refused_when_the_admin_disallows_it(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    env = _cluster(tmp_path, f"required {plugin} allow_borrow=no")
    result = _run(sbatch, env, "--clockwork-ft", "--clockwork-spares=borrow", "--wrap", "true", tmp_path=tmp_path)
    assert result.returncode != 0
    assert "clockwork: --clockwork-spares: 'borrow' is not allowed on this cluster" in result.stderr
    assert NO_CONTROLLER not in result.stderr


def test_admin_plugstack_file_is_accepted(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    """etc/plugstack.conf.d/clockwork.conf, pointed at the fresh build, parses without a complaint."""
    text = (ROOT / "etc" / "plugstack.conf.d" / "clockwork.conf").read_text()
    installed = "/usr/lib/x86_64-linux-gnu/slurm-wlm/clockwork.so"
    assert installed in text
    env = _cluster(tmp_path, text.replace(installed, str(plugin)))
    result = _run(sbatch, env, "--clockwork-ft", "--wrap", "true", tmp_path=tmp_path)
    assert "clockwork:" not in result.stderr
    assert "spank:" not in result.stderr
    assert NO_CONTROLLER in result.stderr


class _FakeController:
    """A loopback socket in place of slurmctld: it keeps the first Slurm message sent to it, then hangs up."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(20)
        self.port = self.sock.getsockname()[1]
        self.message = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _recv(self, conn: socket.socket, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                break
            data += chunk
        return data

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            header = self._recv(conn, 4)  # a Slurm message starts with its length (network order)
            if len(header) == 4:
                self.message = self._recv(conn, struct.unpack("!I", header)[0])

    def close(self) -> bytes:
        self.thread.join(timeout=25)
        self.sock.close()
        return self.message


def test_export_none_job_still_carries_the_options(sbatch: str, plugin: Path, tmp_path: Path) -> None:
    """With --export=NONE the batch step never runs the option callback; the plugin then reads Slurm's
    copies, which sbatch puts into the job's environment as SLURM_* variables. Pin their names."""
    if not Path("/usr/lib/x86_64-linux-gnu/slurm-wlm/auth_none.so").exists():
        _require("this test needs Slurm's auth/none plugin (slurm-wlm-basic-plugins)")
    controller = _FakeController()
    env = _cluster(tmp_path, f"required {plugin}", port=controller.port, auth="auth/none")
    env["CLOCKWORK_SNAPSHOT"] = "1h"
    result = _run(
        sbatch, env, "--export=NONE", "--clockwork-ft", "--clockwork-spares=borrow", "--wrap", "true", tmp_path=tmp_path
    )
    message = controller.close()
    assert result.returncode != 0  # the fake controller never answers
    assert "clockwork:" not in result.stderr
    for variable in (
        b"SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_ft=(null)",
        b"SLURM_SPANK__SLURM_SPANK_OPTION_clockwork_clockwork_spares=borrow",
        b"SLURM_SPANK_CLOCKWORK_FT=aware",
        b"SLURM_SPANK_CLOCKWORK_SPARES=borrow",
        b"SLURM_SPANK_CLOCKWORK_SNAPSHOT=1h",
        b"SLURM_SPANK_CLOCKWORK_LINKPASS=on",
    ):
        assert variable + b"\x00" in message, f"{variable!r} missing from the submitted job"
