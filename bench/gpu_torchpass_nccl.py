#!/usr/bin/env python3
"""TorchPass's NCCL path on a real GPU: a planned migration of a rank to a spare, through NCCL, bitwise exact.

One GPU allows one NCCL rank at a time (NCCL refuses two ranks on one device), so the job has one slot and one
spare on the same GPU: ``torchpass run --local --nproc 1 --spares 1 --set backend=nccl``. Half-way through,
``clockwork migrate`` moves slot 0 to the spare: the old rank hands its live state over and leaves, the spare
forms a new NCCL communicator (a new generation, non-blocking, as TorchPass makes them) and training goes on.
The baseline, run first in the same process, is the same job with no migration. Printed: both runs' final
weight hashes (they must be equal), the migration's pause (step time across the handover vs the median step),
and the events. ``--backend gloo`` runs the same on CPU (how it is checked on machines without a GPU).
``--fsdp`` shards the model with ``ctx.wrap_fsdp`` (FSDP2 on a 1 x 1 mesh, its collectives on TorchPass's NCCL
subgroups): the migration then hands over the rank's shard.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "support" / "torchpass_gpu_train.py"


def run_job(out: Path, backend: str, steps: int, migrate_at: int | None, fsdp: bool = False) -> dict[str, Any]:
    out.mkdir(parents=True)
    events = out / "events.jsonl"
    coord = out / "coordinator"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_"))}
    env.update(PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [
        sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "1",
        "--spares", "1" if migrate_at is not None else "0", "--set", f"backend={backend}",
        "--events", str(events), "--coordinator-file", str(coord),
        str(TRAIN), "--steps", str(steps), "--out", str(out), *(["--fsdp"] if fsdp else []),
    ]  # fmt: skip
    log = (out / "launcher.log").open("w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    migrated_at = None
    try:
        while proc.poll() is None:
            if migrate_at is not None and migrated_at is None:
                progress = (out / "progress").read_text().split() if (out / "progress").exists() else []
                if progress and int(progress[0]) >= migrate_at and coord.exists():
                    ask = subprocess.run(
                        [sys.executable, "-m", "clockwork.cli.main", "migrate", "--coordinator", str(coord),
                         "--rank", "0"],
                        env=env, capture_output=True, text=True, timeout=60,
                    )  # fmt: skip
                    migrated_at = int(progress[0])
                    said = f"{ask.stdout.strip()} {ask.stderr.strip()}"
                    print(f"migrate at step {migrated_at}: exit {ask.returncode} {said}")
            time.sleep(0.01)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    finals = {p.name: p.read_text().split() for p in out.glob("final-*")}
    evs = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return {
        "rc": rc,
        "seconds": time.monotonic() - started,
        "finals": finals,
        "events": [e.get("kind") or e.get("event") for e in evs],
        "raw_events": evs,
        "migrated_at": migrated_at,
        "log_tail": (out / "launcher.log").read_text()[-3000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="40 steps (under a minute)")
    parser.add_argument("--fsdp", action="store_true", help="the model sharded by ctx.wrap_fsdp (FSDP2) instead of DDP")
    args = parser.parse_args()
    steps = 40 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="tp-nccl-") as tmp:
        base = run_job(Path(tmp) / "baseline", args.backend, steps, None, args.fsdp)
        moved = run_job(Path(tmp) / "migrated", args.backend, steps, steps // 2, args.fsdp)
    for name, r in (("baseline", base), ("migrated", moved)):
        print(f"{name}: exit {r['rc']} in {r['seconds']:.1f} s, finals {r['finals']}, events {r['events']}")
        if r["rc"] != 0 or not r["finals"]:
            print(r["log_tail"])
    for e in moved["raw_events"]:  # what went wrong, if anything: the coordinator's own words
        if any(word in str(e.get("kind") or e.get("event")) for word in ("error", "departed", "failed")):
            print("  event", json.dumps(e, default=str)[:600])
    base_hash = next(iter(base["finals"].values()), [None])[0]
    moved_hashes = {v[0] for v in moved["finals"].values()}
    equal = base_hash is not None and moved_hashes == {base_hash}
    migrations = [e for e in moved["raw_events"] if "migrat" in str(e.get("kind") or e.get("event"))]
    print(f"final weights bitwise equal: {equal}; migration events: {len(migrations)}")
    figures = {
        "backend": args.backend,
        "model": "fsdp" if args.fsdp else "ddp",
        "steps": steps,
        "baseline_rc": base["rc"],
        "migrated_rc": moved["rc"],
        "bitwise_equal": equal,
        "migrated_at_step": moved["migrated_at"],
        "migration_events": [e.get("kind") or e.get("event") for e in migrations],
        "devices": sorted({v[1] for v in moved["finals"].values()}),
    }
    print(json.dumps(figures))
    return 0 if equal and moved["rc"] == 0 and migrations else 1


if __name__ == "__main__":
    sys.exit(main())
