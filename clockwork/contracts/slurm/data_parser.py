"""Which JSON layout the CLI backend asks each Slurm release for (``--json=VERSION``).

From 23.02, Slurm's clients print JSON through versioned ``data_parser`` plugins, and each release serves a
window of versions (the newest by default). Plain ``--json`` would therefore change shape with every upgrade, and
a rolling upgrade mixes releases. So the backend names one version that every tested release serves:

============  ====================  ==========================================
release       serves                the backend asks
============  ====================  ==========================================
22.05         none (openapi 0.0.38)  ``--json`` (takes no version)
23.02-24.05   0.0.39-0.0.41         ``--json`` (not tested here: their default)
24.11         0.0.40-0.0.42         ``--json=v0.0.42``
25.05         0.0.40-0.0.43         ``--json=v0.0.42``
25.11         0.0.41-0.0.44         ``--json=v0.0.42``
26.05         0.0.42-0.0.45         ``--json=v0.0.42``
26.11         drops 0.0.42          ``--json=v0.0.43`` (planned, not tested)
============  ====================  ==========================================

A release that does not serve the version asked for answers "unable to find plugin" / "output not supported";
the backend then reads that command's text output instead (:mod:`clockwork.contracts.slurm.cli_backend`).
"""

from __future__ import annotations

from clockwork.contracts.slurm.backend import SlurmVersion

__all__ = ["DATA_PARSERS", "data_parser", "json_option"]

#: (first release, data_parser version), oldest first; a release takes the last row at or below it. Releases
#: before the first row take plain ``--json``.
DATA_PARSERS: tuple[tuple[tuple[int, int], str], ...] = (
    ((24, 11), "v0.0.42"),  # the one version 24.11, 25.05, 25.11 and 26.05 all serve
    ((26, 11), "v0.0.43"),  # 26.11 drops v0.0.42; 25.05 through 26.11 serve v0.0.43
)


def data_parser(version: SlurmVersion) -> str | None:
    """The data_parser version to ask ``version`` for; None: plain ``--json`` (no version named)."""
    chosen: str | None = None
    for first, parser in DATA_PARSERS:
        if version[:2] >= first:
            chosen = parser
    return chosen


def json_option(version: SlurmVersion) -> str:
    """The JSON option for ``version``'s clients: ``--json=v0.0.42`` or plain ``--json``."""
    parser = data_parser(version)
    return f"--json={parser}" if parser else "--json"
