#!/usr/bin/env python3
"""Peer copies in pure FSDP: what they cost a step at K = 1, 5 and 20 (and K = 1 with ``peer_copy_sync``), and
how fast a crash is rebuilt from one.

The job (``bench/support/peercopy_workload.py``: ``fsdp_workload.py``'s residual MLP blocks, each its own
``fully_shard``, AdamW, ``clip_grad_norm_``) runs as ``--nproc`` local ranks on 127.0.0.1 over gloo, pure FSDP
(a 1 x N mesh, no replica), under ``torchpass run --local``.

* **Overhead, interleaved.** In one job, segments of ``--segment`` steps cycle through peer copies off and on
  with K = 1, 5, 20 and K = 1 synchronous (off, 1, off, 5, off, 20, off, 1s, off, ...), switched at step
  boundaries in the same ranks; each segment with copies is set against the mean of the off segments either side
  of it, so both share every slow phase of the machine. Reported per mode: the mean ratio with a 95 % interval
  (Student's t over the segments); and the bytes each rank streamed, what steps waited for copies (optimizer
  steps; with ``peer_copy_sync`` the commits, which wait for the whole round and a vote), the host memory held.
* **Recovery.** Slot 1 SIGKILLs itself in the forward pass of a step; a spare takes its slot and receives the
  shard from its ring successor's copy. Reported from the coordinator's ``torchpass.recovered`` event for K = 1,
  K = 5 and K = 1 synchronous: crash to every member rejoined (``total_ms``), the transfer, the bytes, and the
  steps computed again (K = 5 rolls back to the newest step every shard is held at).

``--quick`` runs in under a minute (one job of 2 cycles, crashes at K = 1, 5 and 1 sync). The last line printed is one
JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from support.torchpass_jobs import base_env, say, spawn, wait_all
from torchpass_overhead import T95, interval

WORKLOAD = Path(__file__).resolve().parent / "support" / "peercopy_workload.py"
MODES = ("1", "5", "20", "1s")  # K, or 1s: K = 1 with peer_copy_sync (a commit waits for the copies)


def launch(args: argparse.Namespace, out: Path, mode: str, settings: list[str], *extra: str) -> None:
    """One ``torchpass run --local`` job of the workload; RuntimeError when it fails."""
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torchpass", "run", "--local", "--nproc", str(args.nproc),
        "--spares", "1" if mode == "crash" else "0", "--events", str(out / "events.jsonl"),
        *(a for s in settings for a in ("--set", s)),
        str(WORKLOAD), mode, "--out", str(out), "--hidden", str(args.hidden), "--layers", str(args.layers),
        "--batch", str(args.batch), *extra,
    ]  # fmt: skip
    code = wait_all([spawn(cmd, base_env(), out / "torchpass.err")], args.timeout)[0]
    if code:
        raise RuntimeError(f"the {mode} job exited with {code}; see {out}/torchpass.err")


def overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The interleaved job: per K, the ratio of its segments to their off neighbours, and the stream's cost."""
    out = work / "interleaved"
    extra = ["--segment", str(args.segment), "--cycles", str(args.cycles), "--ks", ",".join(MODES)]
    launch(args, out, "interleaved", [], *extra)
    segments = json.loads((out / "interleaved.json").read_text())["segments"]
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    off_seconds = [s["seconds"] for s in segments if s["mode"] == "off"]
    for i, seg in enumerate(segments):
        if seg["mode"] != "off" and 0 < i < len(segments) - 1:
            ratios[seg["mode"]].append(
                seg["seconds"] / statistics.fmean([segments[i - 1]["seconds"], segments[i + 1]["seconds"]])
            )
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("peers-*.json"))]
    total_on = args.segment * sum(len(r) for r in ratios.values())
    waits = {mode: sum(s["waited_s"] for s in segments[1:-1] if s["mode"] == mode) for mode in MODES}  # slot 0's
    return {
        "off_ms_per_step": 1000 * statistics.median(off_seconds) / args.segment,
        "per_k": {
            mode: {
                "overhead_pct": round(100 * (statistics.fmean(ratios[mode]) - 1), 2),
                "ci95_pct": interval(ratios[mode], T95) if len(ratios[mode]) > 1 else [],
                "segments": len(ratios[mode]),
                "waited_ms_per_step": round(1000 * waits[mode] / max(args.segment * len(ratios[mode]), 1), 3),
            }
            for mode in MODES
        },
        "shard_mb": round(max(r["shard_bytes"] for r in ranks) / 2**20, 2),
        "host_mb_per_rank": round(max(r["host_bytes"] for r in ranks) / 2**20, 2),
        "sent_mb_per_rank": round(max(r["bytes_sent"] for r in ranks) / 2**20, 2),
        "steps_with_copies": total_on,
        "last_round_ms": round(max(r["last_round_ms"] for r in ranks), 2),
        "failed_or_skipped": sum(r["failed"] + r["skipped"] for r in ranks),
    }


def recovery(args: argparse.Namespace, work: Path, mode: str, crash_step: int) -> dict[str, Any]:
    """Slot 1 crashes at ``crash_step`` with copies in ``mode`` (K, or 1s): the coordinator's recovery figures."""
    out = work / f"crash-k{mode}"
    settings = [f"peer_copy_every_steps={mode.rstrip('s')}", f"peer_copy_sync={str(mode.endswith('s')).lower()}"]
    launch(args, out, "crash", settings, "--steps", str(args.steps), "--crash-step", str(crash_step))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    (fields,) = [e["fields"] for e in events if e["kind"] == "torchpass.recovered"]
    move = next(m for m in fields["moves"] if m["target"] == 1)
    return {
        "k": mode,
        "crash_step": crash_step,
        "resumed_at": fields["step"],
        "recomputed_steps": fields["recomputed_steps"],
        "total_ms": fields.get("total_ms"),
        "transfer_ms": fields["transfer_ms"],
        "rebuild_ms": fields["rebuild_ms"],
        "copy_from_slot": move["source"],
        "copy_mb": round(move["bytes"] / 2**20, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks: the mesh is 1 x nproc (default 4)")
    parser.add_argument("--hidden", type=int, default=512, help="block width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="blocks, each its own fully_shard (default 4)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--segment", type=int, default=10, help="steps per segment (default 10)")
    parser.add_argument("--cycles", type=int, default=6, help="passes over off/1/off/5/off/20/off/1s (default 6)")
    parser.add_argument("--steps", type=int, default=40, help="steps of a crash job (default 40)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one job may take")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' folders")
    parser.add_argument("--quick", action="store_true", help="2 cycles of 5-step segments, short crash jobs")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.segment, args.steps = 2, 5, 16
    say(
        f"fsdp_peer_copy: {args.nproc} ranks on 127.0.0.1 (gloo), pure FSDP 1x{args.nproc}, {args.layers} blocks of "
        f"{args.hidden}, batch {args.batch}; {args.cycles} cycles of off/K segments of {args.segment} steps, K in "
        f"{MODES} (1s: K = 1 with peer_copy_sync)"
    )
    work = Path(tempfile.mkdtemp(prefix="fsdp-peer-copy-"))
    started = time.monotonic()
    try:
        cost = overhead(args, work)
        crash_step = args.steps // 2 + 4  # three steps past a K = 5 round (rounds at 4, 9, 14, ...): a rollback shows
        crashes = [recovery(args, work, mode, crash_step) for mode in ("1", "5", "1s")]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    say(
        f"no copies: {cost['off_ms_per_step']:.2f} ms/step; a shard (parameters + AdamW state) is {cost['shard_mb']} "
        f"MiB, each rank holds {cost['host_mb_per_rank']} MiB of copies (3 own + 2 of its neighbour's)"
    )
    for mode, row in cost["per_k"].items():
        low, high = row["ci95_pct"] or [float("nan")] * 2
        label = f"K = {mode.rstrip('s'):>2}{' sync' if mode.endswith('s') else '     '}"
        say(
            f"  {label}: step time {row['overhead_pct']:+.2f} % (95 % interval {low:+.2f}..{high:+.2f} %, "
            f"{row['segments']} segments); slot 0 waited {row['waited_ms_per_step']} ms per step for copies"
        )
    say(
        f"  streamed {cost['sent_mb_per_rank']} MiB per rank over {cost['steps_with_copies']} steps with copies; a "
        f"round took {cost['last_round_ms']} ms (waits: the optimizer steps', and in sync mode the commits')"
    )
    for row in crashes:
        label = f"K = {row['k'].rstrip('s')}{' sync' * row['k'].endswith('s')}"
        say(
            f"crash at step {row['crash_step']}, {label}: rejoined in {row['total_ms']} ms (rebuild "
            f"{row['rebuild_ms']} ms, transfer {row['transfer_ms']} ms of {row['copy_mb']} MiB from slot "
            f"{row['copy_from_slot']}'s copy), resumed at step {row['resumed_at']}, {row['recomputed_steps']} step(s) "
            "computed again"
        )
    say(f"({time.monotonic() - started:.0f} s)")
    print(
        json.dumps(
            {
                "bench": "fsdp_peer_copy",
                "nproc": args.nproc,
                "mesh": [1, args.nproc],
                "model": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch},
                "segment_steps": args.segment,
                "cycles": args.cycles,
                **cost,
                "recovery": crashes,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
