"""A generation's gloo groups are retired, not destroyed on the spot, so that leaving a generation never waits for a
collective the rank already gave up (issue 43's soak).

The defect: a survivor gave a DDP bucket's all-reduce up within a millisecond of the abort, then waited 30 s in
``destroy_process_group``: destroying a gloo group joins its worker threads, and a worker stuck in a send gloo never
fails (:mod:`torchpass.sharded.gloo_wait`) held that join for the group's whole timeout. Here a peer that stays
connected but silent keeps rank 0's all-reduce pending, as that send was: without the retirement the destroy
returns only once gloo's timeout has ended the work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from torchpass.rank.retired_groups import MARGIN_S, RetiredGroups

PENDING = textwrap.dedent(
    """
    import datetime, json, sys, time, torch, torch.distributed as dist
    from pathlib import Path
    from torchpass.rank.retired_groups import RetiredGroups

    store_file, rank, retire = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "retire"
    released = Path(store_file + ".released")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=6))
    dist.barrier()
    if rank == 1:  # connected but silent: rank 0's all-reduce stays pending until gloo's timeout
        while not released.exists():
            time.sleep(0.05)
        sys.exit(0)
    work = dist.all_reduce(torch.ones(8), async_op=True)
    retired = RetiredGroups()
    if retire:
        retired.retire([dist.group.WORLD], 6.0)
    dist.destroy_process_group()
    pending_after_destroy = not work.is_completed()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the next generation
    total = torch.ones(2)
    dist.all_reduce(total)
    print(json.dumps({"pending_after_destroy": pending_after_destroy, "held": len(retired),
                      "next_generation_sum": total.tolist()}), flush=True)
    released.touch()
    """
)


def _rank0(tmp_path: Path, how: str) -> dict[str, object]:
    script = tmp_path / "pending.py"
    script.write_text(PENDING)
    store = tmp_path / f"pg-{how}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(store), str(r), how], env=env, stdout=subprocess.PIPE)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    result: dict[str, object] = json.loads(outputs[0].strip().splitlines()[-1])
    return result


def test_a_retired_group_is_destroyed_without_waiting_for_its_pending_work(tmp_path: Path) -> None:
    retired = _rank0(tmp_path, "retire")
    assert retired == {"pending_after_destroy": True, "held": 1, "next_generation_sum": [1.0, 1.0]}
    # The same without the retirement: the destroy returned only once gloo's timeout had ended the work.
    plain = _rank0(tmp_path, "plain")
    assert plain == {"pending_after_destroy": False, "held": 0, "next_generation_sum": [1.0, 1.0]}


def test_retired_groups_are_released_once_their_timeout_has_passed() -> None:
    now = [100.0]
    retired = RetiredGroups(clock=lambda: now[0])
    retired.retire(["g1-world", "g1-user", None], 30.0)  # None: a subgroup this rank is not in
    assert len(retired) == 2
    now[0] += 30.0 + MARGIN_S - 1
    retired.retire(["g2-world"], 30.0)
    assert len(retired) == 3  # generation 1's work may still be pending: still held
    now[0] += 2
    retired.retire([], 30.0)
    assert len(retired) == 1  # generation 1 released; generation 2 held


def test_the_gloo_backend_retires_every_group_of_the_generation_it_destroys() -> None:
    import torch.distributed as dist

    from torchpass.config import TorchPassConfig
    from torchpass.rank.backends import GlooBackend

    backend = GlooBackend(TorchPassConfig(collective_timeout_s=3))
    backend.form_group(dist.HashStore(), 0, 1, 0, set())
    assert backend.new_subgroup([0]) is not None
    backend.destroy()
    assert len(backend.retired) == 3 and not dist.is_initialized()  # the default group, the user group, a subgroup
    backend.form_group(dist.HashStore(), 0, 1, 1, set())
    backend.destroy()
    assert len(backend.retired) == 5  # generation 0's are held until its 3 s timeout (and the margin) have passed
