"""ZeroMQ CURVE keys of the daemon-to-daemon plane: made by the admin, checked before they are trusted.

The admin runs ``clockwork keys generate --dir /etc/clockwork/curve`` once and installs the folder on
every node (root only). The files are pyzmq's certificate format: ``NAME.key`` (public key) and
``NAME.key_secret`` (public + secret key). A daemon serves with its own key pair and accepts a
client only if the client's public key is one of the ``*.key`` files in the folder of its public
key: the admin-installed set. A local user cannot read the secret key, so cannot pose as a daemon.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from clockwork.contracts.daemon_paths import DaemonPaths


class CurveKeyError(Exception):
    """The configured keys cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair (z85-encoded, as libzmq takes them)."""

    public: bytes
    secret: bytes


def generate(key_dir: Path, name: str = "daemon") -> tuple[Path, Path]:
    """Create ``NAME.key`` and ``NAME.key_secret`` in ``key_dir`` (secret mode 0600); refuse to overwrite."""
    public = key_dir / f"{name}.key"
    secret = key_dir / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise CurveKeyError(f"{path} already exists; remove it first to make a new key pair")
    key_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    old_umask = os.umask(0o077)
    try:
        public_file, secret_file = zmq.auth.create_certificates(key_dir, name)
    finally:
        os.umask(old_umask)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o644)
    return Path(public_file), Path(secret_file)


def load_daemon_keys(paths: DaemonPaths) -> CurveKeys:
    """This daemon's key pair, after checking that the secret key is private; CurveKeyError otherwise."""
    secret_path, public_path = paths.curve_secret_key, paths.curve_public_key
    for path in (secret_path, public_path):
        if not path.is_file():
            raise CurveKeyError(f"no CURVE keys at {path} (make them with `clockwork keys generate`)")
    info = secret_path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(f"secret key {secret_path} is readable by other users (chmod 600 it)")
    if info.st_uid != os.geteuid():
        raise CurveKeyError(f"secret key {secret_path} belongs to uid {info.st_uid}, not to the daemon's user")
    try:
        public, secret = zmq.auth.load_certificate(secret_path)
        listed_public, _ = zmq.auth.load_certificate(public_path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE keys {secret_path}, {public_path}: {exc}") from None
    if secret is None:
        raise CurveKeyError(f"{secret_path} holds no secret key")
    if public != listed_public:
        raise CurveKeyError(f"{public_path} is not the public key of {secret_path}")
    return CurveKeys(public=public, secret=secret)


def peer_public_key(paths: DaemonPaths, node: str, own: CurveKeys) -> bytes:
    """The server key to expect from ``node``'s daemon: ``NODE.key`` in the key folder, else the shared key."""
    candidate = paths.curve_keys_dir / f"{node}.key"
    if candidate.is_file():
        public, _ = zmq.auth.load_certificate(candidate)
        return public
    return own.public
