"""Restoring: the newest snapshot whose manifest and every checksum verify on every rank, loaded bitwise.

Ranks agree with one all-reduce per candidate (``agree``); a damaged or partial snapshot is reported
(``torchpass.snapshot_rejected``) and the previous one is tried. None good is an error, never a silent fresh
start. Loading gives back every byte of the state, so training resumed at (snapshot step + 1) ends bitwise
equal to a run that never stopped: batches and RNG streams are functions of the step (:mod:`torchpass.data`,
:mod:`torchpass.rng`); the saved RNG states are restored too, for randomness drawn outside ``ctx.steps``.

The state description is pickled into the snapshot, like ``torch.load(weights_only=False)``: load only
snapshots your own jobs wrote.
"""

from __future__ import annotations

import logging
import pickle
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clockworkd.snapshots.store import MANIFEST, SnapshotCorrupt, list_snapshots, load_manifest, read_entries
from torchpass.events import EventSink, emit, emit_at
from torchpass.state import StateParts, apply_state, as_bytes, destinations_for

__all__ = ["RestoreError", "restore"]


class RestoreError(RuntimeError):
    """No snapshot could be restored where one was required (the message lists what was tried)."""


def _candidates(target: Path) -> list[Path]:
    """Snapshots to try, newest first: one named folder, or every ``step-*`` folder of a directory."""
    if (target / MANIFEST).exists() or target.name.startswith("step-"):
        return [target]
    return [info.path for info in reversed(list_snapshots(target))]


def _load_one(
    folder: Path, parts: StateParts, slot: int
) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, np.ndarray]]:
    """Read and verify one snapshot into fresh tensors (model tensors: straight into the live ones)."""
    body = load_manifest(folder)
    meta_entry = {f: d for f, d in body["files"].items() if "meta" in d["entries"]}
    if len(meta_entry) != 1:
        raise SnapshotCorrupt(f"{folder}: the state description is in {len(meta_entry)} shards")
    fname, fdesc = next(iter(meta_entry.items()))
    blob = read_entries(folder, {"files": {fname: {"entries": {"meta": fdesc["entries"]["meta"]}}}})["meta"]
    meta = pickle.loads(blob.tobytes())
    layout = [(name, tuple(shape)) for name, shape in meta["layout"]]
    if len(layout) != int(body["tensors"]):
        raise SnapshotCorrupt(f"{folder}: {len(layout)} tensors described, manifest lists {body['tensors']}")
    with torch.no_grad():
        destinations = destinations_for(parts, meta, layout, torch.device("cpu"))
    mine = f"rank/{slot:05d}/"

    def target(name: str, entry: dict[str, Any]) -> np.ndarray | None:
        if not name.startswith("t/"):
            return None if name.startswith(mine) or name == "meta" else _scratch(int(entry["nbytes"]))
        tensor = destinations[int(name[2:])]
        if tensor.is_cuda:
            return None
        return as_bytes(tensor).numpy()

    loaded = read_entries(folder, body, target)
    cuda_tensors = {name: array for name, array in loaded.items() if name.startswith("t/")}
    for name, array in cuda_tensors.items():
        dest = destinations[int(name[2:])]
        as_bytes(dest).copy_(torch.from_numpy(array).to(dest.device))
    for i, (dtype_name, _) in enumerate(layout):
        if str(destinations[i].dtype) != dtype_name:
            raise SnapshotCorrupt(f"{folder}: tensor {i} is {dtype_name}, here {destinations[i].dtype}")
    # Optimizer and registered tensors stay on the host: load_state_dict moves them where their parameters
    # live (and keeps Adam's step counts on the CPU, as it wants them).
    return meta, destinations, {k: v for k, v in loaded.items() if k.startswith(mine)}


_SCRATCH: dict[str, np.ndarray] = {}


def _scratch(nbytes: int) -> np.ndarray:
    held = _SCRATCH.get("b")
    if held is None or held.nbytes < nbytes:
        held = _SCRATCH["b"] = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return held[:nbytes]


def _restore_rng(own: dict[str, np.ndarray], slot: int) -> None:
    prefix = f"rank/{slot:05d}/"
    if f"{prefix}torch_cpu_rng" in own:
        torch.set_rng_state(torch.from_numpy(own[f"{prefix}torch_cpu_rng"].copy()))
    if f"{prefix}python_rng" in own:
        random.setstate(pickle.loads(own[f"{prefix}python_rng"].tobytes()))
    if f"{prefix}numpy_rng" in own:
        np.random.set_state(pickle.loads(own[f"{prefix}numpy_rng"].tobytes()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            state = own.get(f"{prefix}cuda_rng/{index}")
            if state is not None:
                torch.cuda.set_rng_state(torch.from_numpy(state.copy()), index)


def restore(
    parts: StateParts,
    target: Path,
    *,
    required: bool,
    slot: int,
    device: torch.device,
    agree: Callable[[bool], bool],
    log: logging.LoggerAdapter,  # type: ignore[type-arg]
    event_sink: EventSink | None,
) -> int | None:
    """Load the newest snapshot under ``target`` that verifies on every rank; returns its step.

    Tensors are read and checked on the host; model tensors on ``device`` are then copied there, optimizer
    and registered state is moved by their own ``load_state_dict``.

    ``agree(ok)`` is True only when every rank's ``ok`` is (an all-reduce). Returns None when restoring was
    not required and there is no snapshot at all; raises :class:`RestoreError` when none is good."""
    candidates = _candidates(target)
    if not candidates:
        if required:
            raise RestoreError(f"no snapshot to restore in {target}")
        emit_at(logging.WARNING, event_sink, log, "torchpass.restore_none", directory=str(target))
        return None
    rejected: list[str] = []
    for folder in candidates:
        started = time.perf_counter()
        ok, problem = False, ""
        try:
            meta, tensors, own = _load_one(folder, parts, slot)
            ok = True
        except (SnapshotCorrupt, OSError) as exc:
            problem = str(exc)
        except Exception as exc:  # a state that does not fit this model: as bad as a damaged one
            problem = f"{type(exc).__name__}: {exc}"
        everyone = agree(ok)
        if not everyone:
            why = problem or "another rank could not load it"
            rejected.append(f"{folder.name}: {why}")
            emit_at(logging.ERROR, event_sink, log, "torchpass.snapshot_rejected", folder=str(folder), error=why)
            continue
        apply_state(parts, meta, tensors)
        _restore_rng(own, slot)
        committed = int(meta["committed"])
        emit(
            event_sink,
            log,
            "torchpass.restored",
            folder=str(folder),
            step=committed,
            seconds=round(time.perf_counter() - started, 3),
            rejected=len(rejected),
        )
        return committed
    raise RestoreError(f"no good snapshot in {target}; tried: " + "; ".join(rejected))
