"""Which Slurm release a sandbox runs, and where its programs come from.

- ``22.05``: the host's own Slurm packages (Debian 12 ships 22.05.8), run as installed.
- ``24.11``: Debian 13 (trixie)'s Slurm 24.11, from a root built once with ``mmdebstrap`` under
  ``/var/cache/clockwork/slurm-24.11/root``. Its packages must never be installed on the host: they would
  replace its libc. Instead the sandbox lays the root's ``/usr`` over the host's ``/usr`` (overlayfs, read-only:
  the root's files win, the host's show through where the root has none) inside the private mount namespaces
  its Slurm daemons already run in, and in a fresh one for every Slurm command started from the host (the
  wrappers this module writes into the sandbox's ``bin`` folder). The host is usrmerged (``/bin``, ``/lib`` are
  links into ``/usr``), so that view runs the root's glibc, loader and Slurm throughout.

- ``26.05``: Debian sid's Slurm 26.05 (``slurm-wlm 26.05.x``), from a root built the same way under
  ``/var/cache/clockwork/slurm-26.05/root`` and laid over ``/usr`` the same way. sid moves: the root is whatever sid
  served when it was built (its ``MARKER`` file says which version), and a build fails with the version sid has
  when that is not 26.05.

Everything else stays the host's: the hooks, ``clockworkd`` and a job's Python are the host venv's interpreter
(Python 3.11 and torch, which the root does not have: they show through from the host's ``/usr`` and the
checkout) running on the root's glibc 2.41, which is backward compatible with the host's 2.36 they were built
for. munged and MariaDB are the host's (the root's libmunge and slurmdbd talk to them over their socket and
port). So a 24.11 sandbox runs Clockwork's own code exactly as a 22.05 one does, and only Slurm changes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clockwork.contracts.errors import SandboxError
from clockwork.sandbox.shell import run

__all__ = ["CACHE_DIR", "RELEASES", "SlurmRelease", "release"]

log = logging.getLogger("clockwork.sandbox")

#: Where built roots are kept (one folder per release); a root is built once per machine and reused.
CACHE_DIR = Path("/var/cache/clockwork")
#: The packages a root carries: the daemons, the clients, accounting (slurmdbd and its MySQL plugin, for the
#: host's MariaDB), the headers the SPANK plugin is built against, and crun, the OCI runtime of Slurm's native
#: containers (``srun --container``; the sandbox's oci.conf runs it).
ROOT_PACKAGES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "slurm-client",
    "slurm-wlm-mysql-plugin",
    "libslurm-dev",
    "crun",
)
#: What a root leaves out: documentation and translations (a third of its size, never read here).
ROOT_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
#: A file inside a finished root (``/usr/lib/clockwork-slurm-root`` in the laid-over view): the Slurm package
#: version it holds. It marks a root as complete, and tells a wrapper that it already runs in that view.
MARKER = Path("usr/lib/clockwork-slurm-root")
#: Beside the marker: the packages the root was built with, one a line. A root built before a package joined
#: ROOT_PACKAGES (crun) is not ready: it is built again, aside, and swapped in (see :meth:`SlurmRelease._build`).
PACKAGES = Path("usr/lib/clockwork-slurm-root.packages")


@dataclass(frozen=True)
class SlurmRelease:
    """One Slurm release series the sandbox can run."""

    version: str
    """Release series, ``"22.05"``."""
    suite: str
    """Debian suite whose root carries it; empty: the host's own packages."""
    accept_expired: bool = False
    """Accept the suite's Release file after its Valid-Until (apt's ``Acquire::Check-Valid-Until "false"``). sid's
    expires within a week of being published; the mirror this machine reaches serves one that expired a month
    ago, which apt otherwise refuses outright ("Release file ... is expired")."""

    @property
    def from_root(self) -> bool:
        return bool(self.suite)

    @property
    def slurmctld_parameters(self) -> tuple[str, ...]:
        """slurm.conf's ``SlurmctldParameters`` for this release: ``enable_expedited_requeue`` from 25.11, the
        first release that has it, so jobs may be submitted with ``sbatch --requeue=expedite`` (without it
        slurmctld refuses them). None before: 24.11's slurmctld ignores the word, but a sandbox's slurm.conf
        should say only what its release does (24.11's sbatch refuses ``--requeue=expedite`` either way)."""
        major, minor = (int(part) for part in self.version.split("."))
        return ("enable_expedited_requeue",) if (major, minor) >= (25, 11) else ()

    @property
    def cache(self) -> Path:
        return CACHE_DIR / f"slurm-{self.version}"

    @property
    def root(self) -> Path:
        """The built root (meaningful only ``from_root``)."""
        return self.cache / "root"

    def ready(self) -> bool:
        """Whether this release can run: always for the host's; for a root, once it is completely built with
        every package of ROOT_PACKAGES."""
        if not self.from_root:
            return True
        if not (self.root / MARKER).is_file():
            return False
        try:
            built_with = set((self.root / PACKAGES).read_text().split())
        except FileNotFoundError:
            return False
        return set(ROOT_PACKAGES) <= built_with

    def installed(self) -> str:
        """The Slurm package version the root holds, e.g. ``24.11.5-4+deb13u1`` (SandboxError if not built)."""
        try:
            return (self.root / MARKER).read_text().strip()
        except FileNotFoundError:
            raise SandboxError(self._missing()) from None

    def _missing(self) -> str:
        return (
            f"Slurm {self.version} for the sandbox is not built yet ({self.root} is missing or lacks one of "
            f"{', '.join(ROOT_PACKAGES)}); build it with "
            f"`clockwork sandbox prepare --slurm {self.version}` or `make slurm-{self.version}` (root, network, "
            "about a minute, once per machine)"
        )

    def require(self) -> None:
        if not self.ready():
            raise SandboxError(self._missing())

    # ----- the view the sandbox runs in ------------------------------------------------------------------
    def overlay_command(self) -> str:
        """Shell command that lays the root's /usr over /usr in the current (private) mount namespace; '' for
        the host's Slurm. overlayfs refuses layers inside each other: the cache must not lie under /usr."""
        if not self.from_root:
            return ""
        lower = f"{self.root / 'usr'}:/usr"
        return f"mount -t overlay clockwork-slurm-{self.version} -o ro,lowerdir={shlex.quote(lower)} /usr"

    def plugin_dir(self) -> Path | None:
        """The root's own plugin folder for slurm.conf's PluginDir (so no host 22.05 plugin, showing through in
        the laid-over view, is ever found); None for the host's Slurm (its compiled-in default)."""
        if not self.from_root:
            return None
        found = sorted((self.root / "usr" / "lib").glob("*/slurm-wlm/libslurmfull.so"))
        if not found:
            raise SandboxError(f"the Slurm {self.version} root at {self.root} has no slurm-wlm plugin folder")
        return found[0].parent

    def client_tools(self) -> list[str]:
        """The client commands of the root's slurm-client package (sbatch, srun, squeue, ...)."""
        listing = run(
            ["dpkg-query", f"--admindir={self.root / 'var/lib/dpkg'}", "-L", "slurm-client"], timeout=30
        ).stdout
        return sorted({Path(p).name for p in listing.split() if p.startswith("/usr/bin/")})

    def write_client_wrappers(self, bin_dir: Path) -> list[str]:
        """One wrapper per client command in ``bin_dir``: the root's command in a mount namespace of its own
        with the root laid over /usr, or directly where the caller already runs in that view (a hook, a job).
        Returns the commands wrapped."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        marker = Path("/") / MARKER
        tools = self.client_tools()
        for tool in tools:
            target = f"/usr/bin/{tool}"
            body = (
                "#!/bin/sh\n"
                f"# Slurm {self.version}'s {tool} from {self.root} (written by `clockwork sandbox up`).\n"
                f'[ -e {marker} ] && exec {target} "$@"\n'
                "exec unshare --mount --propagation private -- /bin/sh -c "
                + shlex.quote(f'{self.overlay_command()} && exec "$0" "$@"')
                + f' {target} "$@"\n'
            )
            wrapper = bin_dir / tool
            wrapper.write_text(body)
            wrapper.chmod(0o755)
        return tools

    # ----- building the root -----------------------------------------------------------------------------
    def ensure_root(self, progress: Callable[[str], None] | None = None) -> float:
        """Build the root unless it is there; returns the seconds spent building (0.0 when it was cached).

        Needs root and a Debian mirror (``mmdebstrap``'s default). Concurrent callers wait for one build (a lock
        file beside the root); a half-built root never counts: it is built aside and renamed when complete.
        """
        if not self.from_root or self.ready():
            return 0.0
        say = progress or (lambda msg: None)
        if os.geteuid() != 0:
            raise SandboxError(f"building Slurm {self.version}'s root needs root (you are uid {os.geteuid()})")
        if shutil.which("mmdebstrap") is None:
            raise SandboxError("mmdebstrap is not installed (make venv installs it: apt-get install mmdebstrap)")
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.cache / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.ready():
                return 0.0
            return self._build(say)

    def _build(self, say: Callable[[str], None]) -> float:
        """Build a root aside and rename it into place. A root that is there but incomplete (built before a
        package joined ROOT_PACKAGES) may be laid over /usr by a sandbox that is up: it is renamed aside
        (``root.old-PID``), not deleted, and removed by the next build."""
        started = time.monotonic()
        tmp = self.cache / f"root.building-{os.getpid()}"
        for old in [*self.cache.glob("root.building-*"), *self.cache.glob("root.old-*")]:
            shutil.rmtree(old, ignore_errors=True)
        say(f"building the Slurm {self.version} root (Debian {self.suite}, once per machine) at {self.root}")
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            "--include=" + ",".join(ROOT_PACKAGES),
            *(f"--dpkgopt=path-exclude={pattern}" for pattern in ROOT_EXCLUDES),
            *(['--aptopt=Acquire::Check-Valid-Until "false"'] if self.accept_expired else []),
            self.suite,
            str(tmp),
        ]
        try:
            run(argv, timeout=1800)
            version = run(
                ["dpkg-query", f"--admindir={tmp / 'var/lib/dpkg'}", "-W", "-f=${Version}", "slurmctld"], timeout=30
            ).stdout.strip()
            if not version.startswith(f"{self.version}."):
                raise SandboxError(f"Debian {self.suite} has Slurm {version!r}, not {self.version}: root unusable")
            (tmp / MARKER).write_text(version + "\n")
            (tmp / PACKAGES).write_text("\n".join(ROOT_PACKAGES) + "\n")
            if self.root.exists():
                self.root.rename(self.cache / f"root.old-{os.getpid()}")
            tmp.rename(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.monotonic() - started
        log.info("built the Slurm %s root (%s) in %.1f s", self.version, version, seconds)
        say(f"Slurm {version} root built in {seconds:.0f} s")
        return seconds


RELEASES: dict[str, SlurmRelease] = {
    "22.05": SlurmRelease("22.05", ""),
    "24.11": SlurmRelease("24.11", "trixie"),
    "26.05": SlurmRelease("26.05", "sid", accept_expired=True),
}


def release(version: str) -> SlurmRelease:
    """The release for ``[sandbox] slurm``."""
    try:
        return RELEASES[version]
    except KeyError:
        raise SandboxError(f"no sandbox Slurm release {version!r} (choose one of {', '.join(RELEASES)})") from None
