"""Real-GPU check of the GPU health watch's NVML source (run by hand on a GPU machine; pytest does not collect it).

What it does, against the real driver:

1. opens the NVML source the daemon uses (:class:`clockworkd.gpuhealth.nvml.NvmlSource`) and reads every GPU
   once, printing every value and which fields the GPU/driver does not support;
2. waits 1 s on the XID event set (a real blocking wait), then keeps reading every 0.5 s for ``--seconds``
   (default 5), which drains the XID event set each time (the daemon's non-blocking path, against the real
   driver), and judges each reading with the default ``[health]`` policy, printing any signal it raises;
3. asserts the readings are sane: at least one GPU; none lost or unreadable; a UUID; temperature > 0 C and below
   the GPU's own slowdown threshold; the slowdown threshold read (and the shutdown threshold above it when
   read); ECC counters non-negative integers where reported; no exception from unsupported fields;
4. with ``--daemon`` (needs the full install, ``pip install -e .``): starts a real ``clockworkd`` with its own
   temporary folders and reads the same GPUs through ``clockwork node gpus --json``, checking the daemon reports
   the same GPUs (UUIDs) with temperatures within 15 C of the direct reading.

Needs only this repository and ``pip install nvidia-ml-py msgpack pyzmq`` for steps 1-3 (no torch)::

    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install nvidia-ml-py msgpack pyzmq
    /tmp/nv/bin/python tests/device/nvml_check.py            # from the repository root

The last line printed is one JSON object (gpus, reads, xid events, signals, failures); exit status 0 when every
check passed, 1 otherwise.
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

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "daemon"), str(REPO)]

from clockworkd.gpuhealth.nvml import NvmlSource  # noqa: E402  (after the path setup above)
from clockworkd.gpuhealth.readings import GpuReading  # noqa: E402


def _policy() -> Any:
    """The default policy, when its module's imports are available (it needs only the standard library)."""
    from clockwork.contracts.config.health import HealthConfig
    from clockworkd.gpuhealth.policy import Policy

    return Policy(HealthConfig())


def check_reading(r: GpuReading) -> list[str]:
    """Why reading ``r`` is not sane (empty: sane)."""
    bad = []
    if r.lost or r.error:
        bad.append(f"gpu{r.index}: lost={r.lost} error={r.error!r}")
        return bad
    if not r.uuid.startswith(("GPU-", "MIG-")):
        bad.append(f"gpu{r.index}: UUID {r.uuid!r}")
    if r.slowdown_c is None or r.slowdown_c <= 0:
        bad.append(f"gpu{r.index}: slowdown threshold not read ({r.slowdown_c})")
    if r.temperature_c is None or r.temperature_c <= 0:
        bad.append(f"gpu{r.index}: temperature not read or not positive ({r.temperature_c})")
    elif r.slowdown_c and r.temperature_c >= r.slowdown_c:
        bad.append(f"gpu{r.index}: at {r.temperature_c} C, at or above its slowdown threshold {r.slowdown_c} C")
    if r.shutdown_c is not None and r.slowdown_c is not None and r.shutdown_c <= r.slowdown_c:
        bad.append(f"gpu{r.index}: shutdown threshold {r.shutdown_c} not above slowdown {r.slowdown_c}")
    for name in ("ecc_corrected", "ecc_uncorrected", "ecc_aggregate_uncorrected", "nvlink_errors"):
        value = getattr(r, name)
        if value is not None and (type(value) is not int or value < 0):
            bad.append(f"gpu{r.index}: {name} = {value!r}")
    return bad


def blocking_event_wait(source: NvmlSource) -> list[str]:
    """One real 1 s wait on the XID event set (the daemon only polls it): a timeout or an event, nothing else."""
    nv, events = source.nvml, getattr(source, "_events", None)
    if nv is None or events is None:
        return [] if nv is None else ["no XID event set was created"]
    began = time.monotonic()
    try:
        data = nv.nvmlEventSetWait_v2(events, 1000)
        print(f"event wait: XID {int(data.eventData)} (type {int(data.eventType):#x})")
    except nv.NVMLError as exc:
        if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
            return [f"event wait failed: {exc}"]
        print(f"event wait: timeout after {time.monotonic() - began:.2f} s (no XID: expected on a healthy GPU)")
    return []


def show(r: GpuReading) -> None:
    print(f"gpu{r.index} {r.name} {r.uuid}")
    for key, value in r.to_dict().items():
        if key not in ("index", "name", "uuid"):
            print(f"    {key:28s} {value}")


def through_the_daemon(readings: list[GpuReading]) -> list[str]:
    """Start clockworkd with temporary folders, read ``clockwork node gpus --json``; problems found."""
    root = Path(tempfile.mkdtemp(prefix="cwd-nvml-", dir="/tmp"))
    root.chmod(0o755)
    import pwd

    config = root / "clockwork.toml"
    config.write_text(
        f"""[daemon]
run_dir = "{root}/run"
state_dir = "{root}/state"
node_name = "gpunode"
slurm_user = "{pwd.getpwuid(os.getuid()).pw_name}"
listen_port = 0
bind_addr = "127.0.0.1"
curve_secret_key = "{root}/none/daemon.key_secret"
curve_public_key = "{root}/none/daemon.key"
[linkpass]
enabled = false
[lens]
enabled = false
[health]
interval_s = 0.5
"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "daemon"), str(REPO), env.get("PYTHONPATH", "")])
    daemon = subprocess.Popen(
        [sys.executable, "-c", "from clockworkd.agent import main; main()", "--config", str(config)],
        env=env,
        stdout=open(root / "daemon.log", "wb"),  # open for the daemon's whole life
        stderr=subprocess.STDOUT,
    )
    problems: list[str] = []
    try:
        reply: dict[str, Any] = {}
        cli = [sys.executable, "-c", "from clockwork.cli.main import main; main()"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            proc = subprocess.run(
                [*cli, "--config", str(config), "node", "gpus", "--json"],
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0:
                reply = json.loads(proc.stdout)
                if reply.get("gpus"):
                    break
            time.sleep(0.5)
        print("clockwork node gpus --json:")
        print(json.dumps(reply, indent=2, sort_keys=True)[:20000])
        shown = {g["uuid"]: g for g in reply.get("gpus", [])}
        for r in readings:
            gpu = shown.get(r.uuid)
            if gpu is None:
                problems.append(f"daemon: gpu{r.index} {r.uuid} missing from `clockwork node gpus`")
                continue
            temp = gpu["reading"].get("temperature_c")
            if temp is None or r.temperature_c is None or abs(temp - r.temperature_c) > 15:
                problems.append(f"daemon: gpu{r.index} temperature {temp} vs direct {r.temperature_c}")
    finally:
        daemon.terminate()
        daemon.wait(10)
        print(f"(daemon log: {root / 'daemon.log'})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="How long to keep reading (XID events).")
    parser.add_argument("--daemon", action="store_true", help="Also read through clockworkd + `clockwork node gpus`.")
    args = parser.parse_args()

    source = NvmlSource(os.uname().nodename)
    print(f"source: {source.describe()}")
    failures: list[str] = []
    first = source.read()
    if not first:
        failures.append(f"no GPUs read ({source.describe()})")
    for r in first:
        show(r)
        failures += check_reading(r)
    failures += blocking_event_wait(source)
    policy = _policy()
    signals: list[dict[str, Any]] = []
    for change in policy.evaluate(first, time.time()):
        signals.append(change.to_dict())
    reads, xids = 1, 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        readings = source.read()
        reads += 1
        if len(readings) != len(first):
            failures.append(f"read {reads}: {len(readings)} GPUs, first read had {len(first)}")
        for r in readings:
            xids += len(r.xids)
            if r.xids:
                print(f"gpu{r.index}: XID events {list(r.xids)}")
            failures += [f"read {reads}: {p}" for p in check_reading(r)]
        signals += [c.to_dict() for c in policy.evaluate(readings, time.time())]
    for s in signals:
        print(f"signal: gpu{s['gpu']} {s['signal']} {s['state']} value {s['value']} threshold {s['threshold']}")
    unsupported = sorted({f"gpu{r.index}: {f}" for r in first for f in r.unsupported})
    print("not supported here: " + (", ".join(unsupported) or "nothing"))
    if args.daemon and first:
        failures += through_the_daemon(first)
    source.close()
    for f in failures:
        print(f"FAIL: {f}")
    summary = {
        "gpus": len(first),
        "reads": reads,
        "xid_events": xids,
        "signals": len(signals),
        "unsupported": len(unsupported),
        "failures": len(failures),
        "ok": not failures,
    }
    print(json.dumps(summary, sort_keys=True))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
