"""TorchPassConfig: one documented dataclass, unknown keys and wrong types rejected, faithful transport to ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass.config import ENV_CONFIG, ConfigError, TorchPassConfig


def test_every_field_is_documented_and_defaults_are_valid() -> None:
    cfg = TorchPassConfig()
    docs = TorchPassConfig.docs()
    assert set(docs) == set(TorchPassConfig.keys())
    assert all(len(doc) > 20 for doc in docs.values())
    assert cfg.collective_timeout_s < 1800  # never torch's 30-minute default


def test_unknown_keys_are_errors_everywhere(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key.*colective_timeout_s"):
        TorchPassConfig.from_mapping({"colective_timeout_s": 3})
    with pytest.raises(ConfigError, match="unknown key"):
        TorchPassConfig().with_overrides(nope=1)
    with pytest.raises(ConfigError, match="unknown key"):
        TorchPassConfig().with_assignment("nope=1")
    path = tmp_path / "tp.toml"
    path.write_text("[torchpass]\nseed = 3\ntypo = 1\n")
    with pytest.raises(ConfigError, match="typo"):
        TorchPassConfig.from_file(path)


def test_types_choices_and_bounds_are_checked() -> None:
    """The daemon's rule (clockwork.contracts.config.fields.coerce), with the same messages."""
    with pytest.raises(ConfigError, match=r"backend: invalid value 'mpi' \(expected one of gloo, nccl, auto\)"):
        TorchPassConfig(backend="mpi")
    with pytest.raises(ConfigError, match=r"seed: invalid value '1' \(expected an integer\)"):
        TorchPassConfig(seed="1")  # type: ignore[arg-type]  # a program's value is typed: no parsing of text
    with pytest.raises(ConfigError, match=r"seed: invalid value True \(expected an integer\)"):
        TorchPassConfig(seed=True)
    with pytest.raises(ConfigError, match=r"collective_timeout_s: invalid value 0.0 \(expected a number >= 0\.1\)"):
        TorchPassConfig(collective_timeout_s=0.0)
    with pytest.raises(ConfigError, match="expected a number"):
        TorchPassConfig(collective_timeout_s=float("inf"))
    assert TorchPassConfig(collective_timeout_s=5).collective_timeout_s == 5.0  # int accepted for a float


def test_set_assignments_parse_by_field_type() -> None:
    cfg = TorchPassConfig().with_assignment("seed=7").with_assignment("reseed_numpy=off")
    cfg = cfg.with_assignment("collective_timeout_s=2.5").with_assignment("backend=auto")
    assert (cfg.seed, cfg.reseed_numpy, cfg.collective_timeout_s, cfg.backend) == (7, False, 2.5, "auto")
    with pytest.raises(ConfigError, match=r"seed: invalid value 'x' \(expected an integer\)"):
        cfg.with_assignment("seed=x")
    with pytest.raises(ConfigError, match=r"backend: invalid value 'mpi'"):
        cfg.with_assignment("backend=mpi")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        cfg.with_assignment("seed")


def test_files_and_environment_round_trip(tmp_path: Path) -> None:
    toml = tmp_path / "tp.toml"
    toml.write_text("seed = 11\nmax_failures = 2\n")
    json_file = tmp_path / "tp.json"
    json_file.write_text('{"seed": 12}')
    assert TorchPassConfig.from_file(toml).seed == 11
    assert TorchPassConfig.from_file(json_file).seed == 12
    cfg = TorchPassConfig(seed=5, backend="auto", join_timeout_s=9.0)
    assert TorchPassConfig.from_env({ENV_CONFIG: cfg.to_json()}) == cfg
    assert TorchPassConfig.from_env({}) == TorchPassConfig()
    with pytest.raises(ConfigError, match="not JSON"):
        TorchPassConfig.from_env({ENV_CONFIG: "{"})


def test_peer_copy_settings_are_bounded() -> None:
    """Redundancy is 0 (off), 1 or 2 neighbours; the refresh period is at least every step."""
    assert (TorchPassConfig().peer_copies, TorchPassConfig().peer_copy_every_steps) == (1, 1)
    assert TorchPassConfig().peer_copies_in_hsdp is False  # HSDP's replicas are its first line: copies on request
    assert TorchPassConfig().with_assignment("peer_copies_in_hsdp=true").peer_copies_in_hsdp is True
    assert TorchPassConfig().with_assignment("peer_copies=2").peer_copies == 2
    with pytest.raises(ConfigError, match=r"peer_copies: 0, 1 or 2 neighbours, got 3"):
        TorchPassConfig().with_assignment("peer_copies=3")
    with pytest.raises(ConfigError, match=r"peer_copy_every_steps: invalid value 0"):
        TorchPassConfig(peer_copy_every_steps=0)
    assert TorchPassConfig().peer_copy_sync is False  # the copy overlaps the next step unless asked
    assert TorchPassConfig().with_assignment("peer_copy_sync=true").peer_copy_sync is True
    with pytest.raises(ConfigError, match=r"peer_copy_sync needs peer_copy_every_steps = 1 .* = 4"):
        TorchPassConfig(peer_copy_sync=True, peer_copy_every_steps=4)
