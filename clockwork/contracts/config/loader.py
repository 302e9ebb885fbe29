"""Load the configuration with a fixed precedence: command line > environment > file > default.

Unknown sections and keys are errors (a typo must never fall back silently to a default), and every
value is checked against its field's type and allowed values, with messages that name where the bad
value came from, the key and what would have been accepted.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clockwork.contracts.config.fields import FieldValueError, coerce
from clockwork.contracts.config.schema import ClockworkConfig, sections
from clockwork.contracts.errors import ConfigError

DEFAULT_PATH = Path("/etc/clockwork/clockwork.toml")
CONFIG_ENV = "CLOCKWORK_CONFIG"
ENV_PREFIX = "CLOCKWORK_"


@dataclass(frozen=True)
class LoadedConfig:
    """The effective configuration plus, for each ``section.key``, where its value came from."""

    config: ClockworkConfig
    sources: dict[str, str]
    path: Path | None

    def items(self) -> list[tuple[str, str, Any, str, str]]:
        """(section, key, value, source, doc) for every field, in schema order."""
        rows = []
        for name, cls in sections().items():
            section = getattr(self.config, name)
            for f in dataclasses.fields(cls):
                rows.append(
                    (name, f.name, getattr(section, f.name), self.sources[f"{name}.{f.name}"], f.metadata["doc"])
                )
        return rows


def _coerce(f: dataclasses.Field[Any], raw: Any, origin: str, section: str, *, text_ok: bool = True) -> Any:
    """:func:`clockwork.contracts.config.fields.coerce`, its error naming where the value came from."""
    try:
        return coerce(f, raw, text_ok=text_ok)
    except FieldValueError as exc:
        raise ConfigError(f"{origin}: [{section}] {f.name}: {exc}") from None


def _fields(section: str) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(sections()[section])}


def _check_known(origin: str, section: str, key: str | None = None) -> None:
    known = sections()
    if section not in known:
        raise ConfigError(f"{origin}: unknown section [{section}] (known sections: {', '.join(known)})")
    if key is not None and key not in _fields(section):
        raise ConfigError(f"{origin}: unknown key '{key}' in [{section}] (known keys: {', '.join(_fields(section))})")


def parse_assignment(text: str) -> tuple[str, str, str]:
    """Split a command-line ``section.key=value`` into its parts."""
    name, sep, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. sandbox.nodes=4")
    _check_known("--set", section, key)
    return section, key, value


def config_path(cli_path: Path | None, env: Mapping[str, str]) -> tuple[Path | None, bool]:
    """The file to read and whether it must exist (an explicitly named file must)."""
    if cli_path is not None:
        return cli_path, True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), True
    return DEFAULT_PATH, False


def load_config(
    cli_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Build the effective configuration.

    ``overrides`` maps ``"section.key"`` to a value from the command line (typed, or a string to parse).
    """
    env = os.environ if env is None else env
    path, required = config_path(cli_path, env)
    file_values: dict[str, Any] = {}
    if path is not None and (required or path.exists()):
        try:
            file_values = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist (named by --config or {CONFIG_ENV})") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read configuration: {exc}") from None
    else:
        path = None

    for section, table in file_values.items():
        _check_known(str(path), section)
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table of settings")
        for key in table:
            _check_known(str(path), section, key)

    for var in env:
        if var.startswith(ENV_PREFIX) and var != CONFIG_ENV and var.isupper():
            head, _, rest = var[len(ENV_PREFIX) :].lower().partition("_")
            if head in sections() and rest:
                _check_known(f"environment {var}", head, rest)

    overrides = overrides or {}
    for name in overrides:
        section, _, key = name.partition(".")
        _check_known("command line", section, key)

    built: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for section, cls in sections().items():
        values: dict[str, Any] = {}
        for key, f in _fields(section).items():
            var = f"{ENV_PREFIX}{section.upper()}_{key.upper()}"
            if f"{section}.{key}" in overrides:
                origin = "command line"
                values[key] = _coerce(f, overrides[f"{section}.{key}"], origin, section)
            elif var in env:
                origin = f"environment {var}"
                values[key] = _coerce(f, env[var], origin, section)
            elif key in file_values.get(section, {}):
                origin = f"file {path}"
                values[key] = _coerce(f, file_values[section][key], str(path), section, text_ok=False)
            else:
                origin = "default"
            sources[f"{section}.{key}"] = origin
        built[section] = cls(**values)
    return LoadedConfig(ClockworkConfig(**built), sources, path)
