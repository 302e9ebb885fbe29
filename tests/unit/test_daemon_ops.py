"""Every daemon op declares its access class with its handler, and an op without one is refused (deny by default).

In-process (no sockets): the daemon's table is built from its components' declarations
(:mod:`clockworkd.daemon_ops`), and :func:`clockworkd.daemon_auth.authorise` applies them. The access each op had
before the declarations existed is pinned here, caller by caller, so the move changed no one's rights.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.daemon_wire import (
    FORBIDDEN,
    POST_EVENT,
    SCHEMA,
    ProtocolError,
    Request,
    RequestType,
    check_request,
    encode_request,
)
from clockworkd.daemon_auth import Access, Caller, OpAccess, authorise
from clockworkd.daemon_ops import OpDeclarationError, OpSpec, op_table
from clockworkd.registry import JobRecord, Registry, UnknownJobError
from clockworkd.server import Daemon

OWNER, OTHER, SLURM = 1000, 2000, 64030
JOB = 12
ROOT = Caller("local", uid=0, gid=0, pid=1, privileged=True)
SLURM_USER = Caller("local", uid=SLURM, gid=SLURM, pid=2, privileged=True)
OWNER_LOCAL = Caller("local", uid=OWNER, gid=OWNER, pid=3)
OTHER_LOCAL = Caller("local", uid=OTHER, gid=OTHER, pid=4)
PEER = Caller("peer", address="10.0.0.2", key="k" * 40, privileged=True)

# One valid request per op (as a client would send it).
ARGS = {
    "ping": {},
    "status": {},
    "jobs": {},
    "lens": {},
    "gpus": {},
    "register_job": {"job_id": 300, "uid": OWNER, "user": "alice", "nodes": ["n1"], "options": {}},
    "unregister_job": {"job_id": JOB},
    "post_event": {"job_id": JOB, "kind": "user.note"},
    "job_events": {"job_id": JOB},
    "borrow": {"job_id": JOB},
    "borrow_status": {"job_id": JOB},
    "borrow_release": {"job_id": JOB},
    "node_verdicts": {"job_id": JOB},
    "node_view": {"node": "n2"},
}

# The declared classes, pinned: changing one is a decision about who may do what, made here on purpose.
DECLARED = {
    "ping": {Access.LOCAL_ANY, Access.PEER},
    "status": {Access.LOCAL_ANY},
    "jobs": {Access.LOCAL_ANY},
    "lens": {Access.LOCAL_ANY},
    "gpus": {Access.LOCAL_ANY},
    "register_job": {Access.PRIVILEGED},
    "unregister_job": {Access.JOB_OWNER},
    "post_event": {Access.JOB_OWNER, Access.PEER},
    "job_events": {Access.JOB_OWNER},
    "borrow": {Access.JOB_OWNER},
    "borrow_status": {Access.JOB_OWNER},
    "borrow_release": {Access.JOB_OWNER},
    "node_verdicts": {Access.JOB_OWNER},
    "node_view": {Access.LOCAL_ANY, Access.PEER},
}


def allowed_before(op: str, args: dict[str, object], caller: Caller) -> bool:
    """The rules as ``daemon_auth`` wrote them before ops declared their access (its two lists and two special
    cases), kept as the reference the declarations must reproduce."""
    peer_ops = {"ping", "post_event", "node_view"}
    job_ops = {"unregister_job", "post_event", "job_events", "borrow", "borrow_status", "borrow_release"}
    job_ops |= {"node_verdicts"}
    if caller.plane == "peer":
        return op in peer_ops
    if caller.privileged:
        return True
    if op == "register_job" or (op == "post_event" and "node" in args):
        return False
    return op not in job_ops or caller.uid == OWNER


def _job_of(job_id: int) -> JobRecord:
    if job_id != JOB:
        raise UnknownJobError(job_id)
    return JobRecord(JOB, OWNER, "alice", ("n1",))


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon:
    root = tmp_path
    cfg = DaemonConfig(run_dir=str(root / "run"), state_dir=str(root / "state"), node_name="n1")
    d = Daemon(cfg, DaemonPaths.from_config(cfg))
    d.registry = Registry(root / "state", "n1")
    d.registry.load()
    d.registry.register(JOB, OWNER, "alice", ["n1"], {}, by="test")
    return d


def _rules(d: Daemon) -> dict[str, OpAccess]:
    return {op: spec.access for op, spec in d.op_table.items()}


def test_every_op_of_the_wire_schema_declares_an_access_class(daemon: Daemon) -> None:
    assert set(daemon.op_table) == set(SCHEMA) == set(ARGS)
    assert {op: set(spec.access.classes) for op, spec in daemon.op_table.items()} == DECLARED
    for op, spec in daemon.op_table.items():
        assert spec.request is SCHEMA[op] and spec.access.classes, op
    assert daemon.op_table["post_event"].access.privileged_fields == {"node"}


@pytest.mark.parametrize("op", sorted(ARGS))
def test_each_op_keeps_the_access_it_had(daemon: Daemon, op: str) -> None:
    rules = _rules(daemon)
    variants = [ARGS[op]] + ([{**ARGS[op], "node": "n9"}] if op == "post_event" else [])
    for args in variants:
        for caller in (ROOT, SLURM_USER, OWNER_LOCAL, OTHER_LOCAL, PEER):
            request = SCHEMA[op]
            assert set(args) <= set(request.fields)
            try:
                authorise(_request(op, args), caller, rules, _job_of, "slurm")
                allowed = True
            except ProtocolError as exc:
                assert exc.code == FORBIDDEN
                allowed = False
            assert allowed == allowed_before(op, args, caller), (op, args, caller.describe())


def _request(op: str, args: dict[str, object]) -> Request:
    return check_request(op, args)


# ----- an op with no access class ------------------------------------------------------------------------------

FROB = RequestType("frobnicate", {"job_id": POST_EVENT.fields["job_id"]})


class _Declares:
    def __init__(self, *specs: OpSpec) -> None:
        self.specs = list(specs)

    def ops(self) -> list[OpSpec]:
        return self.specs


def _frob(args: dict[str, object], caller: Caller) -> dict[str, object]:
    raise AssertionError("the handler of an op without an access class must never run")


def test_an_op_added_to_the_schema_without_a_declaration_stops_the_daemon_being_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SCHEMA, FROB.op, FROB)
    cfg = DaemonConfig(run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"), node_name="n1")
    with pytest.raises(OpDeclarationError, match="frobnicate: in the wire schema, but no component declares it"):
        Daemon(cfg, DaemonPaths.from_config(cfg))


def test_a_declaration_with_no_access_class_fails_the_check() -> None:
    schema = {FROB.op: FROB}
    with pytest.raises(OpDeclarationError, match="frobnicate: declares no access class"):
        op_table([_Declares(OpSpec(FROB, OpAccess(frozenset()), _frob))], schema)
    assert set(op_table([_Declares(OpSpec(FROB, OpAccess.of(Access.JOB_OWNER), _frob))], schema)) == {FROB.op}


def test_the_running_daemon_refuses_an_op_without_an_access_class(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op reaches the wire (the schema accepts it) but no component classified it: everyone is refused,
    root and peers included, and its handler never runs."""
    monkeypatch.setitem(SCHEMA, FROB.op, FROB)
    for caller in (ROOT, OWNER_LOCAL, OTHER_LOCAL, PEER):
        answer = daemon.handle(encode_request(FROB.op, job_id=JOB), caller)
        assert isinstance(answer, bytes)
        reply = msgpack.unpackb(answer)
        assert reply["ok"] is False and reply["error"]["code"] == FORBIDDEN, caller.describe()
        assert "frobnicate declares no access class" in reply["error"]["message"]
    rules = {FROB.op: OpAccess(frozenset())}  # declared, but with an empty class
    with pytest.raises(ProtocolError, match="declares no access class"):
        authorise(_request(FROB.op, {"job_id": JOB}), ROOT, rules, _job_of, "slurm")


def test_the_declaration_check_names_every_inconsistency() -> None:
    no_job = RequestType("no_job", {})
    schema = {FROB.op: FROB, no_job.op: no_job, "ping": SCHEMA["ping"]}
    with pytest.raises(OpDeclarationError) as info:
        op_table(
            [
                _Declares(
                    OpSpec(FROB, OpAccess.of(Access.LOCAL_ANY, privileged_fields=("nope",)), _frob),
                    OpSpec(no_job, OpAccess.of(Access.JOB_OWNER), _frob),
                    OpSpec(no_job, OpAccess.of(Access.PEER), _frob),
                    OpSpec(RequestType("ping", {}), OpAccess.of(Access.PEER), _frob),  # not the schema's ping
                )
            ],
            schema,
        )
    message = str(info.value)
    assert "frobnicate: privileged field(s) nope are not fields of its request" in message
    assert "no_job: is job-owner but its request has no required 'job_id'" in message
    assert "no_job: declared twice" in message
    assert "ping: its request type is not the wire schema's 'ping'" in message
