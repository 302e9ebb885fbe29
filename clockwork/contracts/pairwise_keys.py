"""Pairwise packet keys: node A and node B share a MAC key no third node can compute, so a node speaks only
for itself on the fabric.

LinkPass's heartbeats and down notices steer every node's routes; a key all daemons share lets root on any
node forge them for any other. Each node keeps its own CURVE key pair (``clockwork keys generate --name NODE``,
what the daemon-to-daemon plane uses): the key of the pair (A, B) is the X25519 shared secret of A's secret
and B's public key (equal to B's secret with A's public key), hashed with both public keys and a label per
use (``clockwork-linkpass``), so it is the same on both ends and one node's secret gives only its own pairs.
A cluster that installs one shared key pair on every node still works: every pair then derives one key.

Rotation without downtime: a node accepts a peer's packets under every combination of its own current and
previous secret (``SECRET.previous`` beside its secret key file) and the peer's current and next public key
(``NODE.key`` and ``NODE.next.key`` in the key folder), and sends under its current secret and the peer's
current public key. The admin guide gives the order of the steps. The folder is read again when a file in it
changes (checked at most once a second), so no daemon restarts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq.auth
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from zmq.utils import z85

from clockwork.contracts.curve_keys import CurveKeyError

log = logging.getLogger("clockwork.keys")

KEY_BYTES = 32
RELOAD_EVERY_S = 1.0
NEXT_SUFFIX = ".next.key"  # NODE.next.key: the public key NODE is changing to
PREVIOUS_SUFFIX = ".previous"  # SECRET.previous: this node's secret key it is changing from


def raw(z85_key: bytes) -> bytes:
    """A 32-byte key from pyzmq's z85 text."""
    value = z85.decode(z85_key)
    if len(value) != KEY_BYTES:
        raise CurveKeyError(f"a CURVE key is {KEY_BYTES} bytes, not {len(value)}")
    return value


def pair_key(label: bytes, secret: bytes, own_public: bytes, peer_public: bytes) -> bytes:
    """The (own, peer) key for ``label``: X25519(secret, peer_public) hashed with both public keys, in a fixed
    order so that both ends derive the same key. Raw 32-byte keys; CurveKeyError for a degenerate peer key."""
    try:
        shared = X25519PrivateKey.from_private_bytes(secret).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # a low-order public key gives an all-zero secret: refused
        raise CurveKeyError(f"unusable peer public key: {exc}") from None
    low, high = sorted((own_public, peer_public))
    return hashlib.blake2b(shared + low + high, digest_size=KEY_BYTES, person=b"clockwork-pair", key=label).digest()


def _secret_of(path: Path) -> tuple[bytes, bytes]:
    """(public, secret), raw, from a pyzmq secret key file that only its owner may read."""
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(f"secret key {path} is readable by other users (chmod 600 it)")
    if info.st_uid != os.geteuid():
        raise CurveKeyError(f"secret key {path} belongs to uid {info.st_uid}, not to the daemon's user")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read {path}: {exc}") from None
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key")
    return raw(public), raw(secret)


def _public_of(path: Path) -> bytes | None:
    if not path.is_file():
        return None
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        log.warning("ignoring public key %s: %s", path, exc)
        return None
    return raw(public)


@dataclass
class PairwiseKeys:
    """Per-peer MAC keys for one use (``label``), from this node's secret key file and the key folder.

    :meth:`send_key` and :meth:`accept_keys` are what LinkPass calls per packet (``linkpass.keyring.KeyRing``)."""

    label: bytes
    secret_file: Path
    key_dir: Path
    peers: list[str]
    clock: Callable[[], float] = time.monotonic
    _send: dict[str, bytes] = field(default_factory=dict)
    _accept: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    _stamp: tuple[tuple[str, int, int, int, int], ...] = ()
    _checked: float = -1e18
    version: int = 0  # changes at every load: users that copy the keys (Lens's pacer) know when to copy again

    def __post_init__(self) -> None:
        self.load()  # CurveKeyError at start: the host says why its component is off

    def _files(self) -> Iterable[Path]:
        yield self.secret_file
        yield Path(str(self.secret_file) + PREVIOUS_SUFFIX)
        yield self.key_dir
        for peer in self.peers:
            yield self.key_dir / f"{peer}.key"
            yield self.key_dir / f"{peer}{NEXT_SUFFIX}"

    def _current_stamp(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """What changes when a key file is written, replaced, removed or re-permissioned."""
        out = []
        for path in self._files():
            try:
                info = path.stat()
                out.append((str(path), info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_mode))
            except OSError:
                out.append((str(path), 0, 0, -1, 0))
        return tuple(out)

    def load(self) -> None:
        """Read the key files and derive every peer's keys (all or nothing: a bad file keeps the old keys)."""
        stamp = self._current_stamp()
        own_public, secret = _secret_of(self.secret_file)
        secrets = [(own_public, secret)]
        previous = Path(str(self.secret_file) + PREVIOUS_SUFFIX)
        if previous.exists():
            secrets.append(_secret_of(previous))
        send: dict[str, bytes] = {}
        accept: dict[str, tuple[bytes, ...]] = {}
        for peer in self.peers:
            current = _public_of(self.key_dir / f"{peer}.key") or own_public  # no NODE.key: one shared pair
            upcoming = _public_of(self.key_dir / f"{peer}{NEXT_SUFFIX}")
            send[peer] = pair_key(self.label, secret, own_public, current)
            keys = [send[peer]]
            for pub, sec in secrets:
                for theirs in (current, upcoming):
                    if theirs is not None:
                        candidate = pair_key(self.label, sec, pub, theirs)
                        if candidate not in keys:
                            keys.append(candidate)
            accept[peer] = tuple(keys)
        self._send, self._accept, self._stamp = send, accept, stamp
        self.version += 1

    def maybe_reload(self) -> None:
        """Read the keys again if a key file changed (at most once a second); keep the old ones on error."""
        now = self.clock()
        if now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        if self._current_stamp() == self._stamp:
            return
        try:
            self.load()
            log.info("%s: pairwise keys reloaded from %s", self.label.decode(), self.key_dir)
        except (CurveKeyError, OSError) as exc:
            log.error("%s: key files changed but cannot be used, keeping the old keys: %s", self.label.decode(), exc)
            self._stamp = self._current_stamp()  # say it once per change, not every second

    def send_key(self, peer: str) -> bytes:
        self.maybe_reload()
        return self._send[peer]

    def accept_keys(self, peer: str) -> tuple[bytes, ...]:
        self.maybe_reload()
        return self._accept.get(peer, ())
