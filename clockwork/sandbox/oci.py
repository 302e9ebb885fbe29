"""Slurm's native OCI containers on the sandbox: oci.conf with crun, and an OCI bundle that runs TorchPass.

A Slurm 24.11 sandbox (its root carries Debian's crun, :data:`clockwork.sandbox.slurm_release.ROOT_PACKAGES`) gets an
``oci.conf`` beside slurm.conf, so ``srun --container=BUNDLE`` runs a step's tasks in that bundle: slurmstepd copies
the bundle's ``config.json`` into its spool, replaces the process's arguments and environment with the step's, and
runs ``RunTimeRun`` (crun's ``run``, Slurm's recommended form) as the job's user. The host Slurm 22.05 sandbox gets
none: the host has no crun.

crun runs as Slurm's documentation has it, with two changes for the sandbox: its state goes under the sandbox's
state folder, one folder per node (``%n``: the nodes share one filesystem), and it makes no cgroups
(``--cgroup-manager=disabled``). A node's mount namespace has a fresh /sys with, at /sys/fs/cgroup, only a tmpfs and
the sandbox's own named cgroup v1 hierarchy (clockwork/sandbox/prefixes.py): no controller to put a container in,
and a container's cgroup left behind by a node crash would litter that hierarchy. (The host's own view would not
do: its cgroups are hybrid, with the hugetlb controller on the cgroup v2 mount, and crun refuses that outright:
"cgroups in hybrid mode not supported, drop all controllers from cgroupv2". The nodes never see it.)

:func:`write_bundle` makes a bundle for the tests: a read-only rootfs that is empty but for a marker file
(``/clockwork-image``, how a test tells a process inside from one outside) and the usrmerge links, and bind mounts
of what TorchPass needs from the host: /usr, /etc, the Python installation and the venv, the checkout (the
"image's" TorchPass), and read-write the folders a job writes (its output) and the Clockwork daemon's run folder and
configuration. The container shares the node's network and PID namespaces (only a mount namespace of its own), as
Slurm's steps and TorchPass's mesh need.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CRUN", "IMAGE_MARKER", "Bind", "oci_conf", "python_binds", "write_bundle"]

#: The OCI runtime's name on PATH in the Slurm root's view (/usr/bin/crun of Debian's crun package).
CRUN = "crun"
#: The file at the root of a sandbox bundle's rootfs: present in a container's view, absent on the host.
IMAGE_MARKER = "clockwork-image"
#: The container's id in Slurm's patterns: node, user, job, step, task (Slurm's documented example).
CONTAINER_ID = "%n.%u.%j.%s.%t"
#: Where slurmstepd mounts the step's spool folder in the container (oci.conf's MountSpoolDir, by default).
SLURM_SPOOL_MOUNT = "/var/run/slurm"
#: A container process's capabilities (a common runtime default's core): the job's user (root on the sandbox)
#: keeps ordinary file and signal rights, and nothing that reaches beyond the container.
CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID")


def oci_conf(state_root: Path, crun: str = CRUN) -> str:
    """oci.conf for crun's ``run`` (Slurm's recommended form); ``state_root``: crun's state, one folder per node
    (``%n``: the sandbox's nodes share one filesystem)."""
    crun = f"{crun} --cgroup-manager=disabled --root={state_root}/%n"
    return "\n".join(
        [
            "# Written by `clockwork sandbox up`: Slurm's native OCI containers (srun --container=BUNDLE), run by",
            "# Debian's crun from the Slurm 24.11 root, making no cgroups (clockwork/sandbox/oci.py says why).",
            f'RunTimeQuery="{crun} state {CONTAINER_ID}"',
            f'RunTimeKill="{crun} kill -a {CONTAINER_ID}"',
            f'RunTimeDelete="{crun} delete --force {CONTAINER_ID}"',
            f'RunTimeRun="{crun} run --bundle %b {CONTAINER_ID}"',
            "",
        ]
    )


@dataclass(frozen=True)
class Bind:
    """A host folder (or file) bind-mounted into the container at the same path."""

    path: str
    writable: bool = False


def python_binds(checkout: Path) -> list[Bind]:
    """What this Python needs: its installation (``sys.base_prefix``), the venv (``sys.prefix``) and the checkout
    that holds TorchPass and Clockwork, all read-only: the bundle's "image" of TorchPass."""
    paths = {sys.base_prefix, sys.prefix, str(checkout)}
    return [Bind(p) for p in sorted(paths) if not p.startswith("/usr/")]


def _mount(bind: Bind) -> dict[str, object]:
    return {
        "destination": bind.path,
        "type": "bind",
        "source": bind.path,
        "options": ["rbind", "rw" if bind.writable else "ro"],
    }


def write_bundle(bundle: Path, binds: Iterable[Bind], env: Mapping[str, str] | None = None) -> Path:
    """Write an OCI bundle at ``bundle`` (``config.json`` and ``rootfs/``) whose processes see the host's /usr and
    /etc (read-only), ``binds`` at their own paths, a private /tmp, and the marker file; returns ``bundle``.

    Slurm replaces ``process.args`` and adds the step's environment to ``process.env``; the rest is the bundle's.
    """
    rootfs = bundle / "rootfs"
    rootfs.mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):  # usrmerged, as the host
        target = rootfs / link
        if not target.is_symlink():
            target.symlink_to(f"usr/{link}")
    (rootfs / IMAGE_MARKER).write_text(f"OCI bundle {bundle}\n")
    mounts: list[dict[str, object]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind", "rw"]},
        {"destination": "/sys", "type": "bind", "source": "/sys", "options": ["rbind", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
        _mount(Bind("/usr")),
        _mount(Bind("/etc")),
        *(_mount(b) for b in binds),
    ]
    # Mount points exist in the read-only rootfs, Slurm's own included: it mounts the step's spool folder at
    # /var/run/slurm (oci.conf's MountSpoolDir default).
    for destination in [*(str(m["destination"]) for m in mounts), SLURM_SPOOL_MOUNT]:
        (rootfs / destination.lstrip("/")).mkdir(parents=True, exist_ok=True)
    config = {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/true"],
            "env": [f"{k}={v}" for k, v in {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})}.items()],
            "cwd": "/",
            "capabilities": {kind: list(CAPABILITIES) for kind in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": True},
        "mounts": mounts,
        "linux": {"namespaces": [{"type": "mount"}]},
    }
    (bundle / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return bundle
