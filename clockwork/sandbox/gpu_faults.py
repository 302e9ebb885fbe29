"""GPU faults on the sandbox: injected values in each node's GPU fault file, read by that node's daemon.

The sandbox's configuration selects the daemons' fault-file GPU source (``[health] source = "fault-file"``,
``fault_file`` = ``nodes/{node}/gpu-faults.json`` under the state folder), so ``clockwork sandbox fault gpu
node2 0 temp 95`` makes node2's daemon see its gpu0 at 95 C at its next reading. What can be injected:

* ``temp C``: the GPU's temperature (the emulated thresholds are slowdown 90 C, shutdown 100 C);
* ``ecc N``: the volatile uncorrected ECC error count;
* ``xid N``: one XID event (each injection is one more event);
* ``clear``: the GPU back to its healthy baseline.

The file is replaced atomically (a daemon never reads half of it), owned by root and not writable by others,
which is what the daemon requires of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clockwork.contracts import atomic_file
from clockwork.contracts.errors import ConfigError

GPU_FAULTS = ("temp", "ecc", "xid", "clear")
FILE_NAME = "gpu-faults.json"


def fault_file(nodes_dir: Path, node: str) -> Path:
    """The fault file of ``node`` (what the sandbox's ``[health] fault_file`` expands to)."""
    return nodes_dir / node / FILE_NAME


def parse(index: str, what: str, value: str | None, gpus: int) -> tuple[int, str, float | int | None]:
    """Check one request: (GPU index, what, value) or ConfigError naming the bad part."""
    if not index.isdigit() or int(index) >= gpus:
        raise ConfigError(f"fault gpu: invalid GPU index {index!r} (the sandbox's nodes have GPUs 0..{gpus - 1})")
    if what not in GPU_FAULTS:
        raise ConfigError(f"fault gpu: unknown fault {what!r} (expected one of {', '.join(GPU_FAULTS)})")
    if what == "clear":
        if value is not None:
            raise ConfigError("fault gpu NODE INDEX clear takes no value")
        return int(index), what, None
    if value is None:
        raise ConfigError(f"fault gpu {what} needs a VALUE, e.g. fault gpu node2 0 {what} {_example(what)}")
    if what == "temp":
        try:
            temp = float(value)
        except ValueError:
            temp = -1.0
        if not 0.0 <= temp <= 200.0:
            raise ConfigError(f"fault gpu temp: invalid value {value!r} (expected degrees C, 0..200)")
        return int(index), what, temp
    if not value.isdigit() or (what == "xid" and int(value) == 0):
        expected = "an error count >= 0" if what == "ecc" else "an XID number >= 1"
        raise ConfigError(f"fault gpu {what}: invalid value {value!r} (expected {expected})")
    return int(index), what, int(value)


def _example(what: str) -> str:
    return {"temp": "95", "ecc": "1", "xid": "79"}.get(what, "")


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {"gpus": {}}
    except ValueError:  # a broken file (written by hand): start again from the baseline
        return {"gpus": {}}
    return doc if isinstance(doc, dict) and isinstance(doc.get("gpus"), dict) else {"gpus": {}}


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_file.write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n", mode=0o644)


def apply(path: Path, index: int, what: str, value: float | int | None) -> dict[str, Any]:
    """Update ``path`` with one injected value; the GPU's injected fields afterwards ({} = healthy)."""
    doc = read(path)
    gpus: dict[str, Any] = doc["gpus"]
    gpu = dict(gpus.get(str(index)) or {})
    if what == "clear":
        gpu = {}
    elif what == "temp":
        gpu["temperature_c"] = value
    elif what == "ecc":
        gpu["ecc_uncorrected"] = value
    elif what == "xid":
        gpu["xids"] = [*(gpu.get("xids") or []), value]
    if gpu:
        gpus[str(index)] = gpu
    else:
        gpus.pop(str(index), None)
    write(path, {"gpus": gpus})
    return gpu


def summary(gpu: dict[str, Any]) -> str:
    """``temp=95,ecc=1,xid=79+48`` for the sandbox's list of active faults."""
    parts = []
    if "temperature_c" in gpu:
        parts.append(f"temp={gpu['temperature_c']:g}")
    if "ecc_uncorrected" in gpu:
        parts.append(f"ecc={gpu['ecc_uncorrected']}")
    if gpu.get("xids"):
        parts.append("xid=" + "+".join(str(x) for x in gpu["xids"]))
    return ",".join(parts)
