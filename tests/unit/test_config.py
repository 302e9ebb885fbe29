"""The configuration loader: precedence, where each value came from, and errors that say what to fix.

Every test names its configuration explicitly (a file under tmp_path and an environment dict), so the
machine's own /etc/clockwork/clockwork.toml and CLOCKWORK_* variables never leak in.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clockwork.contracts.config import DEFAULT_PATH, ClockworkConfig, load_config, parse_assignment, sections
from clockwork.contracts.config.core import SandboxConfig
from clockwork.contracts.config.example import render
from clockwork.contracts.config.loader import CONFIG_ENV, config_path
from clockwork.contracts.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "etc" / "clockwork.toml"
ASSIGNMENT_LINE = re.compile(r"^# (\w+ = .+)$")


def _write(tmp_path: Path, text: str, name: str = "clockwork.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)]


def _known_keys(section: str) -> str:
    return ", ".join(f.name for f in dataclasses.fields(sections()[section]))


@pytest.fixture
def empty_file(tmp_path: Path) -> Path:
    return _write(tmp_path, "", "empty.toml")


# ----- defaults and precedence ----------------------------------------------------------------


def test_defaults_with_an_empty_file(empty_file: Path) -> None:
    loaded = load_config(empty_file, env={})
    assert loaded.config == ClockworkConfig()
    assert loaded.path == empty_file
    cfg = loaded.config
    assert cfg.log.level == "info"
    assert cfg.log.file == ""
    assert cfg.slurm.backend == "auto"
    assert cfg.slurm.conf == "/etc/slurm/slurm.conf"
    assert cfg.slurm.timeout_s == 30.0
    assert cfg.hooks.spool_dir == "/var/spool/clockwork"
    assert cfg.sandbox.state_dir == "/run/clockwork-sandbox"
    assert (cfg.sandbox.nodes, cfg.sandbox.nics, cfg.sandbox.cpus_per_node) == (3, 2, 2)
    assert cfg.sandbox.accounting is False
    assert cfg.sandbox.port_base == 16817
    assert loaded.sources == dict.fromkeys(_all_keys(), "default")


def test_items_lists_every_setting_in_schema_order_with_its_doc(empty_file: Path) -> None:
    rows = load_config(empty_file, env={}).items()
    assert [f"{s}.{k}" for s, k, _, _, _ in rows] == _all_keys()
    by_key = {f"{s}.{k}": (value, source, doc) for s, k, value, source, doc in rows}
    nodes_field = next(f for f in dataclasses.fields(SandboxConfig) if f.name == "nodes")
    assert by_key["sandbox.nodes"] == (3, "default", nodes_field.metadata["doc"])


def test_missing_default_path_is_fine() -> None:
    assert config_path(None, {}) == (DEFAULT_PATH, False)
    loaded = load_config(env={})
    if DEFAULT_PATH.exists():  # a machine with Clockwork installed: the file is read (but was never required)
        assert loaded.path == DEFAULT_PATH
    else:
        assert loaded.path is None
        assert loaded.config == ClockworkConfig()
        assert set(loaded.sources.values()) == {"default"}


def test_values_from_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[log]\nlevel = "debug"\n'
        '[slurm]\nbackend = "cli"\ntimeout_s = 5\n'
        '[hooks]\nspool_dir = "/srv/spool"\n'
        '[sandbox]\nnodes = 5\naccounting = true\nnode_net = "10.0.0.0/24"\n',
    )
    loaded = load_config(path, env={})
    cfg = loaded.config
    assert cfg.log.level == "debug"
    assert cfg.slurm.backend == "cli"
    assert cfg.slurm.timeout_s == 5.0
    assert isinstance(cfg.slurm.timeout_s, float)
    assert cfg.hooks.spool_dir == "/srv/spool"
    assert (cfg.sandbox.nodes, cfg.sandbox.accounting, cfg.sandbox.node_net) == (5, True, "10.0.0.0/24")
    from_file = {
        "log.level",
        "slurm.backend",
        "slurm.timeout_s",
        "hooks.spool_dir",
        "sandbox.nodes",
        "sandbox.accounting",
        "sandbox.node_net",
    }
    for key, source in loaded.sources.items():
        assert source == (f"file {path}" if key in from_file else "default"), key


def test_environment_beats_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[sandbox]\nnodes = 5\nnics = 3\n[log]\nlevel = "debug"\n')
    env = {"CLOCKWORK_SANDBOX_NODES": "6", "CLOCKWORK_LOG_LEVEL": "error", "CLOCKWORK_HOOKS_SPOOL_DIR": "/x/Y z"}
    loaded = load_config(path, env=env)
    assert loaded.config.sandbox.nodes == 6
    assert loaded.config.sandbox.nics == 3
    assert loaded.config.log.level == "error"
    assert loaded.config.hooks.spool_dir == "/x/Y z"  # strings are taken verbatim
    assert loaded.sources["sandbox.nodes"] == "environment CLOCKWORK_SANDBOX_NODES"
    assert loaded.sources["log.level"] == "environment CLOCKWORK_LOG_LEVEL"
    assert loaded.sources["hooks.spool_dir"] == "environment CLOCKWORK_HOOKS_SPOOL_DIR"
    assert loaded.sources["sandbox.nics"] == f"file {path}"
    assert loaded.sources["sandbox.cpus_per_node"] == "default"


def test_command_line_beats_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sandbox]\nnodes = 5\nnics = 3\n")
    env = {"CLOCKWORK_SANDBOX_NODES": "6", "CLOCKWORK_SANDBOX_NICS": "4", "CLOCKWORK_SANDBOX_ACCOUNTING": "no"}
    overrides = {"sandbox.nodes": "7", "sandbox.nics": 1, "sandbox.accounting": True, "slurm.timeout_s": "2.5"}
    loaded = load_config(path, env=env, overrides=overrides)
    sb = loaded.config.sandbox
    assert (sb.nodes, sb.nics, sb.accounting) == (7, 1, True)
    assert loaded.config.slurm.timeout_s == 2.5
    for key in overrides:
        assert loaded.sources[key] == "command line"
    assert loaded.sources["sandbox.cpus_per_node"] == "default"


def test_config_env_var_names_the_file_and_cli_path_beats_it(tmp_path: Path) -> None:
    from_env = _write(tmp_path, "[sandbox]\nnodes = 4\n", "env.toml")
    from_cli = _write(tmp_path, "[sandbox]\nnodes = 9\n", "cli.toml")
    loaded = load_config(env={CONFIG_ENV: str(from_env)})
    assert loaded.path == from_env
    assert loaded.config.sandbox.nodes == 4
    assert loaded.sources["sandbox.nodes"] == f"file {from_env}"
    loaded = load_config(from_cli, env={CONFIG_ENV: str(from_env)})
    assert loaded.path == from_cli
    assert loaded.config.sandbox.nodes == 9
    assert config_path(from_cli, {CONFIG_ENV: str(from_env)}) == (from_cli, True)
    assert config_path(None, {CONFIG_ENV: str(from_env)}) == (from_env, True)


def test_variables_outside_any_section_are_not_settings(empty_file: Path) -> None:
    loaded = load_config(empty_file, env={"CLOCKWORK_FOO": "1", "CLOCKWORK_DEBUG_LEVEL": "x"})
    assert loaded.config == ClockworkConfig()


# ----- the file: missing, unreadable, unknown names -------------------------------------------


def test_explicit_config_path_missing_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"config file {missing} does not exist")):
        load_config(missing, env={})
    with pytest.raises(ConfigError, match=re.escape(f"config file {missing} does not exist")) as err:
        load_config(env={CONFIG_ENV: str(missing)})
    assert err.value.exit_code == 2


def test_invalid_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sandbox]\nnodes = \n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: cannot read configuration")):
        load_config(path, env={})


def test_unknown_section_in_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sandbx]\nnodes = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    msg = str(err.value)
    assert msg.startswith(f"{path}: ")
    assert "unknown section [sandbx]" in msg
    known = "log, slurm, hooks, daemon, linkpass, lens, nodewatch, health, audit, borrow, snapshots, sandbox"
    assert f"known sections: {known}" in msg


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sandbox]\nnodes = 2\nnodez = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    msg = str(err.value)
    assert msg.startswith(f"{path}: ")
    assert "unknown key 'nodez' in [sandbox]" in msg
    assert f"known keys: {_known_keys('sandbox')}" in msg
    assert "cpus_per_node" in msg


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "sandbox = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: [sandbox] must be a table of settings")):
        load_config(path, env={})


def test_unknown_key_from_environment_names_the_variable(empty_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(empty_file, env={"CLOCKWORK_SANDBOX_NODEZ": "4"})
    msg = str(err.value)
    assert msg.startswith("environment CLOCKWORK_SANDBOX_NODEZ: ")
    assert "unknown key 'nodez' in [sandbox]" in msg
    assert f"known keys: {_known_keys('sandbox')}" in msg


def test_unknown_key_from_command_line(empty_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"^command line: unknown key 'nodez' in \[sandbox\]"):
        load_config(empty_file, env={}, overrides={"sandbox.nodez": 1})
    with pytest.raises(ConfigError, match=r"^command line: unknown section \[bogus\]"):
        load_config(empty_file, env={}, overrides={"bogus.x": 1})


# ----- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "key", "expected"),
    [
        ("[sandbox]\nnodes = 0\n", "[sandbox] nodes: invalid value 0", "an integer >= 1"),
        ('[slurm]\nbackend = "foo"\n', "[slurm] backend: invalid value 'foo'", "one of auto, cli, pyslurm"),
        ('[log]\nlevel = "verbose"\n', "[log] level: invalid value 'verbose'", "one of debug, info, warning, error"),
        ("[sandbox]\nnodes = 2.5\n", "[sandbox] nodes: invalid value 2.5", "an integer >= 1"),
        ("[sandbox]\nnodes = true\n", "[sandbox] nodes: invalid value True", "an integer >= 1"),
        ("[sandbox]\naccounting = 1\n", "[sandbox] accounting: invalid value 1", "true or false"),
        ("[sandbox]\nstate_dir = 5\n", "[sandbox] state_dir: invalid value 5", "a string"),
        ("[sandbox]\nport_base = 80\n", "[sandbox] port_base: invalid value 80", "an integer >= 1024"),
        ("[slurm]\ntimeout_s = 0.5\n", "[slurm] timeout_s: invalid value 0.5", "a number >= 1"),
        ("[slurm]\ntimeout_s = true\n", "[slurm] timeout_s: invalid value True", "a number >= 1"),
        ("[slurm]\nconf = [1, 2]\n", "[slurm] conf: invalid value [1, 2]", "a string"),
    ],
)
def test_bad_value_in_file(tmp_path: Path, toml: str, key: str, expected: str) -> None:
    path = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == f"{path}: {key} (expected {expected})"
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (
            "CLOCKWORK_SANDBOX_ACCOUNTING",
            "maybe",
            "[sandbox] accounting: invalid value 'maybe' (expected true or false)",
        ),
        ("CLOCKWORK_SANDBOX_NODES", "three", "[sandbox] nodes: invalid value 'three' (expected an integer >= 1)"),
        ("CLOCKWORK_SANDBOX_NODES", "2.0", "[sandbox] nodes: invalid value '2.0' (expected an integer >= 1)"),
        ("CLOCKWORK_SANDBOX_NODES", "0", "[sandbox] nodes: invalid value '0' (expected an integer >= 1)"),
        ("CLOCKWORK_SLURM_TIMEOUT_S", "fast", "[slurm] timeout_s: invalid value 'fast' (expected a number >= 1)"),
        ("CLOCKWORK_SLURM_BACKEND", "foo", "[slurm] backend: invalid value 'foo' (expected one of auto, cli, pyslurm)"),
    ],
)
def test_bad_value_from_environment(empty_file: Path, var: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(empty_file, env={var: value})
    assert str(err.value) == f"environment {var}: {message}"


def test_bad_value_from_command_line(empty_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(empty_file, env={}, overrides={"sandbox.nodes": "0"})
    assert str(err.value) == "command line: [sandbox] nodes: invalid value '0' (expected an integer >= 1)"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("yes", True),
        ("no", False),
        ("1", True),
        ("0", False),
        ("true", True),
        ("false", False),
        ("on", True),
        ("off", False),
        ("TRUE", True),
        (" Yes ", True),
        ("Off", False),
    ],
)
def test_bool_from_environment(empty_file: Path, text: str, value: bool) -> None:
    loaded = load_config(empty_file, env={"CLOCKWORK_SANDBOX_ACCOUNTING": text})
    assert loaded.config.sandbox.accounting is value


@given(nodes=st.integers(min_value=1, max_value=10**9), pad=st.sampled_from(["", " ", "\t", "  "]))
@settings(max_examples=60, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_nodes_from_environment_property(empty_file: Path, nodes: int, pad: str) -> None:
    loaded = load_config(empty_file, env={"CLOCKWORK_SANDBOX_NODES": f"{pad}{nodes}{pad}"})
    assert loaded.config.sandbox.nodes == nodes
    assert type(loaded.config.sandbox.nodes) is int
    assert loaded.sources["sandbox.nodes"] == "environment CLOCKWORK_SANDBOX_NODES"


@given(nodes=st.integers(max_value=0))
@settings(max_examples=30, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_nodes_below_one_from_environment_property(empty_file: Path, nodes: int) -> None:
    with pytest.raises(ConfigError, match="expected an integer >= 1"):
        load_config(empty_file, env={"CLOCKWORK_SANDBOX_NODES": str(nodes)})


# ----- --set SECTION.KEY=VALUE ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("sandbox.nodes=4", ("sandbox", "nodes", "4")),
        (" sandbox.nodes =4", ("sandbox", "nodes", "4")),
        ("log.file=a=b", ("log", "file", "a=b")),
        ("log.file=", ("log", "file", "")),
    ],
)
def test_parse_assignment(text: str, parts: tuple[str, str, str]) -> None:
    assert parse_assignment(text) == parts


@pytest.mark.parametrize("text", ["bogus", "sandbox.nodes", "=3", "sandbox=3", ".nodes=3", "sandbox.=3", ""])
def test_parse_assignment_malformed(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_assignment(text)
    assert str(err.value) == f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. sandbox.nodes=4"


def test_parse_assignment_unknown_names() -> None:
    with pytest.raises(ConfigError) as err:
        parse_assignment("bogus.x=1")
    assert (
        str(err.value)
        == "--set: unknown section [bogus] (known sections: log, slurm, hooks, daemon, linkpass, lens, nodewatch, "
        "health, audit, borrow, snapshots, sandbox)"
    )
    with pytest.raises(ConfigError) as err:
        parse_assignment("sandbox.nodez=1")
    assert str(err.value) == f"--set: unknown key 'nodez' in [sandbox] (known keys: {_known_keys('sandbox')})"


# ----- the shipped example file ---------------------------------------------------------------


def test_shipped_example_is_the_rendered_example() -> None:
    assert EXAMPLE.read_bytes() == render().encode(), "regenerate it: clockwork config example > etc/clockwork.toml"


def _section_bodies(text: str) -> dict[str, list[str]]:
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)
    return bodies


def test_example_lists_every_field_with_its_default_and_doc() -> None:
    bodies = _section_bodies(EXAMPLE.read_text())
    assert list(bodies) == list(sections())
    for name, cls in sections().items():
        lines = bodies[name]
        assignments = {}
        for line in lines:
            m = ASSIGNMENT_LINE.match(line)
            if m:
                assignments.update(tomllib.loads(m.group(1)))
        comment_text = " ".join(line[2:] for line in lines if line.startswith("# "))
        defaults = cls()
        for f in dataclasses.fields(cls):
            assert f.name in assignments, f"[{name}] {f.name} is missing from {EXAMPLE}"
            assert assignments[f.name] == getattr(defaults, f.name), f"[{name}] {f.name}"
            assert f.metadata["doc"] in comment_text, f"[{name}] {f.name}: doc missing"
            for choice in f.metadata.get("choices", ()):
                assert choice in comment_text
        assert set(assignments) == {f.name for f in dataclasses.fields(cls)}


def test_example_loads_as_all_defaults() -> None:
    loaded = load_config(EXAMPLE, env={})
    assert loaded.config == ClockworkConfig()
    assert set(loaded.sources.values()) == {"default"}


def test_example_uncommented_loads_and_equals_the_defaults(tmp_path: Path) -> None:
    lines = [ASSIGNMENT_LINE.sub(r"\1", line) for line in EXAMPLE.read_text().splitlines()]
    path = _write(tmp_path, "\n".join(lines) + "\n")
    loaded = load_config(path, env={})
    assert loaded.config == ClockworkConfig()
    assert loaded.sources == dict.fromkeys(_all_keys(), f"file {path}")
