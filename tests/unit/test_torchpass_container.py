"""The job's container on every step TorchPass starts (torchpass.launch.container): the agent steps and the guests.

pyxis is tested here only by the ``srun`` command lines and environments TorchPass builds, from the variables Slurm
gives a job submitted with pyxis's options (``SLURM_SPANK__SLURM_SPANK_OPTION_pyxis_*``, as read in Slurm 24.11's
spank.c and sbatch.c) and pyxis's own ``PYXIS_CONTAINER_*`` defaults: enroot is not packaged in Debian, so no real
pyxis runs anywhere in this project's tests. Slurm's native OCI containers run for real on the sandbox
(tests/integration/test_oci_container_sandbox.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpass.launch.borrow import guest_command
from torchpass.launch.container import (
    ENV_CONTAINER,
    ContainerKind,
    ContainerSpec,
    bundle_warnings,
    container_from_environ,
    node_mounts,
    pyxis_env_name,
)
from torchpass.launch.node_steps import NodeSteps
from torchpass.launch.slurm_layout import SlurmLayoutError

JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1", "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}


def _clockwork(tmp_path: Path) -> dict[str, str]:
    """A Clockwork job: its configuration names the daemon's run folder per node."""
    toml = tmp_path / "clockwork.toml"
    toml.write_text(f'[daemon]\nrun_dir = "{tmp_path}/nodes/{{node}}/run"\n')
    return {"CLOCKWORK_CONFIG": str(toml), "CLOCKWORK_FT": "aware"}


def test_the_pyxis_options_of_sbatch_reach_every_agent_step_with_clockworks_mounts(tmp_path: Path) -> None:
    env = {
        **JOB,
        **_clockwork(tmp_path),
        pyxis_env_name("container-image"): "nvcr.io#nvidia/pytorch:24.05-py3",
        pyxis_env_name("container-mounts"): "/data:/data:ro",
        pyxis_env_name("container-workdir"): "/work",
        pyxis_env_name("container-name"): "train",
        pyxis_env_name("container-env"): "NCCL_DEBUG",
        pyxis_env_name("container-remap-root"): "(null)",  # a flag: Slurm sets no value
        "PYXIS_CONTAINER_WRITABLE": "1",  # pyxis reads its own defaults itself: left alone
    }
    spec = container_from_environ(env)
    assert spec.kind is ContainerKind.PYXIS
    plan = NodeSteps(["run", "train.py"], srun="srun", python="/opt/venv/bin/python", environ=env, container=spec)
    node, cmd, step_env = plan.commands()[0]
    assert node == "n2"
    run_dir = f"{tmp_path}/nodes/n2/run"
    container = [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts=/data:/data:ro,{run_dir}:{run_dir},{env['CLOCKWORK_CONFIG']}:{env['CLOCKWORK_CONFIG']}:ro",
        "--container-workdir=/work",
        "--container-name=train",
        "--container-env=NCCL_DEBUG",
        "--container-remap-root",
    ]
    start = cmd.index("--job-name=torchpass-agent")
    assert cmd[start - len(container) : start] == container
    assert cmd[start + 1 :] == ["/opt/venv/bin/python", "-m", "torchpass", "run", "train.py"]
    # Each option once: the job's variables that srun would read as options are gone from the step's environment.
    assert not [k for k in step_env if "SPANK_OPTION_pyxis" in k]
    assert step_env["PYXIS_CONTAINER_WRITABLE"] == "1"
    # The agent reads the launcher's decision and gives a guest the same container (its mounts for its node).
    agent_spec = container_from_environ({**step_env, pyxis_env_name("container-image"): "other:1"})
    assert agent_spec == spec
    guest = guest_command("srun", "py", 90, "n9", "train.py", [], agent_spec.srun_args(node_mounts(env, "n9")))
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in guest
    assert f"--container-mounts=/data:/data:ro,{tmp_path}/nodes/n9/run:{tmp_path}/nodes/n9/run," in " ".join(guest)
    assert guest.index("--container-name=train") < guest.index("--job-name=torchpass-guest") < guest.index("py")


def test_pyxis_defaults_from_the_environment_and_no_mounts_for_a_job_without_clockwork() -> None:
    env = {**JOB, "PYXIS_CONTAINER_IMAGE": "ubuntu:24.04", "PYXIS_CONTAINER_MOUNTS": "/scratch:/scratch"}
    spec = container_from_environ(env)
    _, cmd, step_env = NodeSteps(["run", "t.py"], environ=env, container=spec).commands()[1]
    assert "--container-image=ubuntu:24.04" in cmd and "--container-mounts=/scratch:/scratch" in cmd
    assert "PYXIS_CONTAINER_IMAGE" not in step_env and "PYXIS_CONTAINER_MOUNTS" not in step_env
    assert json.loads(step_env[ENV_CONTAINER])["kind"] == "pyxis"


def test_oci_bundle_from_sbatch_or_the_launcher_option(tmp_path: Path) -> None:
    env = {**JOB, **_clockwork(tmp_path), "SLURM_CONTAINER": "/bundles/job"}
    assert container_from_environ(env).srun_args() == ["--container=/bundles/job"]
    assert container_from_environ(env, bundle="/bundles/mine").srun_args() == ["--container=/bundles/mine"]
    spec = container_from_environ(env)
    _, cmd, step_env = NodeSteps(["run", "t.py"], srun="srun", python="py", environ=env, container=spec).commands()[0]
    assert cmd[cmd.index("--job-name=torchpass-agent") - 1] == "--container=/bundles/job"  # mounts: in the bundle
    assert ContainerSpec.from_json(step_env[ENV_CONTAINER]) == spec
    with pytest.raises(SlurmLayoutError, match="absolute path"):
        container_from_environ(JOB, bundle="bundle")
    with pytest.raises(SlurmLayoutError, match="choose one"):
        container_from_environ({"SLURM_CONTAINER": "/b", pyxis_env_name("container-image"): "x"})
    with pytest.raises(SlurmLayoutError, match="is not a container TorchPass wrote"):
        container_from_environ({ENV_CONTAINER: '{"kind": "docker"}'})


def test_an_oci_bundle_without_clockworks_mounts_is_named_at_launch(tmp_path: Path) -> None:
    env = _clockwork(tmp_path)
    mounts = node_mounts(env, "n1")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with pytest.raises(SlurmLayoutError, match="cannot read the bundle's"):
        bundle_warnings(str(bundle), mounts)
    (bundle / "config.json").write_text(json.dumps({"mounts": [{"destination": f"{tmp_path}/nodes"}]}))
    assert bundle_warnings(str(bundle), mounts) == [
        f"the bundle {bundle} mounts nothing at {env['CLOCKWORK_CONFIG']}: the agents there cannot reach Clockwork"
    ]
    (bundle / "config.json").write_text(json.dumps({"mounts": [{"destination": str(tmp_path)}]}))
    assert bundle_warnings(str(bundle), mounts) == []


def test_no_container_changes_nothing() -> None:
    spec = container_from_environ(JOB)
    assert spec.kind is ContainerKind.NONE and spec.srun_args() == []
    _, cmd, step_env = NodeSteps(["run", "t.py"], srun="srun", python="py", environ=JOB, container=spec).commands()[0]
    assert not [a for a in cmd if a.startswith("--container")] and ENV_CONTAINER not in step_env
    assert guest_command("srun", "py", 1, "n3", "t.py", []) == guest_command("srun", "py", 1, "n3", "t.py", [], [])
