"""A local TorchPass job (``torchpass run --local``) as the oracle tests launch and check it.

Shared by the oracle tests (the model-aware training, the unmodified DDP, FSDP, Lightning and Hugging Face
scripts), so that all launch their job with the same options and hold its final state to the same bitwise
standard. Their rank scripts do not import this module: a rank process need not find ``tests`` on its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class JobResult:
    """What a finished job's record offers its tests, whatever launched it (it needs ``returncode``,
    ``output`` and ``events``)."""

    returncode: int
    output: str
    events: list[dict[str, Any]]

    def check_ok(self) -> None:
        assert self.returncode == 0, f"launcher exit {self.returncode}\n{self.output[-6000:]}"

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e["fields"] for e in self.events if e["kind"] == kind]

    def logged(self, kind: str) -> list[dict[str, Any]]:
        """The ranks' events of ``kind`` (their log lines; ``of_kind`` holds the coordinator's)."""
        return logged_events(self.output, kind)

    def complete_snapshots(self, folder: Path, planned: Sequence[int]) -> list[int]:
        """The steps of the complete snapshots in ``folder``, at least one. A ``planned`` step without one was
        skipped by a rank still writing the snapshot before (training never waits for the disk), as its
        ``torchpass.snapshot_skipped`` event says: on a loaded machine that happens, and is no failure."""
        from clockwork.contracts.snapshots.store import list_snapshots

        steps = [info.step for info in list_snapshots(folder) if info.complete]
        assert steps, f"no complete snapshot in {folder}"
        skipped = {int(e["step"]) for e in self.logged("torchpass.snapshot_skipped")}
        missing = sorted(set(planned) - set(steps))
        assert set(missing) <= skipped, f"snapshots of steps {missing} missing, skipped: {sorted(skipped)}"
        return steps


def logged_events(output: str, kind: str) -> list[dict[str, Any]]:
    """The events of ``kind`` a rank logged (lines ``... event KIND {json}``) in a job's ``output``."""
    import json

    marker = f" event {kind} "
    return [json.loads(line.split(marker, 1)[1]) for line in output.splitlines() if marker in line]


class FinishedJob(JobResult):
    """A job run in folder ``out``: its launcher's exit status and output, and the events it wrote there."""

    def __init__(self, out: Path, returncode: int, output: str) -> None:
        import json

        self.out, self.returncode, self.output = out, returncode, output
        events_file = out / "events.jsonl"
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        self.events = [json.loads(line) for line in lines]


def local_command(
    out: Path,
    script: Path,
    *,
    nproc: int,
    spares: int,
    flags: Sequence[str] = (),
    options: Sequence[str] = (),
    settings: Sequence[str] = (),
) -> list[str]:
    """``torchpass run --local FLAGS`` of ``script``: events to ``out/events.jsonl``, then ``options``; the
    collective and rendezvous timeouts shortened from their defaults (20 s and 60 s: a hung peer or a broken
    generation costs a test seconds, not minutes), then every ``--set`` of ``settings``."""
    return [
        sys.executable,
        "-m",
        "torchpass",
        "run",
        "--local",
        *flags,
        "--nproc",
        str(nproc),
        "--spares",
        str(spares),
        "--events",
        str(out / "events.jsonl"),
        *options,
        "--set",
        "collective_timeout_s=20",
        "--set",
        "join_timeout_s=60",
        *(arg for setting in settings for arg in ("--set", setting)),
        str(script),
    ]


def run_logged(out: Path, cmd: Sequence[str], env: dict[str, str], timeout_s: float) -> FinishedJob:
    """Run ``cmd`` (a :func:`local_command`) to its end, its output in ``out/launcher.log`` (read while it runs,
    kept when a test fails); killed after ``timeout_s``, which then shows as its non-zero exit."""
    with open(out / "launcher.log", "w") as log:
        proc = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
    return FinishedJob(out, returncode, (out / "launcher.log").read_text())


def load_final(out: Path, slot: int) -> dict[str, Any]:
    """The state a slot saved when it finished (``final-slotN.pt``, written by the rank script)."""
    import torch

    return torch.load(out / f"final-slot{slot}.pt", weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` (nested dicts, lists and tensors) are equal to the bit: same keys, same dtypes and shapes,
    ``torch.equal`` tensors; ``where`` names the first difference's place."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
        assert torch.equal(a, b), f"{where}: tensors differ (max diff {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def framework_command(out: Path, script: Path, *, nproc: int) -> list[str]:
    """``torchpass run --local --transparent`` of a framework's rank script: one spare, the coordinator's address
    in ``out/coordinator`` (for ``clockwork migrate``)."""
    options = ["--coordinator-file", str(out / "coordinator")]
    return local_command(out, script, nproc=nproc, spares=1, flags=["--transparent"], options=options)


def framework_env(out: Path, **env: str) -> dict[str, str]:
    """This environment without the caller's own ``CW_TEST_*``, plus the rank script's folder and ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CW_TEST_")}
    environ.update(CW_TEST_DIR=str(out), PYTHONWARNINGS="ignore", **env)
    return environ


def run_framework_job(base: Path, name: str, script: Path, *, nproc: int, timeout_s: float, **env: str) -> FinishedJob:
    """:func:`framework_command` run to its end in the new folder ``base/name``, with :func:`framework_env`."""
    out = base / name
    out.mkdir()
    cmd, environ = framework_command(out, script, nproc=nproc), framework_env(out, **env)
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout_s, check=False)
    return FinishedJob(out, proc.returncode, proc.stdout + proc.stderr)


def assert_slots_like_reference(
    run: FinishedJob, reference: FinishedJob, *, nproc: int, keys: Sequence[str], last_step: int, what: str
) -> None:
    """``run`` finished at ``last_step`` and every slot's final state (its ``keys``) equals the reference's to
    the bit."""
    run.check_ok()
    for slot in range(nproc):
        mine, theirs = load_final(run.out, slot), load_final(reference.out, slot)
        assert_bitwise_equal({k: mine[k] for k in keys}, {k: theirs[k] for k in keys}, f"{what}: slot {slot}")
    finished = run.of_kind("torchpass.finished")
    assert finished and finished[-1]["committed"] == [last_step], finished
