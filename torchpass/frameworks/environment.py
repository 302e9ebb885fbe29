"""The environment ``torchrun`` gives a rank, which transparent mode gives the script instead.

Scripts written for ``torchrun`` find their rank in ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; frameworks look
further. Lightning picks its cluster environment by what is set: ``TORCHELASTIC_RUN_ID`` selects its TorchElastic
environment (rank = ``RANK``), ahead of its Slurm environment, whose ``SLURM_PROCID`` would be the node agent's
task, not the TorchPass slot. accelerate reads the same variables. The rank is the slot, which never changes (a
replacement takes the slot of the rank it replaces); the group rank is the slot's "node" in a layout of
``LOCAL_WORLD_SIZE`` ranks per node, as torchrun numbers them.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["torchrun_environment"]


def torchrun_environment(env: MutableMapping[str, str], *, slot: int, world_size: int, host: str, job_id: str) -> None:
    """Set in ``env`` what ``torchrun`` would set for rank ``slot`` of ``world_size`` (what a launcher or the
    user already set for the local layout, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, is kept)."""
    env["RANK"] = str(slot)
    env["WORLD_SIZE"] = str(world_size)
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    env.setdefault("MASTER_ADDR", host)
    env.setdefault("MASTER_PORT", "29500")
    local_world = max(1, int(env["LOCAL_WORLD_SIZE"]))
    env.setdefault("TORCHELASTIC_RUN_ID", f"torchpass-{job_id or 'local'}")
    env["GROUP_RANK"] = env["ROLE_RANK"] = str(slot // local_world)
    env.setdefault("ROLE_NAME", "default")
    env["GROUP_WORLD_SIZE"] = str(max(1, world_size // local_world))
    env["ROLE_WORLD_SIZE"] = str(world_size)
    env.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
    env.setdefault("TORCHELASTIC_MAX_RESTARTS", "0")
