"""The daemon's wire format: round trips, strict checks with messages that name the problem, and fuzzing.

Pure tests (no sockets): whatever bytes or msgpack object arrives, :func:`decode_request` either
returns a fully checked request or raises :class:`ProtocolError` with a known code; nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clockwork.contracts.daemon_wire import (
    BAD_REQUEST,
    BAD_VERSION,
    OPS,
    SCHEMA,
    TOO_LARGE,
    VERSION,
    ProtocolError,
    check_json_value,
    decode_event,
    decode_reply,
    decode_request,
    encode_error,
    encode_event,
    encode_ok,
    encode_request,
    event_topic,
)

LIMIT = 65536
CODES = {BAD_REQUEST, BAD_VERSION, TOO_LARGE}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _error(data: bytes, limit: int = LIMIT) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(data, limit)
    return info.value


VALID = {
    "ping": {},
    "status": {},
    "jobs": {},
    "lens": {},
    "gpus": {},
    "register_job": {
        "job_id": 12,
        "uid": 1000,
        "user": "alice",
        "nodes": ["node1", "node2"],
        "options": {"ft": "aware"},
    },
    "unregister_job": {"job_id": 12},
    "post_event": {"job_id": 12, "kind": "link.failover", "fields": {"nic": "nic0", "ms": 12.5, "ok": True}},
    "job_events": {"job_id": 12, "since": 1.5, "after": 3, "limit": 10},
    "borrow": {"job_id": 12, "lost_node": "node3"},
    "borrow_status": {"job_id": 12, "request": 1},
    "borrow_release": {"job_id": 12, "why": "job 12 ended"},
    "node_verdicts": {"job_id": 12, "after": 3, "wait_ms": 10_000},
    "node_view": {"node": "node3"},
}


def test_every_op_has_a_valid_example() -> None:
    assert set(VALID) == set(OPS) == set(SCHEMA)


@pytest.mark.parametrize("op", sorted(VALID))
def test_round_trip(op: str) -> None:
    data = encode_request(op, **VALID[op])
    request = decode_request(data, LIMIT)
    assert request.op == op
    assert request.args == VALID[op]
    assert msgpack.unpackb(data)["v"] == VERSION


def test_optional_fields_may_be_left_out() -> None:
    assert decode_request(encode_request("job_events", job_id=5), LIMIT).args == {"job_id": 5}
    assert decode_request(encode_request("post_event", job_id=5, kind="x"), LIMIT).args == {"job_id": 5, "kind": "x"}


@pytest.mark.parametrize(
    ("obj", "code", "fragment"),
    [
        ({"op": "ping"}, BAD_REQUEST, "no schema version 'v'"),
        ({"v": 2, "op": "ping"}, BAD_VERSION, "schema version 2 is not supported"),
        ({"v": "1", "op": "ping"}, BAD_VERSION, "schema version '1'"),
        ({"v": True, "op": "ping"}, BAD_VERSION, "schema version True"),
        ({"v": 1}, BAD_REQUEST, "request has no 'op'"),
        ({"v": 1, "op": 7}, BAD_REQUEST, "'op' must be a string"),
        ({"v": 1, "op": "reboot"}, BAD_REQUEST, "unknown op 'reboot' (known: ping, status"),
        ({"v": 1, "op": "ping", "x": 1}, BAD_REQUEST, "ping: unknown field 'x' (known fields: none)"),
        ({"v": 1, "op": "unregister_job"}, BAD_REQUEST, "unregister_job: missing field 'job_id'"),
        ({"v": 1, "op": "unregister_job", "job_id": "12"}, BAD_REQUEST, "field 'job_id' must be an integer"),
        ({"v": 1, "op": "unregister_job", "job_id": True}, BAD_REQUEST, "field 'job_id' must be an integer"),
        ({"v": 1, "op": "unregister_job", "job_id": 0}, BAD_REQUEST, "an integer 1..4294967295, got int 0"),
        ({"v": 1, "op": "unregister_job", "job_id": 2**32}, BAD_REQUEST, "an integer 1..4294967295"),
        ({"v": 1, "op": "unregister_job", "job_id": 1.0}, BAD_REQUEST, "got float 1.0"),
        ({"v": 1, "op": "unregister_job", "job_id": 3, "jobid": 3}, BAD_REQUEST, "unknown field 'jobid'"),
        (
            {**VALID["register_job"], "v": 1, "op": "register_job", "uid": -1},
            BAD_REQUEST,
            "register_job: field 'uid' must be an integer 0..4294967294",
        ),
        (
            {**VALID["register_job"], "v": 1, "op": "register_job", "nodes": []},
            BAD_REQUEST,
            "field 'nodes' must be a non-empty list",
        ),
        (
            {**VALID["register_job"], "v": 1, "op": "register_job", "nodes": ["a b"]},
            BAD_REQUEST,
            "a list of node names",
        ),
        (
            {**VALID["register_job"], "v": 1, "op": "register_job", "options": {"ft": 1}},
            BAD_REQUEST,
            "field 'options.ft' must be a string",
        ),
        (
            {**VALID["register_job"], "v": 1, "op": "register_job", "user": b"alice"},
            BAD_REQUEST,
            "field 'user' must be a string",
        ),
        ({"v": 1, "op": "post_event", "job_id": 1, "kind": ""}, BAD_REQUEST, "field 'kind' must be an event kind"),
        ({"v": 1, "op": "post_event", "job_id": 1, "kind": "a b"}, BAD_REQUEST, "field 'kind' must be an event kind"),
        (
            {"v": 1, "op": "post_event", "job_id": 1, "kind": "k", "fields": {"x": b"\x00"}},
            BAD_REQUEST,
            "field 'fields': bytes",
        ),
        (
            {"v": 1, "op": "post_event", "job_id": 1, "kind": "k", "fields": [1]},
            BAD_REQUEST,
            "field 'fields' must be a map",
        ),
        (
            {"v": 1, "op": "post_event", "job_id": 1, "kind": "k", "fields": {"x": math.inf}},
            BAD_REQUEST,
            "non-finite number inf",
        ),
        ({"v": 1, "op": "job_events", "job_id": 1, "since": math.nan}, BAD_REQUEST, "'since' must be a finite number"),
        ({"v": 1, "op": "job_events", "job_id": 1, "limit": 0}, BAD_REQUEST, "'limit' must be an integer 1..10000"),
    ],
)
def test_bad_requests_name_the_problem(obj: dict[str, Any], code: str, fragment: str) -> None:
    err = _error(_pack(obj))
    assert err.code == code
    assert fragment in err.message


def test_deeply_nested_event_fields_are_refused() -> None:
    nested: Any = "leaf"
    for _ in range(20):
        nested = {"x": nested}
    err = _error(_pack({"v": 1, "op": "post_event", "job_id": 1, "kind": "k", "fields": nested}))
    assert "nested deeper than 16 levels" in err.message


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "not one msgpack object"),
        (b"\xc1", "not one msgpack object"),  # never-used type byte
        (_pack({"v": 1, "op": "ping"}) + b"\x00", "not one msgpack object"),  # trailing data
        (_pack([1, "ping"]), "must be a msgpack map, got list"),
        (_pack("ping"), "must be a msgpack map, got str"),
        (b"\x81\xa1v\xc4\x01\x01", "schema version"),  # {"v": b"\x01"}
        (b"\x81\x01\x01", "not one msgpack object"),  # {1: 1}: keys must be strings
        (b"\x81\xa2\xff\xfe\x01", "not one msgpack object"),  # key is not UTF-8
        (b"\x91" * 5000 + b"\xc0", "not one msgpack object"),  # nesting deeper than the unpacker allows
    ],
)
def test_malformed_bytes(data: bytes, fragment: str) -> None:
    err = _error(data)
    assert err.code in CODES
    assert fragment in err.message


def test_size_limit_comes_first() -> None:
    data = encode_request("post_event", job_id=1, kind="k", fields={"blob": "x" * 2000})
    assert decode_request(data, len(data)).op == "post_event"
    err = _error(data, len(data) - 1)
    assert err.code == TOO_LARGE
    assert f"request of {len(data)} bytes is over the limit of {len(data) - 1} bytes" == err.message


def test_encode_request_checks_like_the_daemon() -> None:
    with pytest.raises(ProtocolError, match="unknown field 'jobid'"):
        encode_request("unregister_job", jobid=3)
    with pytest.raises(ProtocolError, match="unknown op 'nope'"):
        encode_request("nope")


def test_replies() -> None:
    ok = decode_reply(encode_ok(node="n1", jobs=[]))
    assert ok == {"v": VERSION, "ok": True, "node": "n1", "jobs": []}
    err = decode_reply(encode_error("forbidden", "no"))
    assert err["ok"] is False
    assert err["error"] == {"code": "forbidden", "message": "no"}
    with pytest.raises(ProtocolError, match="no boolean 'ok'"):
        decode_reply(_pack({"v": 1}))
    with pytest.raises(ProtocolError, match="without an error"):
        decode_reply(_pack({"v": 1, "ok": False}))
    with pytest.raises(ProtocolError) as info:
        decode_reply(encode_ok(x="y" * 100), max_bytes=50)
    assert info.value.code == TOO_LARGE


def test_events_on_the_wire() -> None:
    event = {"seq": 3, "time": 1.5, "job_id": 12, "node": "n1", "kind": "k", "fields": {}, "by": "uid 0 pid 1"}
    frames = encode_event(event)
    assert frames[0] == event_topic(12) == b"12."
    assert not event_topic(123).startswith(event_topic(12))
    assert decode_event(frames) == event


def test_check_json_value() -> None:
    assert check_json_value({"a": [1, 2.5, None, True, "s", {"b": []}]}) is None
    assert "not a string" in (check_json_value({1: 2}) or "")
    assert "not a JSON value" in (check_json_value({"a": msgpack.ExtType(1, b"")}) or "")


# ----- fuzzing --------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
json_like = st.recursive(
    scalars | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# Maps that look like requests: the right keys with arbitrary values, so the per-op checks are exercised.
request_like = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, "1", None]), "op": st.sampled_from([*OPS, "x", 3])},
    optional={
        name: json_like
        for name in ("job_id", "uid", "user", "nodes", "options", "kind", "fields", "node", "since", "after", "limit")
    },
)


def _decode_or_error(data: bytes) -> None:
    try:
        request = decode_request(data, 4096)
    except ProtocolError as exc:
        assert exc.code in CODES
        assert exc.message
        return
    # Whatever got through is exactly what the schema allows, and encodes back to a decodable request.
    assert request.op in OPS
    assert set(request.args) <= set(SCHEMA[request.op].fields)
    assert decode_request(encode_request(request.op, **request.args), 1 << 20) == request


@given(st.binary(max_size=6000))
@settings(max_examples=400, database=None)
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_or_error(data)


@given(json_like)
@settings(max_examples=300, database=None)
def test_fuzz_arbitrary_msgpack_objects(obj: Any) -> None:
    _decode_or_error(_pack(obj))


@given(request_like)
@settings(max_examples=600, database=None)
def test_fuzz_request_shaped_maps(obj: dict[str, Any]) -> None:
    _decode_or_error(_pack(obj))
