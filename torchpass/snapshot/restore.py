"""Restoring: the newest snapshot whose manifest and every checksum verify on every rank, loaded bitwise.

Ranks agree with one all-reduce per candidate (``agree``); a damaged or partial snapshot, or one of a model
sharded over another mesh shape, is reported (``torchpass.snapshot_rejected``) and the previous one is tried.
None good is an error, never a silent fresh start. Loading gives back every byte of the state, so training
resumed at (snapshot step + 1) ends bitwise equal to a run that never stopped: batches and RNG streams are
functions of the step (:mod:`torchpass.rank.data`, :mod:`torchpass.rank.rng`); the saved RNG states are restored too,
for randomness drawn outside ``ctx.steps``.

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

from clockwork.contracts.snapshots.store import (
    MANIFEST,
    SnapshotCorrupt,
    list_snapshots,
    load_manifest,
    read_entries,
    shard_prefix,
)
from torchpass.config import TorchPassConfig
from torchpass.events import EventSink, emit, emit_at
from torchpass.rank.state import StateParts, apply_state, as_bytes, destinations_for
from torchpass.rank.transfer_plan import ShardedReplicas
from torchpass.snapshot_location import snapshot_directory

__all__ = ["MeshMismatch", "RestoreError", "mesh_problem", "restart_advice", "restore"]


class RestoreError(RuntimeError):
    """No snapshot could be restored where one was required (the message lists what was tried)."""


class MeshMismatch(RuntimeError):
    """A snapshot of a model sharded otherwise (or not at all) than this job's."""


def _candidates(target: Path) -> list[Path]:
    """Snapshots to try, newest first: one named folder, or every ``step-*`` folder of a directory."""
    if (target / MANIFEST).exists() or target.name.startswith("step-"):
        return [target]
    return [info.path for info in reversed(list_snapshots(target))]


def mesh_problem(body: dict[str, Any], mesh: ShardedReplicas | None) -> str:
    """Why a snapshot (its manifest ``body``) cannot be loaded by a job of this ``mesh`` ("" when it can): a
    sharded model's shards are cut by the mesh's shape, so only the same shape can take them."""
    written = body.get("mesh")
    if written is None and mesh is None:
        return ""
    if written is None:
        ranks = body.get("world_size")
        return f"it holds an unsharded model's state ({ranks} ranks); this job's model is sharded {mesh}"
    replicas, shards = int(written[0]), int(written[1])
    tp = int(body.get("mesh_tp", 1))  # a tensor-parallel mesh: its shards are (shard, tp) pairs
    ep = int(body.get("mesh_ep", 1))  # an expert-parallel mesh: its parts hold experts
    shape = str(ShardedReplicas(replicas, shards, tp=tp)) + (f" (ep {ep})" if ep > 1 else "")
    options = (
        f"mesh_shape=({replicas}, {shards // tp})" + (f", tp={tp}" if tp > 1 else "") + (f", ep={ep}" if ep > 1 else "")
    )
    if mesh is None:
        return f"it holds a model sharded {shape} ({options}); this job's is not sharded"
    mine = str(mesh) + (f" (ep {mesh.ep})" if mesh.ep > 1 else "")
    if shape != mine:
        return f"it was written by a {shape} mesh and this job's mesh is {mine}: restore it with {options}"
    return ""


def _load_one(
    folder: Path, parts: StateParts, slot: int, mesh: ShardedReplicas | None
) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, np.ndarray]]:
    """Read and verify one snapshot into fresh tensors (model tensors: straight into the live ones). A sharded
    model's rank loads its own shard's state (entries ``s/SSSSS/``); every entry is read and checked either way."""
    body = load_manifest(folder)
    wrong_mesh = mesh_problem(body, mesh)
    if wrong_mesh:
        raise MeshMismatch(wrong_mesh)
    prefix = "" if mesh is None else shard_prefix(mesh.coordinate(slot)[1])
    meta_name, tensor_prefix = f"{prefix}meta", f"{prefix}t/"
    meta_entry = {f: d for f, d in body["files"].items() if meta_name in d["entries"]}
    if len(meta_entry) != 1:
        raise SnapshotCorrupt(f"{folder}: the state description {meta_name} is in {len(meta_entry)} shards")
    fname, fdesc = next(iter(meta_entry.items()))
    blob = read_entries(folder, {"files": {fname: {"entries": {meta_name: fdesc["entries"][meta_name]}}}})[meta_name]
    meta = pickle.loads(blob.tobytes())
    layout = [(name, tuple(shape)) for name, shape in meta["layout"]]
    if len(layout) != int(body["tensors"]):
        raise SnapshotCorrupt(f"{folder}: {len(layout)} tensors described, manifest lists {body['tensors']}")
    with torch.no_grad():
        destinations = destinations_for(parts, meta, layout, torch.device("cpu"))
    mine = f"rank/{slot:05d}/"

    def target(name: str, entry: dict[str, Any]) -> np.ndarray | None:
        if not name.startswith(tensor_prefix):
            return None if name.startswith(mine) or name == meta_name else _scratch(int(entry["nbytes"]))
        tensor = destinations[int(name[len(tensor_prefix) :])]
        if tensor.is_cuda:
            return None
        return as_bytes(tensor).numpy()

    loaded = read_entries(folder, body, target)
    cuda_tensors = {name: array for name, array in loaded.items() if name.startswith(tensor_prefix)}
    for name, array in cuda_tensors.items():
        dest = destinations[int(name[len(tensor_prefix) :])]
        as_bytes(dest).copy_(torch.from_numpy(array).to(dest.device))
    for i, (dtype_name, _) in enumerate(layout):
        if str(destinations[i].dtype) != dtype_name:
            raise SnapshotCorrupt(f"{folder}: tensor {i} is {dtype_name}, here {destinations[i].dtype}")
    # Optimizer and registered tensors stay on the host: load_state_dict moves them where their parameters
    # live (and keeps Adam's step counts on the CPU, as it wants them; a DTensor's local shard is moved to its
    # mesh's device by DTensor.from_local).
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
    mesh: ShardedReplicas | None = None,
) -> int | None:
    """Load the newest snapshot under ``target`` that verifies on every rank; returns its step.

    Tensors are read and checked on the host; model tensors on ``device`` are then copied there, optimizer
    and registered state is moved by their own ``load_state_dict``. A model sharded over ``mesh``: slot (r, s)
    loads shard s (its ``DTensor``s' local shards straight into the live parameters, its optimizer state rebuilt
    over the mesh, as a shard received from a peer is); a snapshot of another mesh shape is rejected, saying
    both.

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
            meta, tensors, own = _load_one(folder, parts, slot, mesh)
            ok = True
        except (SnapshotCorrupt, MeshMismatch, OSError) as exc:
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


def restart_advice(config: TorchPassConfig) -> str:
    """What a job that lost its state (:class:`torchpass.rank.transfer_plan.StateLost`) can restart from: the newest
    complete snapshot, or that snapshots are off. Said where the job's failure is reported."""
    if config.snapshot_every_steps <= 0 and config.snapshot_interval_s <= 0:
        return (
            "snapshots are off: turn them on (snapshot_every_steps, snapshot_interval_s or sbatch "
            "--clockwork-snapshot) to restart from one after such a loss"
        )
    directory = snapshot_directory(config)
    complete = [info for info in list_snapshots(directory) if info.complete]
    if not complete:
        return f"no snapshot was complete yet in {directory}: the job must start over"
    newest = complete[-1]
    return (
        f"restart from the newest snapshot, {newest.path} (step {newest.step}): torchpass run --restore "
        f"{newest.path}, or --set restore=latest (a requeued Slurm job restores it itself)"
    )
