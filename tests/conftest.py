"""Test-suite rules and helpers shared by unit and integration tests.

Integration tests (marker ``integration``) need root and a real Slurm. In CI (:func:`in_ci`; CI runs as
root) a missing prerequisite is a failure, never a skip; only on a developer laptop without root are
they skipped, with the reason shown.

Tests wait for conditions, never for fixed times: :func:`until` is the one way to wait (poll a check, fail
naming what was waited for).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

# One intra-op thread per process, the suite's and every job's: the suite runs several "nodes" of several ranks
# on two cores (two xdist workers, each with its jobs), where a pool per process as large as the machine only adds
# threads that spin against each other (a 4-rank job took twice the CPU). The sandbox's jobs set the same; the
# launcher's own default for jobs that set none is tested on its own (test_torchpass_threads.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _warm_zygote_server() -> Iterator[None]:
    """One warm zygote server per pytest process (``torchpass.launch.zygote_server``): the few hundred local jobs
    the suite launches fork their zygotes from it instead of importing torch again each (~4.5 s of CPU per job
    here). A job it must not serve (another session, namespaces or import-time environment: a sandbox node's
    agent, ``zygote=false``, a set thread count) starts its own zygote, as without it. The server's own tests
    are tests/unit/test_torchpass_zygote_server.py. ``CLOCKWORK_TEST_WARM_ZYGOTE=0`` runs the suite without it."""
    from torchpass.launch.zygote_server import ENV_WARM_ZYGOTE, server_argv

    if os.environ.get("CLOCKWORK_TEST_WARM_ZYGOTE", "1") == "0":
        yield
        return
    with tempfile.TemporaryDirectory(prefix="cw-zs-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "warm.sock")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPT_NOENV": "1"}  # as a launcher's zygote is started
        with open(os.path.join(tmp, "server.log"), "wb") as log:
            server = subprocess.Popen(server_argv(sys.executable, path), env=env, stdout=log, stderr=log)
        try:
            until("the warm zygote server to listen", lambda: os.path.exists(path) or server.poll() is not None, 120)
            if server.poll() is not None:
                raise RuntimeError(f"the warm zygote server exited with {server.returncode}: {open(log.name).read()}")
            os.environ[ENV_WARM_ZYGOTE] = path
            yield
        finally:
            os.environ.pop(ENV_WARM_ZYGOTE, None)
            server.kill()
            server.wait()


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test() -> Iterator[None]:
    """A CLI run in-process (``logging.basicConfig``, ``configure_logging``) leaves a handler on the stderr pytest
    captured for that test; a thread of a later test that logs through it writes to a closed file ("--- Logging
    error ---" in the output). Handlers a test added are removed when it ends (pytest's own are subclasses), and
    the loggers' levels and propagation restored."""
    loggers = [logging.getLogger(name) for name in (None, "clockwork", "clockwork.torchpass")]
    before = [(list(logger.handlers), logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, (kept, level, propagate) in zip(loggers, before, strict=True):
        for handler in list(logger.handlers):
            if type(handler) in (logging.StreamHandler, logging.FileHandler) and handler not in kept:
                logger.removeHandler(handler)
                handler.close()
        logger.setLevel(level)
        logger.propagate = propagate


def in_ci() -> bool:
    """Whether the tests run in CI: ``CI`` is set to anything but "", "0" or "false" (any case)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def until(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    """Poll ``check`` until it returns something true and return that; fail naming ``what`` (and what the check
    last returned) after ``timeout_s``, a bound that only a broken run reaches.

    A check that is itself slow (a ``clockwork`` or Slurm command: a process start, ~0.3 s of CPU) is asked
    again only after as long as it took, so polling never takes more than half a core from the job it waits on.
    The check is always asked once more at the deadline: a slow machine's late answer still counts.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        started = time.monotonic()
        value = check()
        if value:
            return value
        if started > deadline:
            shown = repr(value)
            shown = shown if len(shown) <= 200 else shown[:200] + "..."
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last check: {shown})")
        time.sleep(max(interval_s, time.monotonic() - started))


def unavailable(message: str) -> NoReturn:
    """What a test needs is missing: a failure in CI (which must run everything), a skip on a developer machine."""
    if in_ci():
        pytest.fail(message + " (CI must run everything)")
    pytest.skip(message + " (skipped on a developer machine only)")


def require_root_and_slurm() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("root")
    if shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is None:
        problems.append("Slurm (make venv installs it)")
    if problems:
        unavailable("integration test needs " + " and ".join(problems))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration is an integration test, and runs first.

    First, because its modules are the long ones (a minute or more each, sandbox jobs): pytest-xdist hands out
    modules in this order, so the many short unit modules fill the gaps at the end instead of one worker
    finishing a long module alone while the others idle.
    """
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: item.get_closest_marker("integration") is None)  # stable: order kept within


@pytest.fixture(autouse=True)
def _integration_prerequisites(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("integration"):
        require_root_and_slurm()


@pytest.fixture
def job_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A TorchPass job key in this process's environment, as a launcher sets it (hex); for tests that run
    coordinators, meshes or proxies in-process. Child processes inherit it."""
    from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey

    key = JobKey.new().hex
    monkeypatch.setenv(ENV_JOB_KEY, key)
    return key
