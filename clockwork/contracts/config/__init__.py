"""Clockwork's configuration: schema (one dataclass per component) and loader (precedence, validation)."""

from clockwork.contracts.config.loader import DEFAULT_PATH, LoadedConfig, load_config, parse_assignment
from clockwork.contracts.config.schema import ClockworkConfig, sections

__all__ = ["DEFAULT_PATH", "ClockworkConfig", "LoadedConfig", "load_config", "parse_assignment", "sections"]
