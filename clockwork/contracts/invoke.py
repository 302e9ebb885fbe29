"""The one error handler of Clockwork's command lines (``clockwork``, ``torchpass``): exceptions carry their
exit code and are shown as one line, never a traceback; click's own usage errors keep theirs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from clockwork.contracts.errors import ClockworkError

__all__ = ["invoke"]


def invoke(command: click.Command, argv: Sequence[str], prog: str, obj: Any = None) -> int:
    """Run ``command`` in-process on ``argv`` (what the console scripts and the tests call); its exit code."""
    try:
        result = command.main(args=list(argv), prog_name=prog, standalone_mode=False, obj=obj)
    except ClockworkError as exc:
        click.echo(f"{prog}: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo(f"{prog}: aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return result if isinstance(result, int) else 0
