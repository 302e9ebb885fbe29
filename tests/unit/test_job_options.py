"""--clockwork-ft and --clockwork-spares as the SPANK plugin exports them, parsed once
(clockwork.contracts.job_options)."""

from __future__ import annotations

import pytest

from clockwork.contracts.job_options import FtMode, JobOptions, JobOptionsError, SpareMode
from slurm_hooks.context import from_env
from slurm_hooks.runner import wants_clockwork


@pytest.mark.parametrize(
    ("env", "ft", "spares"),
    [
        ({}, FtMode.OFF, None),
        ({"CLOCKWORK_FT": "aware"}, FtMode.AWARE, None),
        ({"CLOCKWORK_FT": "off", "CLOCKWORK_SPARES": "standby"}, FtMode.OFF, SpareMode.STANDBY),
        ({"SLURM_SPANK_CLOCKWORK_FT": "transparent"}, FtMode.TRANSPARENT, None),  # srun --export=NONE
        ({"SPANK_CLOCKWORK_FT": "aware", "SPANK_CLOCKWORK_SPARES": "borrow"}, FtMode.AWARE, SpareMode.BORROW),
        ({"CLOCKWORK_FT": " ", "SPANK_CLOCKWORK_FT": "aware"}, FtMode.AWARE, None),  # blank counts as unset
        ({"CLOCKWORK_FT": "Transparent"}, FtMode.TRANSPARENT, None),
        ({"CLOCKWORK_FT": "off", "SLURM_SPANK_CLOCKWORK_FT": "aware"}, FtMode.OFF, None),  # first spelling wins
    ],
)
def test_every_spelling_reads_the_same(env: dict[str, str], ft: FtMode, spares: SpareMode | None) -> None:
    options = JobOptions.from_environ(env)
    assert (options.ft, options.spares) == (ft, spares)
    assert options.enabled is (ft is not FtMode.OFF)


@pytest.mark.parametrize(("name", "value"), [("FT", "maybe"), ("SPARES", "two"), ("FT", "on")])
def test_a_value_the_plugin_refuses_is_an_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(JobOptionsError, match=f"CLOCKWORK_{name}='{value}': expected one of"):
        JobOptions.from_environ({f"CLOCKWORK_{name}": value})


def _hook_env(**spank: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node1", **{f"SPANK_CLOCKWORK_{k}": v for k, v in spank.items()}}


def test_hooks_and_torchpass_agree_that_off_is_off() -> None:
    ctx = from_env("prolog_slurmd", _hook_env(FT="off", SPARES="standby"))
    assert not wants_clockwork(ctx) and ctx.job.spares is SpareMode.STANDBY
    assert ctx.options == {"ft": "off", "spares": "standby"}  # reported as exported
    assert wants_clockwork(from_env("prolog_slurmd", _hook_env(FT="transparent")))


def test_a_hook_never_fails_on_a_tampered_option() -> None:
    """The plugin validates; a value it would refuse makes the hook treat the job as a plain one (no drain)."""
    ctx = from_env("prolog_slurmd", _hook_env(FT="maybe"))
    assert ctx.job == JobOptions() and not wants_clockwork(ctx)
