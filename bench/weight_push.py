#!/usr/bin/env python3
"""Weight push to RL rollout workers: latency until every subscriber holds a new version, and trainer stall.

The trainer (this process) holds a model of ``--gib`` GiB of float32 parameters and a
:class:`torchpass.rollout.Publisher`; ``--subscribers`` (4) rollout worker processes each poll a
:class:`torchpass.rollout.Subscriber` in a loop and report, for each version they hold, the wall-clock time
it became theirs. For each of ``--versions`` publishes (the parameters change in between) it measures:

* **stall**: how long ``publish()`` kept the trainer (staging copy; the streaming is the serving thread's);
* **latency**: from the publish call until the last subscriber holds that version, complete and checked.

Baseline, side by side in the same run: a **synchronous push** of the same bytes (the trainer sends the
whole buffer as one ZeroMQ message to each subscriber, CURVE like ours, and waits for every acknowledgement):
its stall is its latency. Two warm-up versions are not counted (worker start-up, buffer allocation). The
table gives both and the ratios. ``--quick``: 64 MiB, 3 versions (well under a minute). The process runs at
nice 10. The last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, cast

import torch
import zmq
from torch import nn

from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey
from torchpass.auth import serve
from torchpass.rollout import Publisher

WORKER = r"""
import json, sys, time
import zmq
from torchpass.auth import connect_as_client
from torchpass.rollout import Subscriber
mode, endpoint = sys.argv[1], sys.argv[2]
if mode == "rollout":
    sub = Subscriber(endpoint, request_timeout_s=60)
    while True:
        if sub.poll(1.0):
            print(json.dumps({"version": sub.version, "t": time.time()}), flush=True)
else:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    connect_as_client(sock)
    sock.connect(endpoint)
    sock.send(b"ready")
    while True:
        frames = sock.recv_multipart()
        version = int(frames[0])
        sock.send(str(version).encode())
        print(json.dumps({"version": version, "t": time.time(), "bytes": len(frames[1])}), flush=True)
"""


WARMUP = 2  # versions not counted: the workers start (import torch) and both buffers get allocated


def say(text: str) -> None:
    print(text, flush=True)


class Workers:
    """The subscriber processes and the times each reported holding each version."""

    def __init__(self, mode: str, endpoint: str, count: int) -> None:
        self.held: dict[int, dict[int, float]] = {}  # version -> worker -> time
        self.lock = threading.Lock()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, mode, endpoint], stdout=subprocess.PIPE, text=True, bufsize=1
            )
            for _ in range(count)
        ]
        for index, proc in enumerate(self.procs):
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            report = json.loads(line)
            with self.lock:
                self.held.setdefault(int(report["version"]), {})[index] = float(report["t"])

    def wait_all(self, version: int, timeout_s: float) -> float:
        """When the last worker got ``version`` (wall clock)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                got = self.held.get(version, {})
                if len(got) == len(self.procs):
                    return max(got.values())
            time.sleep(0.002)
        raise TimeoutError(f"version {version} not held by every worker within {timeout_s} s: {self.held}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def run_rollout(model: nn.Module, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    pub = Publisher("tcp://127.0.0.1:0", chunk_mb=args.chunk_mb)
    workers = Workers("rollout", pub.endpoint, args.subscribers)
    stalls, latencies = [], []
    try:
        for version in range(1, WARMUP + args.versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            started = time.time()
            number = pub.publish(model)
            stall = time.time() - started
            assert number == version, f"publish skipped ({number})"
            latency = workers.wait_all(version, 600) - started
            if version > WARMUP:
                stalls.append(stall)
                latencies.append(latency)
    finally:
        workers.stop()
        pub.close()
    return stalls, latencies


def run_sync(model: nn.Module, args: argparse.Namespace) -> list[float]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    workers = Workers("sync", f"tcp://127.0.0.1:{port}", args.subscribers)
    idents = [sock.recv_multipart()[0] for _ in range(args.subscribers)]
    stalls = []
    try:
        for version in range(1, WARMUP + args.versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            started = time.time()
            payload = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.uint8).numpy()
            for ident in idents:
                sock.send_multipart([ident, str(version).encode(), cast(Any, payload)], copy=False)
            for _ in idents:
                sock.recv_multipart()
            if version > WARMUP:
                stalls.append(time.time() - started)
            workers.wait_all(version, 600)
    finally:
        workers.stop()
        sock.close(0)
        ctx.term()
    return stalls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size, GiB of float32 parameters")
    parser.add_argument("--subscribers", type=int, default=4)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="64 MiB model, 3 versions")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.versions = 1 / 16, 3
    try:
        os.nice(10)
    except OSError:
        pass
    torch.set_num_threads(1)
    os.environ.setdefault(ENV_JOB_KEY, JobKey.new().hex)
    width = 4096
    layers = max(1, round(args.gib * (1 << 30) / (width * width * 4)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    say(f"model: {nbytes / (1 << 30):.3f} GiB, {args.subscribers} subscriber processes, {args.versions} versions")
    stalls, latencies = run_rollout(model, args)
    sync_stalls = run_sync(model, args)
    stall, latency, sync = statistics.median(stalls), statistics.median(latencies), statistics.median(sync_stalls)
    say(f"{'':36}{'stall s':>10}{'latency s':>12}")
    say(f"{'synchronous push (baseline)':36}{sync:>10.3f}{sync:>12.3f}")
    say(f"{'torchpass.rollout':36}{stall:>10.3f}{latency:>12.3f}")
    say(f"stall vs synchronous push: {stall / sync:.4f}; latency vs synchronous push: {latency / sync:.3f}")
    result: dict[str, Any] = {
        "model_bytes": nbytes,
        "subscribers": args.subscribers,
        "rollout_stall_s": round(stall, 4),
        "rollout_latency_s": round(latency, 4),
        "rollout_stalls_s": [round(v, 4) for v in stalls],
        "rollout_latencies_s": [round(v, 4) for v in latencies],
        "sync_push_s": round(sync, 4),
        "stall_vs_sync": round(stall / sync, 5),
        "latency_vs_sync": round(latency / sync, 4),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
