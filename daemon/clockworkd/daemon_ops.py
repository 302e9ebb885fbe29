"""How the daemon's ops are declared: each op once, by the component that answers it, with its request type, its
access class and its handler; and the check that builds the daemon's table from those declarations.

Why one declaration: an op used to be named in four places (the wire schema, the access lists, the server's
handler table, the client), and an op left out of the access lists was open to every local user. Now the wire
schema (:data:`clockwork.contracts.daemon_wire.SCHEMA`) says what a request looks like, and the component (the daemon
core in :mod:`clockworkd.server`, the hosted components' ``ops`` modules) says, in one :class:`OpSpec`, who may run it
and what answers it. :func:`op_table` refuses to build a table in which an op of the schema has no declaration or
no access class, so a daemon with an unclassified op does not start; :func:`clockworkd.daemon_auth.authorise`
refuses such an op anyway (deny by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from clockwork.contracts.daemon_wire import SCHEMA, RequestType
from clockworkd.daemon_auth import LOCAL_CLASSES, Access, Caller, OpAccess
from clockworkd.parked import Park

__all__ = ["Handler", "OpDeclarationError", "OpSpec", "OpsProvider", "op_table"]

#: An op's handler: the request's checked arguments and its caller to the reply's fields, or a Park (long poll).
Handler = Callable[[dict[str, Any], Caller], dict[str, Any] | Park]


class OpDeclarationError(Exception):
    """The daemon's op declarations do not cover the wire schema exactly, or one declares no usable access: a
    programming error, raised when the daemon is built (it never starts with it)."""


@dataclass(frozen=True)
class OpSpec:
    """One op as its component declares it: the request type (from :mod:`clockwork.contracts.daemon_wire`), who may run
    it, and the handler that answers it."""

    request: RequestType
    access: OpAccess
    handler: Handler

    @property
    def op(self) -> str:
        return self.request.op


class OpsProvider(Protocol):
    """A component's ops module: what it answers, declared in one place."""

    def ops(self) -> list[OpSpec]: ...


def _problems(spec: OpSpec, schema: Mapping[str, RequestType]) -> list[str]:
    op, classes = spec.op, spec.access.classes
    if schema.get(op) is not spec.request:
        return [f"{op}: its request type is not the wire schema's {op!r}"]
    out = []
    if not classes:
        out.append(f"{op}: declares no access class (one or more of {', '.join(a.value for a in Access)})")
    fields = spec.request.fields
    if Access.JOB_OWNER in classes and not fields.get("job_id", (None, False))[1]:
        out.append(f"{op}: is job-owner but its request has no required 'job_id' to find the owner by")
    unknown = sorted(spec.access.privileged_fields - set(fields))
    if unknown:
        out.append(f"{op}: privileged field(s) {', '.join(unknown)} are not fields of its request")
    if spec.access.privileged_fields and not classes & LOCAL_CLASSES - {Access.PRIVILEGED}:
        out.append(f"{op}: privileged fields mean nothing where only privileged callers and peers are served")
    return out


def op_table(providers: Iterable[OpsProvider], schema: Mapping[str, RequestType] = SCHEMA) -> dict[str, OpSpec]:
    """The daemon's table, op -> its declaration, from every component's declarations; OpDeclarationError (naming
    every problem) when an op of ``schema`` is declared by no component or twice, a declaration names an op the
    schema lacks, or a declaration's access is empty or inconsistent with its request."""
    table: dict[str, OpSpec] = {}
    problems: list[str] = []
    for provider in providers:
        for spec in provider.ops():
            if spec.op in table:
                problems.append(f"{spec.op}: declared twice")
                continue
            problems += _problems(spec, schema)
            table[spec.op] = spec
    problems += [f"{op}: in the wire schema, but no component declares it" for op in schema if op not in table]
    if problems:
        raise OpDeclarationError("the daemon's ops are not all declared: " + "; ".join(problems))
    return table
