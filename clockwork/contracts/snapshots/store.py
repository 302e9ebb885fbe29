"""What a training snapshot is on disk, and the rules that make a bad one impossible to load.

Layout under a snapshot directory::

    DIR/step-0000001234/rank-00000.h5     one HDF5 shard per rank
    DIR/step-0000001234/rank-00001.h5
    DIR/step-0000001234/manifest.json     written last: without it the snapshot does not exist

Every shard holds *entries*: named byte blobs with the framework's ``dtype`` (e.g. ``torch.bfloat16``, kept as
text so no numpy equivalent is needed), ``shape`` and ``crc32``. Entry ``t/NNNNNN`` is tensor NNNNNN of the
replicated training state (model, optimizers, registered state; identical on every data-parallel replica, so
each is written by one replica only), ``meta`` the description of that state, and ``rank/...`` the per-rank
state (RNG, data position) that the rank itself writes. A sharded model's snapshot (the manifest's ``mesh``:
[R, S], R replicas of S shards) holds S states instead, shard ``s``'s under ``s/SSSSS/`` (its tensors
``s/SSSSS/t/NNNNNN`` and its description ``s/SSSSS/meta``), each written by one rank holding that shard.

Two shard layouts, both read (the manifest's ``format`` says which one its shards have):

- ``clockwork-snapshot/2`` (written now): one ``uint8`` dataset ``data``, the rank's staging arena byte for
  byte (each entry at its own 4 KiB-aligned ``offset``, padding between), and a dataset ``index``, the JSON
  list of entries (name, offset, nbytes, crc32, dtype, shape). Why: the data is then one sequential write,
  as fast as the disk goes; a dataset per entry cost the writer a few hundred microseconds of HDF5 work per
  entry and cut the disk writes into pieces;
- ``clockwork-snapshot/1``: an HDF5 dataset per entry, named after it, with attributes ``crc32``, ``dtype``
  and ``shape``.

Durability: a shard is written under a temporary name, fsynced, renamed, and the folder fsynced; only when
every shard is durable does one rank write the manifest (same dance). The manifest lists every entry of every
file with its size and CRC-32 and carries a CRC of its own body, so a flipped byte anywhere, a truncated
file, a missing shard or a missing/garbled manifest makes the snapshot fail verification; a loader then moves
on to the previous one. CRC-32 catches media and transfer corruption; it is not meant to resist a deliberate
forger (whoever can write the folder can write any training state). It is zlib's CRC-32 (the same values
as every snapshot written before), computed by ISA-L (python-isal, with carry-less multiplication: 12-17
GB/s a core here, against zlib's 2.2-2.5, and without the GIL): zlib's is no faster than a disk writes, so
the writer, 10 nice levels below a busy training loop, waited for its checksums rather than the disk.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from isal import isal_zlib

from clockwork.contracts import atomic_file

__all__ = [
    "DATA",
    "FORMAT",
    "INDEX",
    "MANIFEST",
    "READABLE_FORMATS",
    "SnapshotCorrupt",
    "SnapshotInfo",
    "apply_retention",
    "crc32",
    "entry_file_offset",
    "file_entries",
    "list_snapshots",
    "load_manifest",
    "read_entries",
    "remove_snapshot",
    "shard_name",
    "shard_prefix",
    "snapshot_path",
    "verify_snapshot",
    "write_manifest",
]

FORMAT = "clockwork-snapshot/2"
#: Every format this code reads (snapshots written by earlier releases stay restorable).
READABLE_FORMATS = ("clockwork-snapshot/1", FORMAT)
#: The v2 shard's datasets: the arena's bytes, and the JSON list of entries in it.
DATA = "data"
INDEX = "index"
MANIFEST = "manifest.json"
FAILED_PREFIX = "failed-rank-"
#: How much lower than the training loop's the CPU priority of snapshot work is (the rank's copying thread and
#: the writer process): when cores are short, training goes first; a snapshot only has to be written before
#: the next one is due.
NICE_INCREMENT = 10
_STEP_RE = re.compile(r"^step-(\d{10})$")
_CRC_CHUNK = 64 << 20


class SnapshotCorrupt(RuntimeError):
    """A snapshot failed verification (the message names the file and entry)."""


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of a buffer, by ISA-L, in chunks (each releases the GIL); ``value``: the CRC of the bytes
    before it, to continue an entry that arrives in pieces."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CRC_CHUNK):
        value = isal_zlib.crc32(view[start : start + _CRC_CHUNK], value)
    return value & 0xFFFFFFFF


def snapshot_path(directory: str | Path, step: int) -> Path:
    """The folder of the snapshot taken after step ``step`` commits."""
    return Path(directory) / f"step-{step:010d}"


def shard_prefix(shard: int) -> str:
    """Where the entries of shard ``shard`` of a sharded model's state go (``s/SSSSS/``)."""
    return f"s/{shard:05d}/"


def shard_name(rank: int) -> str:
    """File name of rank ``rank``'s shard."""
    return f"rank-{rank:05d}.h5"


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def file_entries(path: Path) -> dict[str, dict[str, Any]]:
    """Entry name -> {nbytes, crc32, dtype, shape[, offset]} of a shard (its index, or for a v1 shard its
    datasets' attributes; no data is read)."""
    found: dict[str, dict[str, Any]] = {}
    with h5py.File(path, "r") as f:
        index = f.get(INDEX)
        if isinstance(index, h5py.Dataset):
            for item in json.loads(index[()].tobytes()):
                found[str(item["name"])] = {
                    "offset": int(item["offset"]),
                    "nbytes": int(item["nbytes"]),
                    "crc32": int(item["crc32"]),
                    "dtype": str(item["dtype"]),
                    "shape": [int(v) for v in item["shape"]],
                }
            return found

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                found[name] = {
                    "nbytes": int(obj.shape[0]),
                    "crc32": int(obj.attrs["crc32"]),
                    "dtype": str(obj.attrs["dtype"]),
                    "shape": [int(v) for v in json.loads(str(obj.attrs["shape"]))],
                }

        f.visititems(visit)
    return found


def entry_file_offset(path: Path, name: str) -> int:
    """Where entry ``name``'s first byte lies in shard ``path`` (for tools and tests that inspect or damage
    a shard on purpose)."""
    entries = file_entries(path)
    with h5py.File(path, "r") as f:
        if "offset" in entries[name]:
            base, extra = f[DATA].id.get_offset(), int(entries[name]["offset"])
        else:
            base, extra = f[name].id.get_offset(), 0
    if base is None:
        raise SnapshotCorrupt(f"{path}:{name}: no data in the file")
    return int(base) + extra


def write_manifest(folder: Path, body: dict[str, Any]) -> None:
    """Write ``manifest.json`` (body plus the CRC of its canonical form) durably: the snapshot now exists."""
    text = json.dumps({"body": body, "crc32": crc32(_canonical(body))}, indent=1, sort_keys=True)
    atomic_file.write_text(folder / MANIFEST, text)


def load_manifest(folder: Path) -> dict[str, Any]:
    """The manifest's body; :class:`SnapshotCorrupt` when missing, unreadable or not matching its CRC."""
    path = folder / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{folder}: no {MANIFEST} (an incomplete snapshot does not exist)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise SnapshotCorrupt(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("body"), dict):
        raise SnapshotCorrupt(f"{path}: not a snapshot manifest")
    body = raw["body"]
    if crc32(_canonical(body)) != raw.get("crc32"):
        raise SnapshotCorrupt(f"{path}: manifest checksum mismatch (the file was altered or damaged)")
    if body.get("format") not in READABLE_FORMATS:
        raise SnapshotCorrupt(f"{path}: format {body.get('format')!r}, expected one of {', '.join(READABLE_FORMATS)}")
    return body


@dataclass
class SnapshotInfo:
    """One snapshot folder as listed: complete (a valid manifest) or not, with the manifest's summary."""

    path: Path
    step: int
    complete: bool
    problem: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of entry data over every shard (0 when incomplete)."""
        files = self.manifest.get("files", {})
        return sum(int(e["nbytes"]) for f in files.values() for e in f["entries"].values())

    def summary(self) -> dict[str, Any]:
        """A JSON-able line for listings."""
        return {
            "path": str(self.path),
            "step": self.step,
            "complete": self.complete,
            "problem": self.problem,
            "world_size": self.manifest.get("world_size"),
            "created": self.manifest.get("created"),
            "bytes": self.nbytes,
            "job": self.manifest.get("job"),
        }


def list_snapshots(directory: str | Path) -> list[SnapshotInfo]:
    """Every ``step-*`` folder under ``directory``, oldest first; manifests are checked, data is not read."""
    base = Path(directory)
    if not base.is_dir():
        return []
    out = []
    for child in base.iterdir():
        match = _STEP_RE.match(child.name)
        if not match or not child.is_dir():
            continue
        info = SnapshotInfo(child, int(match.group(1)), False)
        try:
            info.manifest = load_manifest(child)
            info.complete = True
        except SnapshotCorrupt as exc:
            info.problem = str(exc)
        out.append(info)
    return sorted(out, key=lambda i: i.step)


def _entries_in_manifest(body: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for fname, fdesc in sorted(body["files"].items()):
        for name, entry in sorted(fdesc["entries"].items()):
            yield fname, name, entry


def read_entries(
    folder: Path,
    body: Mapping[str, Any],
    target: Callable[[str, dict[str, Any]], np.ndarray | None] | None = None,
) -> dict[str, np.ndarray]:
    """Read and CRC-check every entry of a snapshot, file by file.

    ``target(name, entry)`` may return a writable contiguous ``uint8`` array of ``entry['nbytes']`` bytes to
    read into (e.g. a view of a live tensor), or None to get a fresh array in the result. Every entry is read
    and checked either way, so a damaged byte anywhere fails the whole snapshot with :class:`SnapshotCorrupt`.
    """
    result: dict[str, np.ndarray] = {}
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for fname, name, entry in _entries_in_manifest(body):
        by_file.setdefault(fname, []).append((name, entry))
    for fname, entries in by_file.items():
        path = folder / fname
        expected_size = body["files"][fname].get("size")
        try:
            if expected_size is not None and path.stat().st_size != int(expected_size):
                raise SnapshotCorrupt(
                    f"{path}: {path.stat().st_size} bytes, the manifest says {expected_size} (truncated or altered)"
                )
            with h5py.File(path, "r") as f:
                for name, entry in entries:
                    nbytes = int(entry["nbytes"])
                    out = target(name, entry) if target is not None else None
                    if out is None:
                        out = np.empty(nbytes, dtype=np.uint8)
                        result[name] = out
                    if out.nbytes != nbytes:
                        raise SnapshotCorrupt(f"{path}:{name}: target holds {out.nbytes} bytes, entry {nbytes}")
                    if "offset" in entry:  # v2: a slice of the shard's data
                        start = int(entry["offset"])
                        dset = f.get(DATA)
                        if not isinstance(dset, h5py.Dataset) or start < 0 or dset.shape[0] < start + nbytes:
                            raise SnapshotCorrupt(f"{path}:{name}: missing or of the wrong size")
                        if nbytes:
                            dset.read_direct(out, np.s_[start : start + nbytes])
                    else:  # v1: a dataset of its own
                        dset = f.get(name)
                        if not isinstance(dset, h5py.Dataset) or dset.shape != (nbytes,):
                            raise SnapshotCorrupt(f"{path}:{name}: missing or of the wrong size")
                        if nbytes:
                            dset.read_direct(out)
                    if crc32(out) != int(entry["crc32"]):
                        raise SnapshotCorrupt(f"{path}:{name}: checksum mismatch (damaged data)")
        except SnapshotCorrupt:
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise SnapshotCorrupt(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    return result


def verify_snapshot(folder: str | Path) -> list[str]:
    """Every problem found in a snapshot (an empty list: it is complete and every checksum matches)."""
    path = Path(folder)
    try:
        body = load_manifest(path)
    except SnapshotCorrupt as exc:
        return [str(exc)]
    problems = []
    for fname in sorted(body["files"]):
        one = {"files": {fname: body["files"][fname]}}
        try:
            buffer: dict[str, np.ndarray] = {}

            def scratch(name: str, entry: dict[str, Any], buffer: dict[str, np.ndarray] = buffer) -> np.ndarray:
                size = int(entry["nbytes"])
                held = buffer.get("b")
                if held is None or held.nbytes < size:
                    held = buffer["b"] = np.empty(max(size, 1 << 20), dtype=np.uint8)
                return held[:size]

            read_entries(path, one, scratch)
        except SnapshotCorrupt as exc:
            problems.append(str(exc))
    return problems


def remove_snapshot(folder: Path) -> None:
    """Delete a snapshot: the manifest first, so a half-removed snapshot never looks complete."""
    (folder / MANIFEST).unlink(missing_ok=True)
    atomic_file.fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def apply_retention(directory: str | Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete snapshots; remove older complete ones and any incomplete folder older
    than the newest complete one (a failed attempt). Newer incomplete folders may be in progress: kept."""
    infos = list_snapshots(directory)
    complete = [i for i in infos if i.complete]
    if not complete:
        return []
    newest = complete[-1].step
    doomed = complete[: max(0, len(complete) - keep)] + [i for i in infos if not i.complete and i.step < newest]
    for info in doomed:
        remove_snapshot(info.path)
    return [i.path for i in doomed]


def manifest_body(
    folder: Path,
    *,
    step: int,
    world_size: int,
    job: str,
    tensors: int,
    mesh: tuple[int, int] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a folder whose shards rank-0..world_size-1 are all present; checks every entry is in exactly
    one file, and that the state is complete: tensors 0..tensors-1 and the description (``t/``, ``meta``), or for a
    model sharded over ``mesh`` (replicas, shards) those of every shard (``s/SSSSS/``: each shard exactly
    ``tensors`` tensors). SnapshotCorrupt otherwise."""
    files: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for rank in range(world_size):
        name = shard_name(rank)
        try:
            entries = file_entries(folder / name)
        except (OSError, KeyError, ValueError) as exc:
            raise SnapshotCorrupt(f"{folder / name}: unreadable shard: {exc}") from None
        for entry in entries:
            if entry in seen:
                raise SnapshotCorrupt(f"entry {entry} is in both {seen[entry]} and {name}")
            seen[entry] = name
        files[name] = {"size": (folder / name).stat().st_size, "entries": entries}
    if mesh is not None and mesh[0] * mesh[1] != world_size:
        raise SnapshotCorrupt(f"{folder}: a {mesh[0]}x{mesh[1]} mesh in a snapshot of {world_size} ranks")
    shards: list[int | None] = [None] if mesh is None else list(range(mesh[1]))
    for shard in shards:
        prefix, what = ("", "") if shard is None else (shard_prefix(shard), f" of shard {shard}")
        missing = [i for i in range(tensors) if f"{prefix}t/{i:06d}" not in seen]
        if missing:
            raise SnapshotCorrupt(f"{folder}: tensors {missing[:5]}{what} are in no file")
        held = sum(1 for entry in seen if entry.startswith(f"{prefix}t/"))
        if held != tensors:
            raise SnapshotCorrupt(f"{folder}: {held} tensors{what}, the state has {tensors}")
        if f"{prefix}meta" not in seen:
            raise SnapshotCorrupt(f"{folder}: no file holds the state description{what}")
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "job": job,
        "created": time.time(),
        "tensors": tensors,
        "files": files,
        **({} if mesh is None else {"mesh": [int(mesh[0]), int(mesh[1])]}),
        **dict(extra or {}),
    }
