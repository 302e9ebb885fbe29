"""How the sandbox starts a process "on" a node or on the controller: the namespaces and mounts it gets.

A node's processes (its slurmd, and through it the hooks and every job; ``sandbox exec``) and the controller's
(slurmctld, slurmdbd) each start in private UTS and mount namespaces set up by a short shell line before the
program is exec'd. A release from a root (Slurm 24.11) adds one mount there: the root's /usr laid over the host's
(:meth:`~clockwork.sandbox.slurm_release.SlurmRelease.overlay_command`), so that every program started inside,
down to a job's ``srun``, is that release's.
"""

from __future__ import annotations

from clockwork.sandbox.layout import CONTROLLER, NodeSpec
from clockwork.sandbox.paths import StatePaths
from clockwork.sandbox.shell import netns_path

__all__ = ["controller_prefix", "node_prefix"]


def _then(overlay: str) -> str:
    return f"{overlay} && " if overlay else ""


def node_prefix(paths: StatePaths, node: NodeSpec, cgroup_name: str, overlay: str = "") -> list[str]:
    """Argv prefix that runs a command "on" a sandbox node.

    Enters the node's network namespace, then new UTS and mount namespaces: hostname = node name,
    a fresh /sys for this namespace's devices, a private cgroup mount (slurmd needs a cgroup
    hierarchy it may touch; the host's stays untouched), the sandbox's /etc/hosts and, when ``overlay``
    is given, the Slurm release's /usr.
    """
    setup = (
        "mount -t sysfs sysfs /sys && "
        "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
        f"mount -t cgroup -o none,name={cgroup_name} cgroup /sys/fs/cgroup/systemd && "
        f'mount --bind {paths.hosts} /etc/hosts && {_then(overlay)}hostname {node.name} && exec "$@"'
    )
    return [
        "nsenter",
        f"--net={netns_path(node.netns)}",
        "unshare",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        setup,
        "sh",
    ]


def controller_prefix(paths: StatePaths, overlay: str = "") -> list[str]:
    """Argv prefix for slurmctld/slurmdbd: root network namespace, hostname ``ctl``, local name lookups (and the
    Slurm release's /usr when ``overlay`` is given)."""
    setup = f'mount --bind {paths.controller_hosts} /etc/hosts && {_then(overlay)}hostname {CONTROLLER} && exec "$@"'
    return ["unshare", "--uts", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", setup, "sh"]
