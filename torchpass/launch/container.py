"""The job's container, passed on to every step TorchPass starts: node agents and borrowed nodes' guests.

A TorchPass job's ranks are children of its node agents, and the agents are job steps the launcher starts
(``srun --nodes=1 --ntasks=1 ... python -m torchpass``, :mod:`torchpass.launch.node_steps`), as are the guests on
borrowed nodes (:mod:`torchpass.launch.borrow`). Slurm applies a container to the steps whose ``srun`` asks for
one, so the launcher must ask for the job's container on each of those ``srun`` command lines, or training runs
on the node's own Python instead of in the user's image. Two ways sites run containers:

* **Slurm's native OCI containers** (``oci.conf``, a runtime such as crun): the container is an OCI bundle on the
  nodes. Taken from ``torchpass run --container BUNDLE``, else from ``SLURM_CONTAINER`` (what
  ``sbatch --container=BUNDLE`` sets in the job). Every step gets ``--container=BUNDLE``. Slurm's ``srun`` has no
  mount option: the bundle's ``config.json`` must bind-mount the node daemon's run folder and Clockwork's
  configuration (docs/user-guide.md says how; ``clockwork.sandbox.oci`` writes such a bundle for the sandbox).
* **pyxis/enroot** (a SPANK plugin): the job's ``--container-*`` options, which Slurm hands to the batch script as
  ``SLURM_SPANK__SLURM_SPANK_OPTION_pyxis_<option>`` (and pyxis's own ``PYXIS_CONTAINER_IMAGE``/``_MOUNTS``
  defaults), are put on every step's command line, ``--container-mounts`` with the daemon's run folder and the
  configuration added. Those variables are then taken out of the step's environment, so that ``srun`` sees each
  option once (pyxis refuses ``--container-image`` given twice with two values).

The launcher hands the decision to its agents in ``TORCHPASS_CONTAINER`` (JSON), so that a guest started later, from
inside the container, asks for the same one. This module imports no torch and starts nothing.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from clockwork.contracts.job_options import JobOptions, JobOptionsError
from torchpass.launch.slurm_layout import SlurmLayoutError

__all__ = [
    "ENV_CONTAINER",
    "PYXIS_FLAGS",
    "PYXIS_VALUED",
    "ContainerKind",
    "ContainerSpec",
    "clockwork_mounts",
    "container_from_environ",
    "node_mounts",
    "pyxis_env_name",
]

ENV_CONTAINER = "TORCHPASS_CONTAINER"  # the job's container as the launcher decided it (JSON), for the agents
#: pyxis's options that take a value, in the order they are passed on.
PYXIS_VALUED = (
    "container-image",
    "container-mounts",
    "container-workdir",
    "container-name",
    "container-save",
    "container-env",
    "container-unshare",
)
#: pyxis's flags (no value).
PYXIS_FLAGS = (
    "container-mount-home",
    "no-container-mount-home",
    "container-remap-root",
    "no-container-remap-root",
    "container-entrypoint",
    "no-container-entrypoint",
    "container-entrypoint-log",
    "container-writable",
    "container-readonly",
)
_SPANK_PREFIX = "SLURM_SPANK__SLURM_SPANK_OPTION_pyxis_"  # what sbatch/salloc put in the job's environment
_PYXIS_ENV = {"container-image": "PYXIS_CONTAINER_IMAGE", "container-mounts": "PYXIS_CONTAINER_MOUNTS"}


class ContainerKind(enum.Enum):
    """Which container the job's steps run in."""

    NONE = "none"
    OCI = "oci"  # Slurm's native OCI containers (srun --container=BUNDLE)
    PYXIS = "pyxis"  # pyxis/enroot (srun --container-image=...)


def pyxis_env_name(option: str) -> str:
    """The job environment variable Slurm gives a pyxis option set on sbatch (``-`` becomes ``_``)."""
    return _SPANK_PREFIX + option.replace("-", "_")


@dataclass(frozen=True)
class ContainerSpec:
    """The job's container: an OCI bundle, or pyxis options (option -> value; '' for a flag)."""

    kind: ContainerKind = ContainerKind.NONE
    bundle: str = ""
    pyxis: tuple[tuple[str, str], ...] = ()

    def srun_args(self, mounts: Sequence[str] = ()) -> list[str]:
        """The options that put a step in this container (none when the job has no container); ``mounts``:
        Clockwork's own (:func:`node_mounts`), added to pyxis's ``--container-mounts`` (an OCI bundle carries
        its mounts in its config.json)."""
        if self.kind is ContainerKind.OCI:
            return [f"--container={self.bundle}"]
        if self.kind is not ContainerKind.PYXIS:
            return []
        out = []
        options = dict(self.pyxis)
        joined = [m for m in options.get("container-mounts", "").split(",") if m]
        joined += [m for m in mounts if m not in joined]
        if joined:
            options["container-mounts"] = ",".join(joined)
        for name in PYXIS_VALUED:
            if name in options:
                out.append(f"--{name}={options[name]}")
        out += [f"--{name}" for name in PYXIS_FLAGS if name in options]
        return out

    def step_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """A step's environment: ``environ`` without the variables this spec's options replace, plus the spec
        (``TORCHPASS_CONTAINER``) for the agent, which passes it on to its guests."""
        env = dict(environ)
        if self.kind is ContainerKind.NONE:
            return env
        if self.kind is ContainerKind.PYXIS:
            for name in [*PYXIS_VALUED, *PYXIS_FLAGS]:
                env.pop(pyxis_env_name(name), None)
                env.pop("_SLURM_SPANK_OPTION_pyxis_" + name.replace("-", "_"), None)
            for name in _PYXIS_ENV.values():
                env.pop(name, None)
        env[ENV_CONTAINER] = self.to_json()
        return env

    def describe(self) -> str:
        """One line for the launcher's log."""
        if self.kind is ContainerKind.NONE:
            return "no container (the steps run on the nodes' own Python)"
        return f"{self.kind.value} container: srun {' '.join(self.srun_args())}"

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind.value, "bundle": self.bundle, "pyxis": dict(self.pyxis)})

    @classmethod
    def from_json(cls, text: str) -> ContainerSpec:
        """The launcher's decision as an agent reads it (a malformed value is an error, never ignored)."""
        try:
            obj = json.loads(text)
            kind = ContainerKind(obj["kind"])
            pyxis = tuple((str(k), str(v)) for k, v in dict(obj.get("pyxis", {})).items())
            return cls(kind, str(obj.get("bundle", "")), pyxis)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SlurmLayoutError(f"{ENV_CONTAINER}={text!r} is not a container TorchPass wrote: {exc}") from None


def clockwork_mounts(environ: Mapping[str, str], run_dir: str | None) -> tuple[str, ...]:
    """What a pyxis container needs of Clockwork: the node daemon's run folder (its control socket; ``run_dir``,
    ``{node}`` already expanded; None: the job does not use the daemon), and Clockwork's configuration
    (``$CLOCKWORK_CONFIG``, else /etc/clockwork), read-only. Paths are the same inside and out."""
    if run_dir is None:
        return ()
    config = environ.get("CLOCKWORK_CONFIG", "")
    source = config if config else "/etc/clockwork"
    return (f"{run_dir}:{run_dir}", f"{source}:{source}:ro")


def container_from_environ(
    environ: Mapping[str, str],
    *,
    bundle: str | None = None,
) -> ContainerSpec:
    """The job's container: ``bundle`` (``torchpass run --container``) or ``SLURM_CONTAINER`` (``sbatch
    --container``) for OCI; else the job's pyxis options; else none. ``TORCHPASS_CONTAINER`` (an agent: what its
    launcher decided) wins over both. Asking for both kinds at once is an error."""
    decided = environ.get(ENV_CONTAINER, "")
    if decided:
        return ContainerSpec.from_json(decided)
    oci = bundle or environ.get("SLURM_CONTAINER", "")
    pyxis: dict[str, str] = {}
    for name in [*PYXIS_VALUED, *PYXIS_FLAGS]:
        value = environ.get(pyxis_env_name(name))
        if value is not None:
            pyxis[name] = "" if name in PYXIS_FLAGS else value
    for name, variable in _PYXIS_ENV.items():
        if name not in pyxis and environ.get(variable):
            pyxis[name] = environ[variable]
    if oci and "container-image" in pyxis:
        raise SlurmLayoutError(
            f"the job asks for an OCI bundle ({oci}) and a pyxis image ({pyxis['container-image']}): choose one"
        )
    if oci:
        if not Path(oci).is_absolute():
            raise SlurmLayoutError(f"--container {oci!r}: give the bundle's absolute path (every node reads it)")
        return ContainerSpec(ContainerKind.OCI, oci)
    if "container-image" in pyxis or "container-name" in pyxis:
        return ContainerSpec(ContainerKind.PYXIS, pyxis=tuple(pyxis.items()))
    return ContainerSpec()


def bundle_warnings(bundle: str, mounts: Sequence[str]) -> list[str]:
    """What an OCI bundle lacks that the agents need: a readable ``config.json`` (an error: Slurm would refuse
    the step), and bind mounts of Clockwork's paths (``mounts``, pyxis's ``SRC:DST[:FLAGS]`` spelling, from
    :func:`node_mounts`): one warning each, since an agent without them runs on without its node daemon."""
    path = Path(bundle) / "config.json"
    try:
        config = json.loads(path.read_text())
        destinations = [str(m.get("destination", "")) for m in config.get("mounts", []) if isinstance(m, dict)]
    except (OSError, ValueError, AttributeError) as exc:
        raise SlurmLayoutError(f"--container {bundle}: cannot read the bundle's {path}: {exc}") from None
    out = []
    for mount in mounts:
        needed = mount.split(":")[1]
        if not any(needed == d or needed.startswith(d.rstrip("/") + "/") for d in destinations if d):
            out.append(f"the bundle {bundle} mounts nothing at {needed}: the agents there cannot reach Clockwork")
    return out


def node_mounts(environ: Mapping[str, str], node: str) -> tuple[str, ...]:
    """Clockwork's mounts for a step on ``node`` (:func:`clockwork_mounts`), none when the job is no Clockwork
    job (``CLOCKWORK_CONFIG`` unset and no ``--clockwork-ft``: its agents do not use the daemon either) or its
    configuration cannot be read (the agent then warns on its own that it cannot reach the daemon)."""
    try:
        clockwork_job = bool(environ.get("CLOCKWORK_CONFIG")) or JobOptions.from_environ(environ).enabled
    except JobOptionsError:
        clockwork_job = False
    if not clockwork_job:
        return ()
    try:
        from clockwork.contracts.config import load_config  # lazy: only a launcher with a container reads it
        from clockwork.contracts.daemon_paths import expand

        path = environ.get("CLOCKWORK_CONFIG", "")
        cfg = load_config(Path(path) if path else None).config.daemon
    except Exception:
        return ()
    return clockwork_mounts(environ, str(expand(cfg.run_dir, node)))
