#!/usr/bin/env python3
"""What a TorchPass snapshot costs the training loop, against torch.save and DCP's async_save, same state.

One process holds a model (a stack of square Linear layers) and its Adam state, about ``--gib`` GiB together
(a third parameters, two thirds Adam moments). In the same run it measures:

* **disk**: the folder's own sequential write bandwidth, dd-like (64 MiB writes of the same volume of random
  bytes, then fsync; through the page cache and with O_DIRECT, the faster counts), the ceiling for any
  checkpoint writer here; measured before the first snapshot and
  after each one, so every snapshot's write is compared with the better of the two disk runs around it (a
  shared machine's disk varies by the minute), and the median of those ratios is the figure;
* **torch.save**: a synchronous ``torch.save`` of model + optimizer state, then fsync (the same durability
  a snapshot has); the loop is stalled for all of it. Without the fsync too, for reference;
* **dcp.async_save**: ``torch.distributed.checkpoint.async_save`` (one-rank gloo group): the time the call
  blocks the loop (it stages a copy), and until its background write is done;
* **snapshot**, taken in a training loop (``--batch`` rows through the model, backward, Adam step): the stall
  is what the loop blocks for, :meth:`~torchpass.snapshot.Snapshotter.capture` at the step boundary plus
  what the next optimizer step waits for the copies of parameters and Adam state (which run during that
  step's forward and backward pass); the first snapshot also allocates the arena, so the steady state is
  the median of the later ones. The step after each snapshot is also compared with the loop's steady step
  time (the copies share this machine's cores and memory bandwidth with it). Then the writer process's shard
  time (checksums, HDF5 write, fsync, rename: the throughput compared with **disk**) and its end-to-end time
  until the manifest is durable;
* **restore**: :func:`torchpass.snapshot.restore` of the newest snapshot into a fresh model and optimizer,
  every checksum verified;
* the overhead of one snapshot per ``--period-s`` (20 minutes) of ``--step-s`` (1 s) steps: stall / period
  (and with the next step's slowdown added).

Goals (docs/architecture.md): stall < 10 % of torch.save's, write >= 80 % of the disk's bandwidth. With
``--device cuda`` (default when available) the state lives on the GPU and the copies are asynchronous. The
process runs at nice 10 with one torch thread (a shared machine). ``--quick`` (64 MiB of state, under a
minute). The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from clockwork.contracts.atomic_file import fsync_file
from clockwork.contracts.snapshots.store import list_snapshots
from torchpass.config import TorchPassConfig
from torchpass.rank.state import StateParts
from torchpass.snapshot import Snapshotter, restore

LOG = logging.LoggerAdapter(logging.getLogger("bench.snapshot"), {})


def say(text: str) -> None:
    print(text, flush=True)


def build(gib: float, device: torch.device, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model of about gib/3 GiB of float32 parameters, with Adam state after one step (another 2/3)."""
    per_layer = (width * width + width) * 4
    layers = max(1, round(gib * (1 << 30) / 3 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, snaps: Snapshotter) -> None:
    """One step as TorchPass's wrapped optimizer runs it: forward, backward, wait for snapshot copies, update."""
    model(batch).pow(2).mean().backward()
    snaps.before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_hash(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every model and optimizer tensor (bitwise identity of a restore)."""
    import hashlib

    digest = hashlib.sha256()
    tensors = list(model.state_dict().values())
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of random bytes (as incompressible as trained weights) in page-aligned memory, rounded up to
    a page: O_DIRECT writes need aligned buffers and lengths."""
    size = (nbytes + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, size)
    rng = np.random.default_rng(0)
    view = np.frombuffer(buf, dtype=np.uint8)
    for start in range(0, size, 64 << 20):
        chunk = view[start : start + (64 << 20)]
        chunk[:] = rng.integers(0, 256, chunk.size, dtype=np.uint8)
    del view, chunk
    return buf


def _timed_write(path: Path, data: memoryview, flags: int) -> float:
    """Seconds to create ``path``, write ``data`` in 64 MiB writes and fsync it (as ``dd bs=64M conv=fsync``);
    removing the file afterwards is not timed (on a file system mounted with ``discard`` that alone can take
    a good part of a second per GiB, which the snapshot writer never pays inside its write)."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    try:
        for start in range(0, len(data), 64 << 20):
            os.write(fd, data[start : start + (64 << 20)])
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()


def disk_bandwidth(folder: Path, data: memoryview) -> float:
    """Bytes/s of the disk's sequential write: 64 MiB writes of ``data`` plus the final fsync, both as ``dd
    conv=fsync`` (through the page cache) and as ``dd oflag=direct`` (straight to the device, where the file
    system allows it); the faster of the two, so the writer is compared with the best this disk does."""
    path = folder / "dd.bin"
    best = len(data) / _timed_write(path, data, 0)
    try:
        best = max(best, len(data) / _timed_write(path, data, os.O_DIRECT))
    except OSError:
        pass  # no O_DIRECT here (tmpfs, some network file systems): the buffered figure stands
    return best


def time_torch_save(model: nn.Module, opt: torch.optim.Optimizer, folder: Path, durable: bool) -> float:
    path = folder / "torch_save.pt"
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    if durable:
        fsync_file(path)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def time_dcp(model: nn.Module, opt: torch.optim.Optimizer, folder: Path) -> tuple[float | None, float | None, str]:
    """(blocking s, until written s, note) of dcp.async_save in a one-rank gloo group."""
    path = folder / "dcp"
    try:
        if not dist.is_initialized():
            store = dist.FileStore(str(folder / "pg-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(path))
        blocking = time.perf_counter() - started
        cast(Any, future).result()  # a Future (older torch) or an AsyncSaveResponse holding one
        total = time.perf_counter() - started
        return blocking, total, ""
    except Exception as exc:  # an API that moved between torch versions must not hide the other figures
        return None, None, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Written:
    """Event sink: the end-to-end seconds of each snapshot the writer finished."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.failed: list[dict[str, Any]] = []

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "torchpass.snapshot_written":
            self.seconds.append(float(fields["seconds"]))
        elif kind == "torchpass.snapshot_failed":
            self.failed.append(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="parameters + Adam state, GiB (default 1)")
    parser.add_argument("--snapshots", type=int, default=4, help="snapshots taken (the first allocates the arena)")
    parser.add_argument("--width", type=int, default=2048, help="Linear layer width (default 2048)")
    parser.add_argument("--batch", type=int, default=32, help="rows per training step (default 32)")
    parser.add_argument("--dir", default="", help="folder to write in (default: a temporary one under /var/tmp)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--period-s", type=float, default=1200.0, help="snapshot period for the overhead figure")
    parser.add_argument("--step-s", type=float, default=1.0, help="step time for the overhead figure")
    parser.add_argument("--quick", action="store_true", help="64 MiB of state, 3 snapshots (under a minute)")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.snapshots, args.width = 1 / 16, 3, 1024
    try:
        os.nice(10)
    except OSError:
        pass
    torch.set_num_threads(1)
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-snapshot-", dir=args.dir or "/var/tmp"))
    try:
        model, opt = build(args.gib, device, args.width)
        nbytes = state_bytes(model, opt)
        say(f"state: {nbytes / (1 << 30):.3f} GiB on {device} (model + Adam), folder {work}")

        # Random bytes, as incompressible as trained weights (a repeated pattern could be deduplicated).
        noise_buffer = random_buffer(nbytes)
        noise = memoryview(noise_buffer)
        disk_before = disk_bandwidth(work, noise)
        say(f"disk sequential write + fsync:  {disk_before / 1e9:7.3f} GB/s (measured again after each snapshot)")
        disk_runs = [disk_before]
        save_s = time_torch_save(model, opt, work, durable=True)
        save_nofsync_s = time_torch_save(model, opt, work, durable=False)
        say(f"torch.save + fsync (stall):      {save_s:7.3f} s   (without fsync {save_nofsync_s:.3f} s)")
        dcp_block, dcp_total, dcp_note = time_dcp(model, opt, work)
        if dcp_block is not None:
            say(f"dcp.async_save blocking (stall): {dcp_block:7.3f} s   (until written {dcp_total:.3f} s)")
        else:
            say(f"dcp.async_save: not measured ({dcp_note})")

        written = Written()
        cfg = TorchPassConfig(snapshot_dir=str(work / "snapshots"), snapshot_keep=2)
        snaps = Snapshotter(cfg, LOG, written)
        parts = StateParts(model, [opt], {})
        batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1)).to(device)

        def timed_step() -> float:
            started = time.perf_counter()
            train_step(model, opt, batch, snaps)
            sync(device)
            return time.perf_counter() - started

        stalls: list[float] = []
        captures: list[float] = []
        after_snapshot: list[float] = []
        try:
            for _ in range(2):  # warm-up: the allocator and the gradient buffers settle
                timed_step()
            steady_steps = [timed_step() for _ in range(5)]
            for i in range(args.snapshots):
                if i == args.snapshots - 1:
                    captured_hash = state_hash(model, opt)  # what the last snapshot must give back
                sync(device)
                started = time.perf_counter()
                taken = snaps.capture(parts, i, 0, 1)
                captures.append(time.perf_counter() - started)
                assert taken, "the writer was busy"
                after_snapshot.append(timed_step())  # training goes on; its optimizer step waits for the copies
                stalls.append(captures[-1] + snaps.last_wait_s)
                assert snaps.wait(600), "snapshot not written in 600 s"
                disk_runs.append(disk_bandwidth(work, noise))
                steady_steps.append(timed_step())
        finally:
            snaps.close()
        if written.failed:
            say(f"snapshot failures: {written.failed}")
        steady = statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0]
        write_s = statistics.median(written.seconds[1:] if len(written.seconds) > 1 else written.seconds)
        shard_s = statistics.median(snaps.shard_seconds[1:] if len(snaps.shard_seconds) > 1 else snaps.shard_seconds)
        throughput = nbytes / shard_s
        step_s = statistics.median(steady_steps)
        slowdown = statistics.median(a - step_s for a in after_snapshot[1:] or after_snapshot)
        say(f"training step ({args.batch} rows, forward, backward, Adam): {step_s:7.3f} s (median)")
        say(f"snapshot stall, first (allocates the arena): {stalls[0]:7.3f} s")
        say(
            f"snapshot stall, steady (median of {len(stalls) - 1}): {steady:7.3f} s "
            f"(capture {statistics.median(captures[1:] or captures):.3f} s + the next update's wait for the copies)"
        )
        say(f"the step after a snapshot vs the steady step: {slowdown:+7.3f} s (median)")
        say(f"snapshot shard write (checksums, HDF5, fsync, rename): {shard_s:7.3f} s = {throughput / 1e9:.3f} GB/s")
        say(f"snapshot end to end, until the manifest is durable: {write_s:7.3f} s = {nbytes / write_s / 1e9:.3f} GB/s")

        fresh_model, fresh_opt = build(args.gib, device, args.width)
        newest = [i for i in list_snapshots(work / "snapshots") if i.complete][-1]
        started = time.perf_counter()
        step = restore(
            StateParts(fresh_model, [fresh_opt], {}),
            newest.path,
            required=True,
            slot=0,
            device=device,
            agree=lambda ok: ok,
            log=LOG,
            event_sink=None,
        )
        sync(device)
        restore_s = time.perf_counter() - started
        assert step == args.snapshots - 1
        bitwise = state_hash(fresh_model, fresh_opt) == captured_hash
        del fresh_model, fresh_opt
        noise.release()
        noise_buffer.close()
        # Snapshot i's write against the better disk run around it (runs i and i + 1); the first snapshot
        # (it also allocates the arena) is left out like its stall.
        around = [max(disk_runs[i], disk_runs[i + 1]) for i in range(len(snaps.shard_seconds))]
        pairs = list(zip((nbytes / shard for shard in snaps.shard_seconds), around, strict=True))
        pairs = pairs[1:] or pairs
        write_ratio = statistics.median(w / d for w, d in pairs)
        disk = statistics.median(d for _w, d in pairs)
        say(f"disk runs around the snapshots: {', '.join(f'{d / 1e9:.3f}' for d in disk_runs)} GB/s")
        say(f"restore (every checksum verified): {restore_s:7.3f} s, bitwise equal to the captured state: {bitwise}")

        stall_ratio = steady / save_s
        cost = steady + max(0.0, slowdown)  # everything the loop lost to a snapshot, blocked or slowed
        overhead = steady / args.period_s
        say("")
        say(f"{'':34}{'stall s':>10}{'vs torch.save':>15}")
        say(f"{'torch.save + fsync':34}{save_s:>10.3f}{1.0:>15.3f}")
        if dcp_block is not None:
            say(f"{'dcp.async_save (blocking part)':34}{dcp_block:>10.3f}{dcp_block / save_s:>15.3f}")
        say(f"{'torchpass snapshot':34}{steady:>10.3f}{stall_ratio:>15.3f}   goal < 0.100")
        say(f"{'  + the next step slowed down':34}{cost:>10.3f}{cost / save_s:>15.3f}")
        say(
            f"write throughput vs disk: {throughput / 1e9:.3f} / {disk / 1e9:.3f} GB/s (medians); per snapshot, "
            f"against the disk runs around it: median {write_ratio:.3f}   goal >= 0.800"
        )
        say(
            f"overhead at one snapshot per {args.period_s:g} s of {args.step_s:g} s steps: {100 * overhead:.4f} % "
            f"(with the next step's slowdown {100 * cost / args.period_s:.4f} %; torch.save: "
            f"{100 * save_s / args.period_s:.4f} %)"
        )
        print(
            json.dumps(
                {
                    "device": device.type,
                    "state_bytes": nbytes,
                    "disk_write_gbps": round(disk / 1e9, 4),
                    "disk_write_gbps_runs": [round(d / 1e9, 4) for d in disk_runs],
                    "write_vs_disk_per_snapshot": [round(w / d, 4) for w, d in pairs],
                    "torch_save_implied_gbps": round(nbytes / save_s / 1e9, 4),
                    "torch_save_fsync_s": round(save_s, 4),
                    "torch_save_nofsync_s": round(save_nofsync_s, 4),
                    "dcp_async_blocking_s": None if dcp_block is None else round(dcp_block, 4),
                    "dcp_async_total_s": None if dcp_total is None else round(dcp_total, 4),
                    "dcp_note": dcp_note,
                    "snapshot_stall_first_s": round(stalls[0], 4),
                    "snapshot_stall_s": round(steady, 4),
                    "snapshot_capture_s": round(statistics.median(captures[1:] or captures), 4),
                    "train_step_s": round(step_s, 4),
                    "step_after_snapshot_extra_s": round(slowdown, 4),
                    "stall_and_slowdown_vs_torch_save": round(cost / save_s, 4),
                    "stall_vs_torch_save": round(stall_ratio, 4),
                    "stall_goal_met": stall_ratio < 0.10,
                    "snapshot_write_s": round(shard_s, 4),
                    "snapshot_end_to_end_s": round(write_s, 4),
                    "snapshot_write_gbps": round(throughput / 1e9, 4),
                    "write_vs_disk": round(write_ratio, 4),
                    "write_goal_met": write_ratio >= 0.80,
                    "restore_s": round(restore_s, 4),
                    "restore_bitwise": bitwise,
                    "overhead_pct_at_period": round(100 * overhead, 6),
                    "overhead_pct_with_slowdown": round(100 * cost / args.period_s, 6),
                    "period_s": args.period_s,
                    "step_s": args.step_s,
                }
            ),
            flush=True,
        )
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
