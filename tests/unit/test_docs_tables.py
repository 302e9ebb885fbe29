"""The docs' reference tables tell the truth: docs/architecture.md lists every configuration section with exactly
its keys, and every daemon op with the access class it declares; docs/admin-guide.md's authorisation table names
every op. A section, key or op added to the code without its line in the docs fails here, and so does a line
left behind for one that is gone."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.config.schema import ClockworkConfig
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.daemon_wire import SCHEMA
from clockworkd.server import Daemon

DOCS = Path(__file__).resolve().parents[2] / "docs"


def table(doc: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table in ``doc`` whose header line is ``header``."""
    lines = (DOCS / doc).read_text().splitlines()
    matches = [i for i, line in enumerate(lines) if line.strip() == header]
    assert len(matches) == 1, f"{doc}: expected one table headed {header!r}, found {len(matches)}"
    rows = []
    for line in lines[matches[0] + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _code(cell: str) -> str:
    found = re.fullmatch(r"`\[?([a-z_]+)\]?`", cell)
    assert found, f"expected a name in backquotes, got {cell!r}"
    return found.group(1)


def test_every_config_section_is_in_the_architecture_table_with_its_keys() -> None:
    rows = table("architecture.md", "| section | what it sets |")
    documented = {_code(section): [k.strip() for k in keys.split(",")] for section, keys in rows}
    schema = {
        f.name: [g.name for g in dataclasses.fields(f.default_factory())] for f in dataclasses.fields(ClockworkConfig)
    }
    assert list(documented) == list(schema), "sections (in the schema's order)"
    for section, keys in schema.items():
        assert documented[section] == keys, f"[{section}]: the docs list {documented[section]}, the schema {keys}"


def test_every_daemon_op_is_in_the_architecture_table_with_its_access_class(tmp_path: Path) -> None:
    cfg = DaemonConfig(run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"), node_name="n1")
    declared = {op: spec.access.describe() for op, spec in Daemon(cfg, DaemonPaths.from_config(cfg)).op_table.items()}
    documented = {_code(row[0]): row[1] for row in table("architecture.md", "| op | access | answered by | what |")}
    assert set(documented) == set(SCHEMA) == set(declared)
    for op, access in declared.items():
        assert documented[op] == access, f"{op}: the docs say {documented[op]!r}, its declaration {access!r}"


def test_the_admin_guide_names_every_op_in_its_authorisation_table() -> None:
    text = " ".join(" ".join(row) for row in table("admin-guide.md", "| caller | may |"))
    missing = [op for op in SCHEMA if f"`{op}`" not in text]
    assert not missing, f"docs/admin-guide.md's authorisation table does not name {missing}"
