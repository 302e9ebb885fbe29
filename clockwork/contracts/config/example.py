"""Render the complete, commented example configuration from the schema.

``etc/clockwork.toml`` is this output (a test keeps them identical), so the shipped example always
lists every setting with its documentation and default.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

from clockwork.contracts.config.schema import sections

HEADER = """\
# Clockwork for Slurm configuration: /etc/clockwork/clockwork.toml
# (or the file named by $CLOCKWORK_CONFIG or `--config`).
#
# Every setting is listed with its default, commented out. Precedence: command line (--set
# SECTION.KEY=VALUE and command options) > environment (CLOCKWORK_SECTION_KEY) > this file > default.
# Unknown sections or keys are errors, never silently ignored.
# Regenerate with: clockwork config example
"""


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def render() -> str:
    out = [HEADER]
    for name, cls in sections().items():
        out.append("")
        out += [f"# {line}" for line in textwrap.wrap(cls.__doc__ or "", 100)]
        out.append(f"[{name}]")
        for f in dataclasses.fields(cls):
            doc = f.metadata["doc"]
            if "choices" in f.metadata:
                doc += f" Allowed: {', '.join(f.metadata['choices'])}."
            out += [f"# {line}" for line in textwrap.wrap(doc, 100)]
            out.append(f"# {f.name} = {_toml(f.default)}")
    return "\n".join(out) + "\n"
