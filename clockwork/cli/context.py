"""State shared by every ``clockwork`` subcommand: where the configuration comes from, loaded once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from clockwork.contracts.config import LoadedConfig, load_config, parse_assignment


@dataclass
class CliContext:
    """Global options, plus command-specific overrides added by subcommands before loading."""

    config_path: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    _loaded: LoadedConfig | None = None

    def set(self, name: str, value: Any) -> None:
        """Record a command-line value (``section.key``); None means the option was not given."""
        if value is not None:
            self.overrides[name] = value
            self._loaded = None

    def load(self) -> LoadedConfig:
        if self._loaded is None:
            self._loaded = load_config(self.config_path, overrides=self.overrides)
        return self._loaded


def parse_sets(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for text in values:
        section, key, value = parse_assignment(text)
        out[f"{section}.{key}"] = value
    return out


pass_ctx = click.make_pass_decorator(CliContext)
