"""Talking to a node daemon: what the CLI, the Slurm hooks and TorchPass use (never the sockets directly).

Each request is one DEALER round trip with a deadline. When the daemon does not answer in time the
socket is closed (linger 0) and a fresh one is made for the next call, so a late reply can never be
mistaken for the answer to a later request. A refusal becomes :class:`DaemonError` carrying the
daemon's error code and message; no answer becomes :class:`DaemonUnavailableError` (exit code 6),
which tells a Prolog that the daemon must be started or restarted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from clockwork.contracts.config.core import DaemonConfig
from clockwork.contracts.curve_keys import CurveKeys
from clockwork.contracts.daemon_paths import DaemonPaths
from clockwork.contracts.daemon_wire import MAX_REPLY_BYTES, ProtocolError, decode_reply, encode_request
from clockwork.contracts.errors import DaemonError, DaemonUnavailableError
from clockwork.contracts.instance_lock import socket_in_use
from clockwork.contracts.node_verdict import NodeVerdict, NodeVerdicts, VerdictFormatError


class DaemonClient:
    """A connection to one daemon: its control socket (local) or, with CURVE keys, its peer socket.

    ``target`` is the daemon's :class:`DaemonPaths`, the path of its control socket, or a ZeroMQ
    endpoint (``ipc://...``; ``tcp://...`` needs ``curve``). Not thread-safe: one client per thread.
    """

    def __init__(
        self,
        target: DaemonPaths | Path | str,
        timeout_s: float = 5.0,
        *,
        curve: tuple[CurveKeys, bytes] | None = None,
    ) -> None:
        if isinstance(target, DaemonPaths):
            self.endpoint = target.control_endpoint
            self.node = target.node
        elif isinstance(target, Path):
            self.endpoint = f"ipc://{target}"
            self.node = ""
        else:
            self.endpoint = target
            self.node = ""
        if self.endpoint.startswith("tcp://") and curve is None:
            raise ValueError("a tcp:// daemon endpoint needs CURVE keys (curve=(own keys, server public key))")
        self.timeout_s = timeout_s
        self._curve = curve
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None

    @classmethod
    def from_config(cls, cfg: DaemonConfig, node: str | None = None) -> DaemonClient:
        """A client for ``node``'s daemon (default: this node's), with the configured timeout."""
        return cls(DaemonPaths.from_config(cfg, node), cfg.request_timeout_s)

    @classmethod
    def for_this_node(cls, config_path: str | Path | None = None, timeout_s: float | None = None) -> DaemonClient:
        """This node's daemon, found through Clockwork's configuration (``config_path``, else
        ``$CLOCKWORK_CONFIG``, else the default file): for programs that read no Clockwork configuration
        themselves, such as TorchPass's node agents. Raises :class:`ConfigError` for a bad configuration."""
        from clockwork.contracts.config import load_config  # lazy: most clients are given their paths

        client = cls.from_config(load_config(Path(config_path) if config_path else None).config.daemon)
        if timeout_s is not None:
            client.timeout_s = timeout_s
        return client

    @classmethod
    def for_peer(cls, endpoint: str, keys: CurveKeys, server_public: bytes, timeout_s: float = 5.0) -> DaemonClient:
        """A client for another daemon's CURVE socket (``tcp://ADDR:PORT``), as a daemon (root) makes it."""
        return cls(endpoint, timeout_s, curve=(keys, server_public))

    # ----- plumbing -------------------------------------------------------------------------

    def _where(self) -> str:
        return f"clockworkd on {self.node}" if self.node else f"clockworkd at {self.endpoint}"

    def _connect(self) -> zmq.Socket[bytes]:
        if self._socket is not None:
            return self._socket
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://") :])
            if not path.exists():
                raise DaemonUnavailableError(f"no {self._where()}: {path} does not exist (is the daemon running?)")
            if not socket_in_use(path):
                raise DaemonUnavailableError(f"no {self._where()}: nothing listens on {path} (the daemon died)")
        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if self._curve is not None:
            keys, server_public = self._curve
            sock.curve_secretkey = keys.secret
            sock.curve_publickey = keys.public
            sock.curve_serverkey = server_public
        sock.connect(self.endpoint)
        self._socket = sock
        return sock

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def close(self) -> None:
        """Close the socket and the client's ZeroMQ context."""
        self._drop_socket()
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """One round trip; the reply's fields (without ``v``/``ok``), or DaemonError / DaemonUnavailableError."""
        try:
            payload = encode_request(op, **fields)
        except ProtocolError as exc:
            raise DaemonError(f"invalid request: {exc.message}", code=exc.code) from None
        sock = self._connect()
        try:
            sock.send_multipart([b"", payload], zmq.NOBLOCK)
        except zmq.Again:
            self._drop_socket()
            raise DaemonUnavailableError(f"cannot send to {self._where()} (not connected)") from None
        if not sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            self._drop_socket()
            raise DaemonUnavailableError(f"no answer from {self._where()} within {self.timeout_s:g} s")
        frames = sock.recv_multipart()
        body = frames[-1]
        try:
            reply = decode_reply(body)
        except ProtocolError as exc:
            self._drop_socket()
            raise DaemonError(f"unreadable reply from {self._where()}: {exc.message}", code="bad_reply") from None
        if not reply["ok"]:
            error = reply["error"]
            raise DaemonError(f"{self._where()} refused {op}: {error['message']}", code=error["code"])
        return {k: v for k, v in reply.items() if k not in ("v", "ok")}

    # ----- operations -----------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        """{node, pid, version, time}: the daemon is alive and serving."""
        return self.request("ping")

    def lens(self) -> dict[str, Any]:
        """Fleet Lens's latest snapshot on this node (``enabled`` False, with ``state``, when it is off)."""
        return self.request("lens")

    def gpus(self) -> dict[str, Any]:
        """The GPU health watch's view: each GPU's reading, health, signals, ranks (``enabled`` False when off)."""
        return self.request("gpus")

    def status(self) -> dict[str, Any]:
        """The daemon's health: pid, uptime, peer plane, jobs (those the caller may see), recent events."""
        return self.request("status")

    def register_job(
        self, job_id: int, uid: int, user: str, nodes: list[str], options: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Register a job (root/SlurmUser only; idempotent). Returns {job, created}."""
        return self.request("register_job", job_id=job_id, uid=uid, user=user, nodes=nodes, options=options or {})

    def unregister_job(self, job_id: int) -> dict[str, Any]:
        """Mark a job ended; its events stay readable. Returns the job record."""
        return self.request("unregister_job", job_id=job_id)["job"]

    def post_event(
        self, job_id: int, kind: str, fields: dict[str, Any] | None = None, *, node: str | None = None
    ) -> dict[str, Any]:
        """Record an event for a job; returns {seq, time}. ``node`` (the origin) is for relaying daemons."""
        extra: dict[str, Any] = {} if node is None else {"node": node}
        return self.request("post_event", job_id=job_id, kind=kind, fields=fields or {}, **extra)

    def job_events(self, job_id: int, since: float | None = None) -> list[dict[str, Any]]:
        """Every event of a job (time > ``since`` when given), oldest first, paging through long logs."""
        out: list[dict[str, Any]] = []
        after: int | None = None
        while True:
            fields: dict[str, Any] = {"job_id": job_id}
            if since is not None:
                fields["since"] = since
            if after is not None:
                fields["after"] = after
            reply = self.request("job_events", **fields)
            out += reply["events"]
            if not reply["more"] or not reply["events"]:
                return out
            after = reply["events"][-1]["seq"]

    def borrow(self, job_id: int, lost_node: str = "") -> dict[str, Any]:
        """Ask for a borrowed node for ``job_id`` (its owner only); the reply carries the request to poll."""
        fields: dict[str, Any] = {"job_id": job_id}
        if lost_node:
            fields["lost_node"] = lost_node
        return self.request("borrow", **fields)

    def borrow_status(self, job_id: int, request: int | None = None) -> list[dict[str, Any]]:
        """The borrow requests of ``job_id`` on this node (one with ``request``)."""
        fields: dict[str, Any] = {"job_id": job_id}
        if request is not None:
            fields["request"] = request
        return list(self.request("borrow_status", **fields)["requests"])

    def borrow_release(self, job_id: int, why: str = "") -> list[int]:
        """Give back every node ``job_id`` borrowed (cancels its holder allocations); the holders cancelled."""
        fields: dict[str, Any] = {"job_id": job_id}
        if why:
            fields["why"] = why[:256]
        return list(self.request("borrow_release", **fields)["released"])

    def node_verdicts(self, job_id: int, after: int = 0, wait_s: float = 0.0) -> NodeVerdicts:
        """The node watch's verdicts on ``job_id``'s nodes newer than ``after`` (its owner or root), waiting up to
        ``wait_s`` for one, with the newest verdict number. The request's deadline is the wait plus this client's
        timeout. A verdict the daemon sends malformed raises DaemonError."""
        reply = self._long_request(wait_s, "node_verdicts", job_id=job_id, after=after, wait_ms=int(wait_s * 1000))
        try:
            verdicts = [NodeVerdict.from_wire(doc) for doc in reply.get("verdicts", [])]
        except VerdictFormatError as exc:
            raise DaemonError(f"unreadable verdict from {self._where()}: {exc}", code="bad_reply") from None
        return NodeVerdicts(verdicts, int(reply.get("seq", 0)), bool(reply.get("enabled")), str(reply.get("state", "")))

    def _long_request(self, wait_s: float, op: str, **fields: Any) -> dict[str, Any]:
        saved = self.timeout_s
        self.timeout_s = saved + wait_s
        try:
            return self.request(op, **fields)
        finally:
            self.timeout_s = saved

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs registered on the node that the caller may see (all for root/SlurmUser)."""
        return self.request("jobs")["jobs"]
