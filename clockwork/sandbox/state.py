"""The sandbox's record of itself (``sandbox.json``): its configuration, phase, pids and faults.

Written before anything is built and updated after each step, so ``down`` and ``status`` can always
tell what exists, even after a crash half-way through ``up``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clockwork.contracts import atomic_file
from clockwork.contracts.config.core import SandboxConfig


@dataclass
class SandboxState:
    """What one sandbox is and what runs in it."""

    config: SandboxConfig
    phase: str = "building"  # building | up | down
    created: float = field(default_factory=time.time)
    pids: dict[str, int] = field(default_factory=dict)
    #: Active faults, key "KIND NODE NIC" -> value (e.g. "loss node2 nic0" -> 5.0).
    faults: dict[str, Any] = field(default_factory=dict)
    python: str = ""
    #: Pid of the process running the bring-up: while it lives, a ``building`` sandbox is not abandoned.
    builder: int = 0

    def save(self, path: Path) -> None:
        data = dataclasses.asdict(self)
        atomic_file.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> SandboxState | None:
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        data["config"] = SandboxConfig(**data["config"])
        return cls(**data)
