"""Running the system tools the sandbox is built from (ip, nsenter, tc, nft, Slurm daemons).

One place decides how a failed command is reported: a SandboxError naming the command, its exit
status and what it printed, so a half-built cluster always says which step broke.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from clockwork.contracts.errors import SandboxError

log = logging.getLogger("clockwork.sandbox")

#: Programs the sandbox needs, and the Debian package that ships each one.
REQUIRED_PROGRAMS: dict[str, str] = {
    "ip": "iproute2",
    "bridge": "iproute2",
    "tc": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "nft": "nftables",
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
}
ACCOUNTING_PROGRAMS: dict[str, str] = {
    "slurmdbd": "slurmdbd",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "sacctmgr": "slurm-client",
}


#: What the host's own Slurm provides: not needed from the host when the release comes from a root.
HOST_SLURM_PROGRAMS = frozenset({"slurmctld", "slurmd", "sbatch", "slurmdbd", "sacctmgr"})


def missing_programs(accounting: bool, host_slurm: bool = True) -> list[str]:
    """``program (package)`` for every needed program that is not installed (``host_slurm``: Slurm's own
    programs too, else only what the host provides beside a root's Slurm: munged, MariaDB, the network tools)."""
    wanted = dict(REQUIRED_PROGRAMS)
    if accounting:
        wanted.update(ACCOUNTING_PROGRAMS)
    if not host_slurm:
        wanted = {prog: pkg for prog, pkg in wanted.items() if prog not in HOST_SLURM_PROGRAMS}
    search = "/usr/sbin:/usr/bin:/sbin:/bin"
    return [f"{prog} ({pkg})" for prog, pkg in wanted.items() if shutil.which(prog, path=search) is None]


def run(
    argv: Sequence[str],
    *,
    input: str | None = None,
    check: bool = True,
    timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``, capturing output; raise SandboxError on failure when ``check``."""
    log.debug("run %s", " ".join(argv))
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except FileNotFoundError:
        raise SandboxError(f"{argv[0]}: not installed (run `make venv` to install the system packages)") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        what = " ".join(argv) if input is None else f"{' '.join(argv)} <<{input.strip()[:400]!r}"
        raise SandboxError(f"{what}: exit {proc.returncode}: {detail}")
    return proc


def netns_path(ns: str) -> str:
    return f"/run/netns/{ns}"


def in_netns(ns: str) -> list[str]:
    """Prefix that runs a command in network namespace ``ns`` only (mounts and hostname untouched)."""
    return ["nsenter", f"--net={netns_path(ns)}"]
