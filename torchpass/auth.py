"""Every TorchPass socket is CURVE-encrypted and admits only processes holding the job's key.

The key (:class:`clockwork.contracts.jobkey.JobKey`) comes from ``TORCHPASS_JOB_KEY``: the launcher makes one per job
(``torchpass run`` in a batch script or with ``--local``) and passes it to every agent and rank; a
``srun torchpass run`` step must be given one by the user. Listening sockets call :func:`serve` before they
bind, connecting sockets :func:`connect_as_client` before they connect. Without a key nothing is served:
there is no unauthenticated mode.
"""

from __future__ import annotations

import zmq

from clockwork.contracts.coordinator_client import read_coordinator_file, write_coordinator_file
from clockwork.contracts.jobkey import ENV_JOB_KEY, JobKey, JobKeyError

__all__ = [
    "ENV_JOB_KEY",
    "JobKey",
    "JobKeyError",
    "connect_as_client",
    "job_key",
    "read_coordinator_file",
    "serve",
    "write_coordinator_file",
]


def job_key() -> JobKey:
    """This job's key from the environment; JobKeyError says how to get one when it is missing."""
    key = JobKey.from_environ()
    if key is None:
        raise JobKeyError(
            f"{ENV_JOB_KEY} is not set: TorchPass's sockets admit only the job's own processes. `torchpass run` "
            "in the batch script (or with --local) makes a key itself; for `srun torchpass run`, export one "
            f"first: export {ENV_JOB_KEY}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return key


def serve(sock: zmq.Socket[bytes]) -> None:
    """Make a listening socket a CURVE server of this job (call before bind)."""
    job_key().serve(sock)


def connect_as_client(sock: zmq.Socket[bytes]) -> None:
    """Make a connecting socket a CURVE client of this job (call before connect)."""
    job_key().connect_as_client(sock)
