"""The node daemon's wire format: msgpack maps with a schema version, checked strictly on the way in.

A request is ``{"v": 1, "op": OP, ...fields}``; a reply is ``{"v": 1, "ok": true, ...}`` or
``{"v": 1, "ok": false, "error": {"code": CODE, "message": TEXT}}``. Any local user can write to the
control socket, so :func:`decode_request` trusts nothing: a size limit comes first, then the msgpack
parse, then per-op types, ranges and lengths, and an unknown op or field is an error that names it
(a typo must never be silently ignored). Everything here is pure (no sockets, no clock) so it can be
unit-tested and fuzzed on its own; the daemon and every client use it.

Event payloads are JSON-compatible values only (no bytes, no non-finite floats, bounded nesting)
because the daemon persists them as JSON lines and the Epilog turns them into JSON reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from clockwork.contracts.errors import ProtocolError

VERSION = 1

# Error codes (the ``error.code`` of a failed reply).
BAD_REQUEST = "bad_request"  # not msgpack, not a map, unknown op/field, wrong type or range
BAD_VERSION = "bad_version"  # a schema version this daemon does not speak
TOO_LARGE = "too_large"  # over max_message_bytes
FORBIDDEN = "forbidden"  # the caller's credentials do not allow the operation on that job
UNKNOWN_JOB = "unknown_job"  # no such job registered on this node
QUOTA = "quota"  # the job's event log is full
INTERNAL = "internal"  # the daemon failed (disk error, ...); logged with details on the node

# Replies may be much larger than requests (a job's events, a status with many jobs).
MAX_REPLY_BYTES = 64 * 1024 * 1024

MAX_JOB_ID = 2**32 - 1  # Slurm job ids are uint32
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no uid"
MAX_NAME = 256  # user and node names
MAX_OPTION_KEY = 64
MAX_OPTION_VALUE = 1024
MAX_DEPTH = 16  # nesting of event fields
MAX_EVENTS_PER_REPLY = 10_000
DEFAULT_EVENTS_PER_REPLY = 1_000
MAX_WAIT_MS = 60_000  # the longest long poll (node_verdicts)
_KIND = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")


@dataclass(frozen=True)
class Request:
    """A decoded, fully checked request: its op and its fields (optional ones only when given)."""

    op: str
    args: dict[str, Any]


def _short(value: Any) -> str:
    """A bounded repr of untrusted input, safe to put in an error message or a log line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return type(value).__name__


# ----- field checkers: (op, field, value) -> the value, or ProtocolError ----------------------

Checker = Callable[[str, str, Any], Any]


def _bad(op: str, name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(
        f"{op}: field '{name}' must be {expected}, got {_type_name(value)} {_short(value)}", code=BAD_REQUEST
    )


def _int_range(low: int, high: int) -> Checker:
    def check(op: str, name: str, value: Any) -> int:
        if type(value) is not int or not low <= value <= high:
            raise _bad(op, name, f"an integer {low}..{high}", value)
        return value

    return check


def _string(max_len: int, pattern: re.Pattern[str] | None = None, *, what: str = "") -> Checker:
    def check(op: str, name: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) > max_len or (pattern is not None and not pattern.match(value)):
            raise _bad(op, name, what or f"a string of at most {max_len} characters", value)
        return value

    return check


def _number(op: str, name: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _bad(op, name, "a finite number", value)
    return float(value)


def _node_list(op: str, name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _bad(op, name, "a non-empty list of node names", value)
    for item in value:
        if not isinstance(item, str) or not _NODE.match(item):
            raise _bad(op, name, "a list of node names (letters, digits, '_', '.', '-')", item)
    return value


def _options(op: str, name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad(op, name, "a map of strings to strings", value)
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_OPTION_KEY:
            raise _bad(op, name, f"a map whose keys are strings of 1..{MAX_OPTION_KEY} characters", key)
        if not isinstance(item, str) or len(item) > MAX_OPTION_VALUE:
            raise _bad(op, f"{name}.{key}", f"a string of at most {MAX_OPTION_VALUE} characters", item)
    return value


def check_json_value(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` is not a JSON-compatible value (None when it is): event fields are stored as JSON."""
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if value is None or isinstance(value, bool | int | str):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"non-finite number {value!r}"
    if isinstance(value, list):
        for item in value:
            problem = check_json_value(item, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"map key {_short(key)} is not a string"
            problem = check_json_value(item, depth + 1)
            if problem:
                return problem
        return None
    return f"{_type_name(value)} {_short(value)} is not a JSON value (use strings, numbers, booleans, lists, maps)"


def _event_fields(op: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(op, name, "a map", value)
    problem = check_json_value(value)
    if problem:
        raise ProtocolError(f"{op}: field '{name}': {problem}", code=BAD_REQUEST)
    return value


_JOB_ID = _int_range(1, MAX_JOB_ID)

#: A request type's fields: field -> (checker, required). "v" and "op" are checked before.
Fields = Mapping[str, tuple[Checker, bool]]


@dataclass(frozen=True)
class RequestType:
    """One op of the wire: its name and its fields. The daemon's components declare their ops by these objects
    (with an access class and a handler, :class:`clockworkd.daemon_ops.OpSpec`), so an op is named once; clients
    check a request against the same object before sending it."""

    op: str
    fields: Fields


PING = RequestType("ping", {})
STATUS = RequestType("status", {})
JOBS = RequestType("jobs", {})
LENS = RequestType("lens", {})  # Fleet Lens's latest snapshot (fabric telemetry)
GPUS = RequestType("gpus", {})  # the GPU health watch's view (ranks only of the caller's own jobs)
REGISTER_JOB = RequestType(
    "register_job",
    {
        "job_id": (_JOB_ID, True),
        "uid": (_int_range(0, MAX_UID), True),
        "user": (_string(MAX_NAME), True),
        "nodes": (_node_list, True),
        "options": (_options, True),
    },
)
UNREGISTER_JOB = RequestType("unregister_job", {"job_id": (_JOB_ID, True)})
POST_EVENT = RequestType(
    "post_event",
    {
        "job_id": (_JOB_ID, True),
        "kind": (_string(128, _KIND, what="an event kind (1..128 of letters, digits, '_', '.', ':', '-')"), True),
        "fields": (_event_fields, False),
        # Where the event happened, when not on the receiving node (set by relaying daemons).
        "node": (_string(MAX_NAME, _NODE, what="a node name"), False),
    },
)
JOB_EVENTS = RequestType(
    "job_events",
    {
        "job_id": (_JOB_ID, True),
        "since": (_number, False),  # only events with time > since
        "after": (_int_range(0, 2**63 - 1), False),  # only events with seq > after (paging)
        "limit": (_int_range(1, MAX_EVENTS_PER_REPLY), False),
    },
)
# Borrowed spares: start a borrow, poll it, give back.
BORROW = RequestType(
    "borrow",
    {
        "job_id": (_JOB_ID, True),
        "lost_node": (_string(MAX_NAME, _NODE, what="a node name"), False),  # the node the job lost
    },
)
BORROW_STATUS = RequestType("borrow_status", {"job_id": (_JOB_ID, True), "request": (_int_range(1, 2**31 - 1), False)})
BORROW_RELEASE = RequestType("borrow_release", {"job_id": (_JOB_ID, True), "why": (_string(MAX_NAME), False)})
# A job's agents wait (up to wait_ms) for the node watch's verdicts on the job's nodes newer than ``after``.
NODE_VERDICTS = RequestType(
    "node_verdicts",
    {
        "job_id": (_JOB_ID, True),
        "after": (_int_range(0, 2**63 - 1), False),
        "wait_ms": (_int_range(0, MAX_WAIT_MS), False),
    },
)
# Another daemon asks what this node hears of ``node`` (the second observer of a node-silent verdict).
NODE_VIEW = RequestType("node_view", {"node": (_string(MAX_NAME, _NODE, what="a node name"), True)})

#: Every op of the wire by name: what :func:`check_request` accepts. Who may run each, and what answers it, is
#: declared by the daemon's components (:mod:`clockworkd.daemon_ops`), which must cover every op here.
SCHEMA: dict[str, RequestType] = {
    t.op: t
    for t in (
        PING,
        STATUS,
        JOBS,
        LENS,
        GPUS,
        REGISTER_JOB,
        UNREGISTER_JOB,
        POST_EVENT,
        BORROW,
        BORROW_STATUS,
        BORROW_RELEASE,
        NODE_VERDICTS,
        NODE_VIEW,
        JOB_EVENTS,
    )
}
OPS = tuple(SCHEMA)


def check_request(op: Any, fields: Mapping[Any, Any]) -> Request:
    """Check an op and its fields against the schema (the part of decoding after msgpack)."""
    if not isinstance(op, str):
        raise ProtocolError(f"'op' must be a string naming the operation, got {_type_name(op)}", code=BAD_REQUEST)
    if op not in SCHEMA:
        raise ProtocolError(f"unknown op {_short(op)} (known: {', '.join(SCHEMA)})", code=BAD_REQUEST)
    spec = SCHEMA[op].fields
    for name in fields:
        if name not in spec:
            known = ", ".join(spec) or "none"
            raise ProtocolError(f"{op}: unknown field {_short(name)} (known fields: {known})", code=BAD_REQUEST)
    args: dict[str, Any] = {}
    for name, (check, required) in spec.items():
        if name in fields:
            args[name] = check(op, name, fields[name])
        elif required:
            raise ProtocolError(f"{op}: missing field '{name}'", code=BAD_REQUEST)
    return Request(op, args)


def _unpack(data: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise ProtocolError(f"{what} of {len(data)} bytes is over the limit of {max_bytes} bytes", code=TOO_LARGE)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, UnicodeDecodeError, ...)
        raise ProtocolError(f"{what} is not one msgpack object: {_short(str(exc))}", code=BAD_REQUEST) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a msgpack map, got {_type_name(obj)}", code=BAD_REQUEST)
    if "v" not in obj:
        raise ProtocolError(f"{what} has no schema version 'v' (this daemon speaks v={VERSION})", code=BAD_REQUEST)
    if type(obj["v"]) is not int or obj["v"] != VERSION:
        raise ProtocolError(
            f"schema version {_short(obj['v'])} is not supported (expected {VERSION})", code=BAD_VERSION
        )
    return obj


def decode_request(data: bytes, max_bytes: int) -> Request:
    """Parse and check one request frame; raises :class:`ProtocolError` naming the first problem."""
    obj = _unpack(data, max_bytes, "request")
    if "op" not in obj:
        raise ProtocolError(f"request has no 'op' (known: {', '.join(SCHEMA)})", code=BAD_REQUEST)
    fields = {k: v for k, v in obj.items() if k not in ("v", "op")}
    return check_request(obj["op"], fields)


def encode_request(op: str, **fields: Any) -> bytes:
    """One request frame; checked like the daemon would, so a client's mistake fails before sending."""
    request = check_request(op, fields)
    return msgpack.packb({"v": VERSION, "op": request.op, **request.args}, use_bin_type=True)


def encode_ok(**fields: Any) -> bytes:
    """A success reply carrying ``fields``."""
    return msgpack.packb({"v": VERSION, "ok": True, **fields}, use_bin_type=True)


def encode_error(code: str, message: str) -> bytes:
    """A failure reply."""
    return msgpack.packb({"v": VERSION, "ok": False, "error": {"code": code, "message": message}}, use_bin_type=True)


def decode_reply(data: bytes, max_bytes: int = MAX_REPLY_BYTES) -> dict[str, Any]:
    """Parse a reply; a failed reply is returned as it is (``ok`` false), a malformed one raises."""
    obj = _unpack(data, max_bytes, "reply")
    if type(obj.get("ok")) is not bool:
        raise ProtocolError("reply has no boolean 'ok'", code=BAD_REQUEST)
    if not obj["ok"]:
        error = obj.get("error")
        if (
            not isinstance(error, dict)
            or not isinstance(error.get("code"), str)
            or not isinstance(error.get("message"), str)
        ):
            raise ProtocolError("failed reply without an error {code, message}", code=BAD_REQUEST)
    return obj


# ----- the event stream (PUB socket) ----------------------------------------------------------


def event_topic(job_id: int) -> bytes:
    """Topic frame of a job's events; the trailing '.' makes the prefix match exact (12. != 123.)."""
    return b"%d." % job_id


def encode_event(event: Mapping[str, Any]) -> list[bytes]:
    """The two frames published for one event: topic, then the msgpack record."""
    return [event_topic(int(event["job_id"])), msgpack.packb({"v": VERSION, **event}, use_bin_type=True)]


def decode_event(frames: list[bytes], max_bytes: int = MAX_REPLY_BYTES) -> dict[str, Any]:
    """The event record of two published frames (without ``v``)."""
    if len(frames) != 2:
        raise ProtocolError(f"an event is 2 frames (topic, record), got {len(frames)}", code=BAD_REQUEST)
    obj = _unpack(frames[1], max_bytes, "event")
    obj.pop("v")
    return obj
