"""A job's own secret, and the ZeroMQ CURVE keys derived from it: how a TorchPass job's processes know each other.

TorchPass's agents, coordinator replicas, proxies and ranks talk over TCP between nodes. Only processes of
the job may take part: a stranger who can reach a port must not be able to ask for a migration, forge a
heartbeat or read training state. The launcher draws a random 32-byte secret per job and hands it to every
process of the job in the environment (``TORCHPASS_JOB_KEY``, hex), which only the job's user and root can
read. From it, every process derives the same two CURVE key pairs:

* the *server* pair: every listening socket serves with it, so a client that does not know the secret
  cannot even complete the handshake (it needs the server's public key);
* the *client* pair: every connecting socket presents it, and each server's ZAP handler accepts a client
  only if it presents exactly that public key.

Traffic is encrypted and both ends are authenticated by the one job secret, with no key files and no
certificate authority. The derivation is keyed BLAKE2b, so nothing about the secret leaks from the public
keys. ``clockwork migrate`` gets the secret from the job's ``torchpass.coordinator`` event, which the node
daemon shows only to the job's owner and root. This module imports neither torch nor TorchPass: TorchPass
imports it (the dependency runs torchpass -> clockworkd).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
from zmq.utils import z85

__all__ = ["ENV_JOB_KEY", "JobKey", "JobKeyError"]

log = logging.getLogger("clockwork.jobkey")

ENV_JOB_KEY = "TORCHPASS_JOB_KEY"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_zap_lock = threading.Lock()
_zap_threads: dict[int, threading.Thread] = {}  # id(context) -> its ZAP handler


class JobKeyError(ValueError):
    """A job key that cannot be used (the message says where it came from and what is wrong)."""


@dataclass(frozen=True)
class JobKey:
    """One job's secret (32 bytes)."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != 32:
            raise JobKeyError(f"a job key is 32 bytes, not {len(self.secret)}")

    def __repr__(self) -> str:  # never print the secret
        return "JobKey(<secret>)"

    @classmethod
    def new(cls) -> JobKey:
        """A fresh random key (a launcher makes one per job)."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str, *, where: str = ENV_JOB_KEY) -> JobKey:
        """Parse the hex form; JobKeyError names ``where`` the value came from."""
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError:
            raise JobKeyError(f"{where}: not a hex string") from None
        if len(raw) != 32:
            raise JobKeyError(f"{where}: {len(raw)} bytes; a job key is 32 bytes (64 hex digits)")
        return cls(raw)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobKey | None:
        """The key in ``TORCHPASS_JOB_KEY``, or None when it is not set."""
        env = os.environ if environ is None else environ
        text = env.get(ENV_JOB_KEY, "")
        return cls.from_hex(text) if text.strip() else None

    @property
    def hex(self) -> str:
        return self.secret.hex()

    def _pair(self, role: bytes) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys for ``role``; any 32 bytes are a valid Curve25519 secret key."""
        seed = hashlib.blake2b(role, key=self.secret, digest_size=32, person=b"clockwork-job").digest()
        secret = z85.encode(seed)
        return zmq.curve_public(secret), secret

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before bind) a CURVE server that accepts only this job's clients."""
        public, secret = self._pair(b"server")
        _ensure_zap_handler(sock.context, z85.decode(self._pair(b"client")[0]))
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = b"clockwork-job"

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before connect) a CURVE client of this job's servers."""
        public, secret = self._pair(b"client")
        sock.curve_serverkey = self._pair(b"server")[0]
        sock.curve_publickey = public
        sock.curve_secretkey = secret


def _ensure_zap_handler(context: zmq.Context[zmq.Socket[bytes]], allowed: bytes) -> None:
    """Start the context's ZAP handler once; it accepts CURVE clients whose public key is ``allowed``."""
    with _zap_lock:
        if id(context) in _zap_threads and _zap_threads[id(context)].is_alive():
            return
        # Not context.socket(): Context.destroy() closes the sockets it tracks, and closing this one under its
        # thread's blocking recv aborts libzmq. Untracked, it sees ContextTerminated and closes itself.
        sock: zmq.Socket[bytes] = zmq.Socket(context, zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        thread = threading.Thread(target=_zap_loop, args=(sock, allowed), name="torchpass-zap", daemon=True)
        thread.start()
        _zap_threads[id(context)] = thread


def _zap_loop(sock: zmq.Socket[bytes], allowed: bytes) -> None:
    """Answer ZAP requests (RFC 27) until the context is terminated."""
    try:
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.ContextTerminated:
                return
            version, request_id = frames[0], frames[1]
            mechanism, credentials = frames[5], frames[6:]
            ok = mechanism == b"CURVE" and credentials[:1] == [allowed]
            if not ok:
                address = frames[3].decode(errors="replace")
                log.warning("refused a connection from %s: not a process of this job (%s)", address, mechanism)
            reply = [version, request_id, b"200" if ok else b"400", b"OK" if ok else b"not this job", b"job", b""]
            try:
                sock.send_multipart(reply)
            except zmq.ContextTerminated:
                return
    finally:
        sock.close(linger=0)
