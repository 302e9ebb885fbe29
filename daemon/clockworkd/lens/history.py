"""Per-minute Fleet Lens history in HDF5, one file per node, for post-mortems.

Prometheus keeps what it scrapes, but many clusters run none, and a post-mortem ("which link went
bad before the job died at 03:12?") needs the paths, clocks and suspects the node saw at the time.
So every node appends its snapshot once a minute to a local HDF5 file:

- ``/paths``: one row per directed path the node receives (time, src, dst, sent, received, loss,
  one-way delay min/p50/p99 and jitter in microseconds, bad = 1/0, -1 without a verdict);
- ``/clocks``: one row per node clock estimate (time, node, reference, offset, uncertainty in us);
- ``/suspects``: one row per suspect (time, link, nic, direction, confidence, kinds as JSON).

Each column is its own 1-D, chunked, resizable dataset, so appending a minute is a resize and a
slice write per column, and a reader can load one column without the rest. Missing numbers
(``None``) are stored as NaN.

Strings are stored once, in ``/names``, and the tables hold int32 indices into it (-1 for none).
The same few hundred NIC, node and link names repeat every minute, and HDF5 variable-length strings
cost about 70 bytes each on disk: interning them cuts a path row from ~220 to ~60 bytes, which is
three to four times the history in the same budget. :func:`read_history` hands the strings back.

Size is bounded by rotation: when the next append would take the file past ``max_bytes``, the file
becomes ``<path>.1`` (replacing the older one) and a fresh file starts, so at most about twice
``max_bytes`` is ever on disk. The file is opened for each append and closed right after: a daemon
crash then never leaves a half-written HDF5 file open, and tools can read it while the daemon runs.
A fresh file costs some tens of kilobytes of HDF5 structure, so ``max_bytes`` below ~100 kB rotates
every few appends.

This runs on the daemon's event loop, so :meth:`HistoryWriter.append` never raises: a full disk or
an unwritable folder must not take the prober down. It logs and returns False instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

log = logging.getLogger("clockwork.lens")

SCHEMA_VERSION = 1
# HDF5 1.10 file format: its chunk indexes for extendible datasets are far smaller than 1.8's
# B-trees, and every HDF5 tool from 2016 on reads it.
_LIBVER = ("v110", "v110")

NAME = "name"  # column kind: an index into /names
# table -> ((column, numpy dtype or NAME), ...); "time" first: it is written last (see _write).
TABLES: dict[str, tuple[tuple[str, Any], ...]] = {
    "paths": (
        ("time", np.float64),
        ("src", NAME),
        ("dst", NAME),
        ("sent", np.int32),
        ("received", np.int32),
        ("loss", np.float32),
        ("owd_min_us", np.float32),
        ("owd_p50_us", np.float32),
        ("owd_p99_us", np.float32),
        ("jitter_us", np.float32),
        ("bad", np.int8),
    ),
    "clocks": (
        ("time", np.float64),
        ("node", NAME),
        ("reference", NAME),
        ("offset_us", np.float64),  # offsets reach seconds; float32 would lose the microseconds
        ("uncertainty_us", np.float32),
    ),
    "suspects": (
        ("time", np.float64),
        ("link", NAME),
        ("nic", NAME),
        ("direction", NAME),
        ("confidence", np.float32),
        ("kinds", NAME),
    ),
}
_ROW_BYTES = 64  # about what one row of the widest table takes, for sizing chunks
_FIRST_GUESS_ROW_BYTES = 200  # before the file can tell its own bytes per row


def _dtype(kind: Any) -> np.dtype[Any]:
    return np.dtype(np.int32) if kind == NAME else np.dtype(kind)


def _float(value: Any) -> float:
    """A float, NaN for None or anything that is not a number (so one bad field costs one cell)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return -1
    return int(value)


def _rows(snapshot: Mapping[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """The snapshot as column lists, one dict per table (names still as strings, None for none)."""
    t = _float(snapshot.get("time"))
    out: dict[str, dict[str, list[Any]]] = {table: {col: [] for col, _ in cols} for table, cols in TABLES.items()}

    paths = out["paths"]
    for p in snapshot.get("paths") or ():
        if not isinstance(p, Mapping):
            continue
        verdict = p.get("verdict")
        bad = verdict.get("bad") if isinstance(verdict, Mapping) else None
        paths["time"].append(t)
        paths["src"].append(str(p.get("src", "")))
        paths["dst"].append(str(p.get("dst", "")))
        paths["sent"].append(_int(p.get("sent")))
        paths["received"].append(_int(p.get("received")))
        for col in ("loss", "owd_min_us", "owd_p50_us", "owd_p99_us", "jitter_us"):
            paths[col].append(_float(p.get(col)))
        paths["bad"].append(-1 if not isinstance(bad, bool) else int(bad))

    clocks = out["clocks"]
    reference = str(snapshot["reference"]) if snapshot.get("reference") else None
    clock = snapshot.get("clock")
    for node, est in sorted(clock.items()) if isinstance(clock, Mapping) else ():
        if not isinstance(est, Mapping):
            continue
        clocks["time"].append(t)
        clocks["node"].append(str(node))
        clocks["reference"].append(reference)
        clocks["offset_us"].append(_float(est.get("offset_us")))
        clocks["uncertainty_us"].append(_float(est.get("uncertainty_us")))

    suspects = out["suspects"]
    for s in snapshot.get("suspects") or ():
        if not isinstance(s, Mapping):
            continue
        suspects["time"].append(t)
        suspects["link"].append(str(s.get("link", "")))
        suspects["nic"].append(str(s["nic"]) if s.get("nic") else None)
        suspects["direction"].append(str(s.get("direction", "")))
        suspects["confidence"].append(_float(s.get("confidence")))
        suspects["kinds"].append(json.dumps(list(s.get("kinds") or ())))
    return out


class HistoryWriter:
    """Appends snapshots to ``path`` and rotates it to ``path.1`` before it outgrows ``max_bytes``.

    One writer per file; calls may come from any thread (a lock serialises them), though the daemon
    calls it from its event loop once a minute.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.rotated = self.path.with_name(self.path.name + ".1")
        # A table grows a whole chunk at a time, so a chunk of every column must be a small share of
        # the budget (1/32 here) for the size check to hold; within that, bigger chunks mean fewer
        # index entries. 4096 rows is 41 minutes of 100 paths.
        self._chunk_rows = int(min(4096, max(16, max_bytes // (32 * _ROW_BYTES))))
        self._lock = threading.Lock()

    def append(self, snapshot: Mapping[str, Any]) -> bool:
        """Write one snapshot's rows; True when written, False (logged) when anything went wrong."""
        with self._lock:
            try:
                rows = _rows(snapshot)
                n_rows = sum(len(cols["time"]) for cols in rows.values())
                self._rotate_if_needed(n_rows)
                self._write(rows, snapshot)
                return True
            except Exception as exc:  # I/O, HDF5, a malformed snapshot: never into the event loop
                log.warning("Fleet Lens history %s: append failed: %s", self.path, exc)
                return False

    def _rotate_if_needed(self, n_rows: int) -> None:
        """Move the file aside when adding ``n_rows`` would take it past the bound.

        The bytes a row costs are learnt from the file itself (its size over its rows), which
        includes its share of the fixed HDF5 structure: an overestimate while the file is young, so
        the check errs towards rotating early rather than late.
        """
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        try:
            with h5py.File(self.path, "r") as f:
                stored = sum(int(f[table]["time"].shape[0]) for table in TABLES if table in f)
        except OSError as exc:
            # A file we cannot read as HDF5 (truncated by a crash, or not ours): keep it as .1 for
            # whoever investigates, and start afresh rather than failing every minute from now on.
            log.warning("Fleet Lens history %s: unreadable (%s); moving it to %s", self.path, exc, self.rotated)
            os.replace(self.path, self.rotated)
            return
        per_row = size / stored if stored else _FIRST_GUESS_ROW_BYTES
        if stored and size + n_rows * per_row > self.max_bytes:
            os.replace(self.path, self.rotated)
            log.info("Fleet Lens history %s: rotated to %s at %d bytes", self.path, self.rotated, size)

    def _write(self, rows: dict[str, dict[str, list[Any]]], snapshot: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(self.path, "a", libver=_LIBVER) as f:
            if "schema" not in f.attrs:
                f.attrs["schema"] = SCHEMA_VERSION
                f.attrs["node"] = str(snapshot.get("node") or "")
            if "names" not in f:
                f.create_dataset("names", shape=(0,), maxshape=(None,), dtype=h5py.string_dtype(), chunks=(256,))
            names_ds = f["names"]
            index = {_text(name): i for i, name in enumerate(names_ds[()])}
            new_names: list[str] = []

            def intern(name: str | None) -> int:
                if name is None:
                    return -1
                if name not in index:
                    index[name] = len(index)
                    new_names.append(name)
                return index[name]

            columns = {
                table: {
                    col: [intern(v) for v in rows[table][col]] if kind == NAME else rows[table][col]
                    for col, kind in cols
                }
                for table, cols in TABLES.items()
            }
            # Names before the rows that point at them: a failure in between leaves unused names, never
            # rows naming nothing.
            if new_names:
                start = names_ds.shape[0]
                names_ds.resize((start + len(new_names),))
                names_ds[start:] = np.asarray(new_names, dtype=object)
            for table, cols in TABLES.items():
                group = f.require_group(table)
                for col, kind in cols:
                    if col not in group:
                        group.create_dataset(
                            col, shape=(0,), maxshape=(None,), dtype=_dtype(kind), chunks=(self._chunk_rows,)
                        )
                n = len(columns[table]["time"])
                if not n:
                    continue
                # "time" is written last and its length is the table's committed row count: an append
                # that failed half-way leaves other columns longer, and the next one overwrites them.
                start = int(group["time"].shape[0])
                for col, kind in (*cols[1:], cols[0]):
                    ds = group[col]
                    ds.resize((start + n,))
                    ds[start:] = np.asarray(columns[table][col], dtype=_dtype(kind))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_history(path: Path, include_rotated: bool = False) -> dict[str, Any]:
    """The history file as ``{"node": str, "paths": {column: ...}, "clocks": {...}, "suspects": {...}}``.

    Numeric columns come back as numpy arrays; name columns as lists of ``str`` (``None`` where the
    snapshot had none: an inter-switch suspect's NIC); ``kinds`` as lists of lists. With
    ``include_rotated`` the older ``path.1`` (when present) comes first, so a post-mortem sees the
    whole retained window in time order. Raises OSError for a missing or unreadable file: tooling
    wants to know.
    """
    path = Path(path)
    older = path.with_name(path.name + ".1")
    files = ([older] if include_rotated and older.exists() else []) + [path]
    merged: dict[str, Any] = {"node": ""}
    for table, cols in TABLES.items():
        merged[table] = {col: ([] if kind == NAME else np.empty(0, dtype=_dtype(kind))) for col, kind in cols}
    for file in files:
        with h5py.File(file, "r") as f:
            merged["node"] = _text(f.attrs.get("node", merged["node"]))
            names = [_text(n) for n in f["names"][()]] if "names" in f else []
            for table, cols in TABLES.items():
                if table not in f:
                    continue
                group = f[table]
                committed = int(group["time"].shape[0]) if "time" in group else 0
                for col, kind in cols:
                    values = np.full(committed, -1 if _dtype(kind).kind == "i" else np.nan, dtype=_dtype(kind))
                    if col in group:  # absent: a column a later schema added
                        stored = group[col][:committed]
                        values[: len(stored)] = stored
                    if kind == NAME:
                        merged[table][col] += [names[i] if 0 <= i < len(names) else None for i in values.tolist()]
                    else:
                        merged[table][col] = np.concatenate([merged[table][col], values])
    merged["suspects"]["kinds"] = [json.loads(k) if k else [] for k in merged["suspects"]["kinds"]]
    return merged
