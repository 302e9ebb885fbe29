"""What a training rank loads of Clockwork: ``torchpass`` and ``clockwork.contracts``, never the node daemon, the CLI,
the sandbox, the audit or the hooks (docs/architecture.md, "Packages"), nor a package of the ``node`` extra.

A fresh interpreter imports what a rank imports (``import torchpass``, the model-aware context, the transparent
mode's bootstrap and session, the event sink's daemon client, the snapshot writer's messages) and reports its
``sys.modules``. The static rules (test_code_rules.py) say the same of the source; this is the process itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

RANK = """
import json, sys
import torchpass
from torchpass.rank.context import Context
from torchpass.rank.start import init
from torchpass.transparent.bootstrap import main
from torchpass.transparent.session import Session
from torchpass.events import DaemonEventSink
import clockwork.contracts.daemon_client  # what DaemonEventSink loads when it posts
print(json.dumps(sorted(sys.modules)))
"""

FORBIDDEN = ("clockworkd", "clockwork.cli", "clockwork.sandbox", "clockwork.audit", "slurm_hooks", "linkpass")
#: The ``node`` extra's packages (pyproject.toml): a training environment does not install them. (nvidia-ml-py's
#: pynvml is left out: torch.cuda imports it by itself wherever it is installed.)
NODE_EXTRA = ("pyroute2", "prometheus_client", "rich", "matplotlib")


def _rank_modules() -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120, env=env, check=True)
    return list(json.loads(out.stdout.splitlines()[-1]))


def test_a_rank_loads_no_daemon_cli_sandbox_or_audit_module() -> None:
    modules = _rank_modules()
    assert "torch" in modules and "torchpass.rank.context" in modules  # it did import what a rank imports
    loaded = [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not loaded, f"a rank loaded {loaded}"
    extra = [m for m in modules if m.split(".")[0] in NODE_EXTRA]
    assert not extra, f"a rank loaded the node extra's {sorted({m.split('.')[0] for m in extra})}"
    clockwork = [m for m in modules if m == "clockwork" or m.startswith("clockwork.")]
    print("clockwork modules in a rank:", ", ".join(clockwork))
    assert all(m in ("clockwork", "clockwork.contracts") or m.startswith("clockwork.contracts.") for m in clockwork)
    # Of the configuration only the daemon's own section (the event sink's client) and the [snapshots] size parser
    # (a rank's snapshot_quota), not every component's section.
    config = {m for m in clockwork if m.startswith("clockwork.contracts.config.")}
    allowed = {"core", "fields", "snapshots"}
    assert config <= {f"clockwork.contracts.config.{name}" for name in allowed}, config
