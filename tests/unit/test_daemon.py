"""A real clockworkd process: control plane, authorisation by kernel credentials, robustness, persistence, CURVE.

Each test starts its own daemon (``.venv/bin/clockworkd --config /tmp/cwd-XXXX/... --foreground``)
with everything under a short /tmp folder, and stops it afterwards (the ``daemons`` fixture), so no
process, socket or folder outlives a test. The cross-user test runs a client as uid 65534 with
``setpriv``; it needs root, and is skipped only on a developer machine without it (never in CI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from clockwork.contracts.curve_keys import CurveKeys, generate
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.daemon_wire import decode_event, decode_reply, encode_request, event_topic
from clockwork.contracts.errors import DaemonError, DaemonUnavailableError
from tests.conftest import in_ci, until
from tests.unit.daemon_harness import (
    CLOCKWORKD,
    RunningDaemon,
    daemon_env,
    daemon_for,
    daemons,
    scratch,
    start_daemon,
    write_config,
)

__all__ = ["daemons", "scratch"]  # fixtures used by name below

NOBODY = 65534


def require_root_for_second_user() -> None:
    """The cross-user test needs root (to become uid 65534); CI must run it, a laptop may skip it."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return
    message = "cross-user test needs root and setpriv (it runs a client as uid 65534)"
    if in_ci():
        pytest.fail(message + " (CI must run everything)")
    pytest.skip(message + " (skipped on a developer machine only)")


class RawClient:
    """A bare DEALER on the control socket, to send what no well-behaved client would."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.context = zmq.Context()
        self.endpoint = daemon.paths.control_endpoint
        self.sock = self._socket()

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def send(self, *frames: bytes, timeout_s: float = 3.0) -> list[bytes] | None:
        """Send one message; its reply frames, or None when none came (the socket is then replaced)."""
        self.sock.send_multipart(list(frames))
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_multipart()
        self.sock.close(0)
        self.sock = self._socket()
        return None

    def ask(self, *frames: bytes) -> dict[str, Any]:
        reply = self.send(*frames)
        assert reply is not None, "the daemon did not answer"
        return decode_reply(reply[-1])

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def _ping_works(daemon: RunningDaemon) -> None:
    with daemon.client() as client:
        assert client.ping()["node"] == daemon.paths.node


def _leftovers(daemon: RunningDaemon) -> list[str]:
    return sorted(p.name for p in daemon.paths.run_dir.iterdir())


# ----- basics ---------------------------------------------------------------------------------


def test_ping_status_sockets_and_pid_file(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    assert daemon.proc is not None
    with daemon.client() as client:
        pong = client.ping()
        info = client.status()
    assert pong["node"] == "n1" and pong["pid"] == daemon.proc.pid
    assert info["node"] == "n1"
    assert info["pid"] == daemon.proc.pid
    assert info["uptime_s"] >= 0
    assert info["control"] == str(scratch / "n1" / "run" / "control.sock")
    assert info["peer_plane"] == f"disabled: no CURVE keys at {scratch}/no-curve/daemon.key_secret " + (
        "(make them with `clockwork keys generate`)"
    )
    assert info["jobs"] == [] and info["jobs_total"] == 0
    assert info["caller"]["privileged"] is True
    assert stat.S_IMODE(daemon.paths.control_socket.stat().st_mode) == 0o666
    assert stat.S_IMODE(daemon.paths.events_socket.stat().st_mode) == 0o600
    assert daemon.paths.pid_file.read_text() == f"{daemon.proc.pid}\n"
    assert (scratch / "n1" / "state" / "reports").is_dir()
    assert "ready" in daemon.log_text()


def test_register_post_events_unregister(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    with daemon.client() as client:
        reply = client.register_job(100, 1000, "alice", ["n1", "n2"], {"ft": "aware", "spares": "borrow"})
        assert reply["created"] is True
        assert reply["job"]["uid"] == 1000 and reply["job"]["state"] == "running"
        assert (
            client.register_job(100, 1000, "alice", ["n1", "n2"], {"ft": "aware", "spares": "borrow"})["created"]
            is False
        )
        posted = client.post_event(100, "link.failover", {"nic": "nic0", "ms": 120.5})
        assert posted["seq"] == 2
        events = client.job_events(100)
        assert [e["kind"] for e in events] == ["job.registered", "link.failover"]
        assert events[1]["fields"] == {"nic": "nic0", "ms": 120.5}
        assert events[1]["node"] == "n1"
        assert events[1]["by"].startswith(f"uid {os.getuid()} pid ")
        assert client.job_events(100, since=events[0]["time"]) == events[1:]
        assert [j["job_id"] for j in client.jobs()] == [100]
        ended = client.unregister_job(100)
        assert ended["state"] == "ended"
        # The Epilog may gather the events after unregistering, too.
        assert [e["kind"] for e in client.job_events(100)] == ["job.registered", "link.failover", "job.unregistered"]
        with pytest.raises(DaemonError) as info:
            client.post_event(999, "x")
        assert info.value.code == "unknown_job"
        assert "job 999 is not registered on this node (node n1)" in str(info.value)
        assert info.value.exit_code == 5
        status = client.status()
    assert status["jobs_running"] == 0 and status["jobs_total"] == 1
    assert [e["kind"] for e in status["recent_events"]][-1] == "job.unregistered"


def test_events_are_published(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(daemon.paths.events_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, event_topic(300))
    try:
        with daemon.client() as client:
            client.register_job(300, 1000, "alice", ["n1"], {})
            client.register_job(30, 1000, "alice", ["n1"], {})  # topic 30. must not match 300.
            deadline = time.monotonic() + 5
            received: list[dict[str, Any]] = []
            while not any(e["kind"] == "hello" for e in received) and time.monotonic() < deadline:
                client.post_event(30, "other")  # a SUB may join late: post until one arrives
                client.post_event(300, "hello", {"n": 1})
                while sub.poll(200):
                    received.append(decode_event(sub.recv_multipart()))
        hello = [e for e in received if e["kind"] == "hello"]
        assert hello, f"no event published: {received}"
        assert hello[0]["fields"] == {"n": 1} and hello[0]["node"] == "n1"
        assert {e["job_id"] for e in received} == {300}
    finally:
        sub.close(0)
        context.term()


# ----- authorisation by kernel credentials ----------------------------------------------------

CROSS_USER_SCRIPT = r"""
import json, sys
from pathlib import Path
from clockwork.contracts.daemon_client import DaemonClient
from clockwork.contracts.errors import DaemonError

client = DaemonClient(Path(sys.argv[1]), 3.0)

def attempt(fn):
    try:
        return {"ok": True, "result": fn()}
    except DaemonError as exc:
        return {"ok": False, "code": exc.code, "message": str(exc)}

out = {
    "ping": attempt(client.ping),
    "register": attempt(lambda: client.register_job(300, 65534, "nobody", ["n1"], {})),
    "unregister_other": attempt(lambda: client.unregister_job(100)),
    "events_other": attempt(lambda: client.job_events(100)),
    "post_other": attempt(lambda: client.post_event(100, "user.note")),
    "verdicts_other": attempt(lambda: client.node_verdicts(100)),
    "verdicts_own": attempt(lambda: client.node_verdicts(200, 0, 0.1).enabled),
    "status": attempt(client.status),
    "jobs": attempt(client.jobs),
    "post_own": attempt(lambda: client.post_event(200, "user.note", {"a": 1})),
    "post_own_as_node": attempt(lambda: client.post_event(200, "user.note", node="n9")),
    "events_own": attempt(lambda: client.job_events(200)),
    "unregister_own": attempt(lambda: client.unregister_job(200)),
}
client.close()
print(json.dumps(out))
"""


def test_a_second_user_acts_only_on_its_own_jobs(scratch: Path, daemons: list[RunningDaemon]) -> None:
    require_root_for_second_user()
    daemon = start_daemon(daemons, write_config(scratch))
    with daemon.client() as client:
        client.register_job(100, 1000, "alice", ["n1"], {"ft": "aware"})
        client.register_job(200, NOBODY, "nobody", ["n1"], {"ft": "aware"})
    script = scratch / "as_nobody.py"
    script.write_text(CROSS_USER_SCRIPT)
    script.chmod(0o644)
    env = {**daemon_env(), "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(scratch)}
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            str(script),
            str(daemon.paths.control_socket),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=scratch,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)

    assert out["ping"]["ok"]
    for name in ("register", "unregister_other", "events_other", "post_other", "post_own_as_node", "verdicts_other"):
        assert out[name] == {"ok": False, "code": "forbidden", "message": out[name]["message"]}, name
    assert f"uid {NOBODY} may not register_job job 300: only root and the Slurm user" in out["register"]["message"]
    assert "may not unregister_job job 100: it belongs to uid 1000" in out["unregister_other"]["message"]
    assert "may not job_events job 100: it belongs to uid 1000" in out["events_other"]["message"]
    assert "may not node_verdicts job 100: it belongs to uid 1000" in out["verdicts_other"]["message"]
    assert out["verdicts_own"] == {"ok": True, "result": False}  # no node watch here (no LinkPass)
    # Only its own jobs are listed.
    assert [j["job_id"] for j in out["status"]["result"]["jobs"]] == [200]
    assert out["status"]["result"]["caller"] == {"uid": NOBODY, "privileged": False}
    assert {e["job_id"] for e in out["status"]["result"]["recent_events"]} == {200}
    assert [j["job_id"] for j in out["jobs"]["result"]] == [200]
    # Its own job: post, read, unregister.
    assert out["post_own"]["ok"] and out["events_own"]["ok"] and out["unregister_own"]["ok"]
    own_kinds = [e["kind"] for e in out["events_own"]["result"]]
    assert own_kinds == ["job.registered", "user.note"]
    assert out["events_own"]["result"][1]["by"].startswith(f"uid {NOBODY} pid ")

    with daemon.client() as client:
        assert {j["job_id"]: j["state"] for j in client.jobs()} == {100: "running", 200: "ended"}
        assert [e["kind"] for e in client.job_events(100)] == ["job.registered"]  # nothing slipped in
        assert client.status()["counters"]["denied"] == 6
    log = daemon.log_text()
    assert f"denied: uid {NOBODY} (pid " in log and "may not unregister_job job 100" in log


# ----- robustness -----------------------------------------------------------------------------


def test_malformed_and_oversized_messages_get_errors(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))  # max_message_bytes = 4096
    raw = RawClient(daemon)
    try:
        cases: list[tuple[tuple[bytes, ...], str, str]] = [
            ((b"", b"\xc1garbage"), "bad_request", "not one msgpack object"),
            ((b"", msgpack.packb([1, 2])), "bad_request", "must be a msgpack map"),
            ((b"", msgpack.packb({"v": 1, "op": "launch"})), "bad_request", "unknown op 'launch'"),
            ((b"", msgpack.packb({"v": 9, "op": "ping"})), "bad_version", "schema version 9"),
            ((b"", msgpack.packb({"v": 1, "op": "ping", "uid": 0})), "bad_request", "ping: unknown field 'uid'"),
            ((b"", encode_request("ping"), b"extra"), "bad_request", "expected one request frame"),
            ((b"",), "bad_request", "expected one request frame after the envelope, got 0"),
            ((b"", b"a", b"b", b"c", b"d", b"e"), "bad_request", "got too many"),
            ((b"", b"x" * 8192), "too_large", "request of 8192 bytes is over the limit of 4096 bytes"),
        ]
        for frames, code, fragment in cases:
            reply = raw.ask(*frames)
            assert reply["ok"] is False, frames
            assert reply["error"]["code"] == code, reply
            assert fragment in reply["error"]["message"], reply
        # Without the empty delimiter frame (a plain DEALER) the daemon answers the same way.
        assert raw.ask(encode_request("ping"))["ok"] is True
        # A frame over the hard limit (4 x max, at least 1 MiB) is never read: the sender is cut off.
        assert raw.send(b"", b"y" * (2 * 1024 * 1024), timeout_s=1.0) is None
        assert raw.ask(b"", encode_request("ping"))["ok"] is True
    finally:
        raw.close()
    _ping_works(daemon)
    with daemon.client() as client:
        assert client.status()["counters"]["malformed"] >= len(cases)


def test_fuzz_the_live_control_socket(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    raw = RawClient(daemon)
    values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=10,
    )
    shaped = st.fixed_dictionaries(
        {"v": st.sampled_from([1, 1, 2]), "op": st.sampled_from(["ping", "post_event", "job_events", "nope"])},
        optional={"job_id": values, "kind": values, "fields": values, "since": values},
    ).map(msgpack.packb)
    payloads = st.one_of(st.binary(max_size=5000), values.map(msgpack.packb), shaped)

    @given(payloads)
    @settings(max_examples=150, deadline=None, database=None)
    def fuzz(data: bytes) -> None:
        reply = raw.ask(b"", data)  # every message is answered ...
        assert isinstance(reply["ok"], bool)
        if not reply["ok"]:
            assert reply["error"]["code"] in {"bad_request", "bad_version", "too_large", "unknown_job"}

    try:
        fuzz()
    finally:
        raw.close()
    _ping_works(daemon)  # ... and the daemon keeps serving
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_a_hung_daemon_times_out_and_the_next_call_is_clean(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    assert daemon.proc is not None
    client = DaemonClient(daemon.paths, timeout_s=0.5)
    try:
        client.register_job(5, 1000, "alice", ["n1"], {})
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailableError) as info:  # the stopped daemon cannot answer: the timeout
                client.job_events(5)
            assert "no answer from clockworkd on n1 within 0.5 s" in str(info.value)
            assert info.value.exit_code == 6 and info.value.code == "unavailable"
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        # The late reply to job_events must not be taken as the answer to ping.
        assert set(client.ping()) == {"node", "pid", "version", "time"}
    finally:
        client.close()


def test_no_daemon_is_reported_fast(scratch: Path) -> None:
    """A missing socket is reported as such at once, not as a timeout: with a 300 s timeout (pytest-timeout's
    too), a client that waited it out would fail with "no answer ... within 300 s" or be stopped as a hang."""
    with DaemonClient(scratch / "nothing" / "control.sock", timeout_s=300) as client:
        with pytest.raises(DaemonUnavailableError, match="does not exist") as info:
            client.ping()
        assert "no answer" not in str(info.value)


# ----- life cycle -----------------------------------------------------------------------------


def test_sigterm_cleans_up_and_restart_keeps_jobs_and_events(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    with daemon.client() as client:
        client.register_job(41, 1000, "alice", ["n1"], {"ft": "aware"})
        client.register_job(42, 1001, "bob", ["n1"], {})
        client.post_event(41, "rank.migrated", {"rank": 3})
        client.unregister_job(42)
        before = client.job_events(41)
    assert daemon.stop(signal.SIGTERM) == 0
    assert _leftovers(daemon) == []  # sockets and pid file removed
    assert "stopping" in daemon.log_text()

    daemon.start()
    with daemon.client() as client:
        assert {j["job_id"]: j["state"] for j in client.jobs()} == {41: "running", 42: "ended"}
        assert client.job_events(41) == before
        assert client.post_event(41, "after.restart")["seq"] == before[-1]["seq"] + 1
    assert daemon.stop(signal.SIGINT) == 0
    assert _leftovers(daemon) == []


def test_a_crashed_daemon_is_replaced_and_a_torn_event_is_dropped(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = start_daemon(daemons, write_config(scratch))
    with daemon.client() as client:
        client.register_job(7, 1000, "alice", ["n1"], {})
        client.post_event(7, "before.crash")
    daemon.stop(signal.SIGKILL)
    assert _leftovers(daemon) == ["clockworkd.pid", "control.sock", "events.sock"]  # stale
    with DaemonClient(daemon.paths, timeout_s=2) as client:
        with pytest.raises(DaemonUnavailableError, match="nothing listens"):
            client.ping()
    with open(daemon.paths.state_dir / "events" / "7.jsonl", "ab") as fh:
        fh.write(b'{"seq": 3, "kind": "torn')
    daemon.start()
    with daemon.client() as client:
        assert [e["kind"] for e in client.job_events(7)] == ["job.registered", "before.crash"]
        assert client.post_event(7, "after.crash")["seq"] == 3
    assert "torn last event line" in daemon.log_text()


def test_a_second_daemon_refuses_to_start(scratch: Path, daemons: list[RunningDaemon]) -> None:
    config = write_config(scratch)
    daemon = start_daemon(daemons, config)
    assert daemon.proc is not None
    second = subprocess.run(
        [str(CLOCKWORKD), "--config", str(config), "--foreground"],
        capture_output=True,
        text=True,
        env=daemon_env(),
        timeout=30,
    )
    assert second.returncode == 5
    assert f"clockworkd: another clockworkd (pid {daemon.proc.pid}) is running" in second.stderr
    _ping_works(daemon)
    assert daemon.paths.pid_file.read_text() == f"{daemon.proc.pid}\n"


# ----- the daemon-to-daemon plane (CURVE) -----------------------------------------------------


def _keys(folder: Path) -> CurveKeys:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(folder / "daemon.key_secret")
    assert secret is not None
    return CurveKeys(public, secret)


def test_curve_peer_plane(scratch: Path, daemons: list[RunningDaemon]) -> None:
    generate(scratch / "curve")
    generate(scratch / "intruder")
    daemon = start_daemon(daemons, write_config(scratch, curve_dir=scratch / "curve"))
    with daemon.client() as client:
        endpoint = client.status()["peer_plane"]
        client.register_job(9, 1000, "alice", ["n1", "n2"], {})
    assert endpoint.startswith("tcp://127.0.0.1:")
    good = _keys(scratch / "curve")
    with DaemonClient.for_peer(endpoint, good, good.public, timeout_s=3) as peer:
        assert peer.ping()["node"] == "n1"
        assert peer.post_event(9, "link.failover", {"nic": "nic1"}, node="n2")["seq"] == 2
        with pytest.raises(DaemonError) as info:
            peer.status()
        assert info.value.code == "forbidden"
        assert "serves only node_view, ping, post_event" in str(info.value)
        view = peer.request("node_view", node="n2")  # no node watch here: it cannot judge
        assert view["trusted"] is False and "LinkPass" in view["why"], view
    intruder = _keys(scratch / "intruder")
    with (
        DaemonClient.for_peer(endpoint, intruder, good.public, timeout_s=1) as peer,
        pytest.raises(DaemonUnavailableError),
    ):
        peer.ping()
    # The daemon keeps serving both planes.
    _ping_works(daemon)
    with DaemonClient.for_peer(endpoint, good, good.public, timeout_s=3) as peer:
        assert peer.ping()["node"] == "n1"
    with daemon.client() as client:
        relayed = client.job_events(9)[-1]
    assert relayed["node"] == "n2" and relayed["by"].startswith("peer 127.0.0.1 key ")
    until("the daemon to log that it refused a peer", lambda: "refused a peer" in daemon.log_text(), 30, 0.05)


def test_a_secret_key_others_can_read_disables_the_peer_plane(scratch: Path, daemons: list[RunningDaemon]) -> None:
    _, secret = generate(scratch / "curve")
    secret.chmod(0o644)
    daemon = start_daemon(daemons, write_config(scratch, curve_dir=scratch / "curve"))
    with daemon.client() as client:
        state = client.status()["peer_plane"]
    assert state == f"disabled: secret key {secret} is readable by other users (chmod 600 it)"


def test_harness_config_is_what_the_daemon_uses(scratch: Path) -> None:
    daemon = daemon_for(write_config(scratch, node="n7"))
    assert daemon.paths.control_socket == scratch / "n7" / "run" / "control.sock"
    assert daemon.paths.state_dir == scratch / "n7" / "state"


def test_a_foreign_listener_on_the_socket_is_left_alone(scratch: Path, daemons: list[RunningDaemon]) -> None:
    daemon = daemon_for(write_config(scratch))
    daemon.paths.run_dir.mkdir(parents=True)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        squatter.bind(str(daemon.paths.control_socket))
        squatter.listen(1)
        refused = subprocess.run(
            [str(CLOCKWORKD), "--config", str(daemon.config)],
            capture_output=True,
            text=True,
            env=daemon_env(),
            timeout=30,
        )
        assert refused.returncode == 5
        assert f"a process already serves {daemon.paths.control_socket} without holding" in refused.stderr
        assert daemon.paths.control_socket.exists()  # not removed: it is not ours
        assert not daemon.paths.pid_file.exists()
    finally:
        squatter.close()


@pytest.mark.parametrize(("given", "want"), [(None, "1"), ("3", "3")])
def test_the_daemon_runs_numpy_on_one_blas_thread_unless_told_otherwise(given: str | None, want: str) -> None:
    """OpenBLAS starts a thread per core at numpy's import, which spin on the training job's cores after
    each small solve; the daemon asks for one, and keeps an explicit setting."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    code = (
        "import os, clockworkd.agent, numpy\n"
        "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    setting, threads = out.split()
    assert setting == want
    if given is None:
        assert threads == "1"  # numpy is loaded, and no thread besides the main one
