"""``clockwork snapshot ls|show|verify|rm|take``: look after a TorchPass job's snapshots.

``ls``, ``show``, ``verify`` and ``rm`` work on the files (:mod:`clockwork.contracts.snapshots.store`; no torch, no
daemon): a snapshot directory holds ``step-NNNNNNNNNN`` folders, and only those with a valid manifest exist as
snapshots. ``verify`` reads every byte and checks every checksum, as a restore does. ``take JOBID`` asks the
running job's coordinator for a snapshot, found exactly as ``clockwork migrate`` finds it (the job's
``torchpass.coordinator`` record in the node daemon, the job key it carries for CURVE).

The directory defaults to ``CLOCKWORK_SNAPSHOT_DIR`` (what the job used if it was set there).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import click

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.cli.migrate_cmd import coordinator_option, job_coordinator
from clockwork.contracts.coordinator_client import ask_leader
from clockwork.contracts.errors import ClockworkError
from clockwork.contracts.snapshots.store import (
    MANIFEST,
    list_snapshots,
    load_manifest,
    remove_snapshot,
    verify_snapshot,
)
from clockwork.contracts.snapshots.store import SnapshotCorrupt as _Corrupt

ENV_DIR = "CLOCKWORK_SNAPSHOT_DIR"


def _directory(given: str | None) -> Path:
    value = given or os.environ.get(ENV_DIR, "")
    if not value:
        raise ClockworkError(f"name the snapshot directory (argument DIR, or {ENV_DIR})", exit_code=2)
    path = Path(value)
    if not path.is_dir():
        raise ClockworkError(f"{path}: no such directory", exit_code=2)
    return path


def _is_snapshot(path: Path) -> bool:
    return path.name.startswith("step-") or (path / MANIFEST).exists()


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _when(created: object) -> str:
    if not isinstance(created, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(created, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


@click.group()
def snapshot() -> None:
    """List, inspect, check, delete and take TorchPass training snapshots."""


@snapshot.command("ls")
@click.argument("directory", required=False, metavar="[DIR]")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per snapshot.")
def ls_cmd(directory: str | None, as_json: bool) -> None:
    """List the snapshots in DIR, oldest first; incomplete folders are shown as such (they are never loaded)."""
    infos = list_snapshots(_directory(directory))
    if as_json:
        for info in infos:
            click.echo(json.dumps(info.summary(), sort_keys=True))
        return
    if not infos:
        click.echo("no snapshots")
        return
    click.echo(f"{'STEP':>10}  {'STATE':<10}  {'RANKS':>5}  {'SIZE':>10}  {'CREATED':<20}  PATH")
    for info in infos:
        state = "complete" if info.complete else "incomplete"
        ranks = str(info.manifest.get("world_size", "-"))
        size = _size(info.nbytes) if info.complete else "-"
        click.echo(
            f"{info.step:>10}  {state:<10}  {ranks:>5}  {size:>10}  {_when(info.manifest.get('created')):<20}  "
            f"{info.path}"
        )


@snapshot.command("show")
@click.argument("path", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--entries", is_flag=True, help="Also list every entry (tensor, description, per-rank state).")
def show_cmd(path: Path, entries: bool) -> None:
    """Show snapshot PATH's manifest: step, ranks, job, shards and their entries (nothing is verified)."""
    try:
        body = load_manifest(path)
    except _Corrupt as exc:
        raise ClockworkError(str(exc)) from None
    total = sum(int(e["nbytes"]) for f in body["files"].values() for e in f["entries"].values())
    click.echo(f"snapshot {path}")
    click.echo(f"  step {body['step']}  ranks {body['world_size']}  job {body.get('job') or '-'}")
    click.echo(f"  created {_when(body.get('created'))}  tensors {body['tensors']}  data {_size(total)}")
    for fname, fdesc in sorted(body["files"].items()):
        click.echo(f"  {fname}: {len(fdesc['entries'])} entries, {_size(int(fdesc['size']))} on disk")
        if entries:
            for name, entry in sorted(fdesc["entries"].items()):
                click.echo(
                    f"    {name:<28} {entry['dtype']:<16} {tuple(entry['shape'])!s:<18} "
                    f"{_size(int(entry['nbytes'])):>10}  crc32 {int(entry['crc32']):08x}"
                )


@snapshot.command("verify")
@click.argument("path", required=False, metavar="[SNAPSHOT|DIR]")
def verify_cmd(path: str | None) -> None:
    """Read every byte of a snapshot (or of every snapshot in a directory) and check every checksum.

    Exits 1 when any snapshot is damaged or incomplete."""
    target = Path(path) if path else _directory(None)
    folders = [target] if _is_snapshot(target) else [i.path for i in list_snapshots(_directory(str(target)))]
    if not folders:
        raise ClockworkError(f"{target}: no snapshots", exit_code=1)
    bad = 0
    for folder in folders:
        problems = verify_snapshot(folder)
        if problems:
            bad += 1
            click.echo(f"BAD  {folder}")
            for problem in problems:
                click.echo(f"     {problem}")
        else:
            click.echo(f"OK   {folder}")
    if bad:
        raise ClockworkError(f"{bad} of {len(folders)} snapshot(s) failed verification", exit_code=1)


@snapshot.command("rm")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, file_okay=False))
def rm_cmd(paths: tuple[Path, ...]) -> None:
    """Delete snapshot folders (the manifest first, so a half-deleted one never looks complete)."""
    for path in paths:
        if not path.name.startswith("step-"):
            raise ClockworkError(f"{path}: not a snapshot folder (step-NNNNNNNNNN); nothing removed", exit_code=2)
    for path in paths:
        remove_snapshot(path)
        click.echo(f"removed {path}")


@snapshot.command("take")
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@coordinator_option
@click.option("--node", "node_name", metavar="NODE", help="Whose daemon to ask (default: this host's).")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds to wait for each coordinator replica.",
)
@pass_ctx
def take_cmd(
    state: CliContext, job_id: int | None, coordinator: str | None, node_name: str | None, timeout_s: float
) -> None:
    """Ask running TorchPass job JOB_ID (or the local job --coordinator names) to take a snapshot now.

    The coordinator picks a step a little ahead of the fastest rank; every rank snapshots after that step,
    and rank 0 writes the manifest when every shard is on disk (see the job's torchpass.snapshot_* events)."""
    record = job_coordinator(state, job_id, coordinator, node_name)
    fields = {"op": "snapshot", "requester": f"clockwork snapshot take (uid {os.getuid()})"}
    reply = ask_leader(record, fields, timeout_s, "snapshotted on demand")
    click.echo(f"{f'job {job_id}' if job_id else coordinator}: every rank snapshots after step {reply.get('step')}")
