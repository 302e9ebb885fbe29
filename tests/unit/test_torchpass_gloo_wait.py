"""gloo work that its group's abort cannot free is given up once the group was aborted, and otherwise waited for
exactly as torch waits.

Two real gloo processes. Rank 1 is alive and never takes part in the last send, all-reduce and reduce-scatter
of rank 0: they stay pending, as a send queued on a just-closed connection does (:mod:`torchpass.sharded.gloo_wait`),
and no timeout of gloo's is reached (the group's is ten minutes). Each wait must end with :class:`WaitAbandoned`
once ``cut_off()`` says the group was aborted, leaving the work pending; before that, the same routes carry a
send, an all-reduce and a reduce-scatter that rank 1 joins late, with their results.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import schedules
    from torchpass.sharded.gloo_wait import HelperWaiter, WaitAbandoned, wait_polling

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(minutes=10))
    if rank == 1:  # joins each of rank 0's first operations once rank 0 has polled it a while
        for step in (1, 2):
            data = torch.zeros(1000)
            dist.recv(data, 0)
            print(f"received {step}: {data.sum().item():.0f}", flush=True)
        store.wait(["polled-allreduce"])
        dist.all_reduce(torch.full((4,), 2.0))
        store.wait(["polled-reduce-scatter"])
        dist.reduce_scatter_tensor(torch.zeros(2), torch.arange(4.0))
        store.wait(["done"])  # alive to the end, and never takes part in rank 0's last three
        os._exit(0)

    waiter = HelperWaiter()
    polls = []

    def cut_off_after(n, key=None):
        def cut_off():
            polls.append(1)
            if key is not None and len(polls) == 2:
                store.set(key, "1")  # rank 1 may join now: the wait has been pending for two polls
            return n is not None and len(polls) >= n
        polls.clear()
        return cut_off

    # 1: outside a guarded step, torch's own wait; 2: inside one, a send that completes.
    schedules._wait_batch_p2p([dist.isend(torch.full((1000,), 1.0), 1)])
    with waiter.guarding(cut_off_after(None)):
        schedules._wait_batch_p2p([dist.isend(torch.full((1000,), 2.0), 1)])
    # 3: collectives rank 1 joins late: an all-reduce polled, a reduce-scatter on the helper thread.
    total = torch.full((4,), 1.0)
    wait_polling(dist.all_reduce(total, async_op=True), cut_off_after(None, "polled-allreduce"))
    print(f"all-reduce after {len(polls)} polls: {total.tolist()}", flush=True)
    shard = torch.zeros(2)
    work = dist.reduce_scatter_tensor(shard, torch.arange(4.0), async_op=True)
    waiter.wait([work], cut_off_after(None, "polled-reduce-scatter"), "a reduce-scatter")
    print(f"reduce-scatter: {shard.tolist()}, given up: {waiter.given_up}", flush=True)
    # 4: a send, an all-reduce and a reduce-scatter rank 1 never joins, given up once the group is cut off.
    pending = dist.isend(torch.full((1000,), 3.0), 1)
    with waiter.guarding(cut_off_after(3)):
        try:
            schedules._wait_batch_p2p([pending])
            print("send returned", flush=True)
        except WaitAbandoned as exc:
            print(f"after {len(polls)} polls: {exc}; given up: {waiter.given_up}", flush=True)
    reduced = dist.all_reduce(torch.ones(4), async_op=True)
    try:
        wait_polling(reduced, cut_off_after(3))
        print("all-reduce returned", flush=True)
    except WaitAbandoned as exc:
        print(f"after {len(polls)} polls: {exc}", flush=True)
    scattered = dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), async_op=True)
    try:
        waiter.wait([scattered], cut_off_after(3), "a reduce-scatter")
        print("reduce-scatter returned", flush=True)
    except WaitAbandoned as exc:
        print(f"after {len(polls)} polls: {exc}; given up: {waiter.given_up}", flush=True)
    print(f"still pending: {not pending.is_completed()} {not reduced.is_completed()}", flush=True)
    store.set("done", "1")
    os._exit(0)  # the pending work would otherwise hold the exit up to gloo's timeout
    """
)

_GIVEN_UP = "given up: its group was aborted for a newer generation while it was pending"


def test_gloo_work_pending_in_a_cut_off_group_is_given_up_and_otherwise_waited_for(tmp_path: Path) -> None:
    script = tmp_path / "gloo_wait.py"
    script.write_text(_SCRIPT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    (out0, err0), (out1, err1) = outputs
    assert out1.splitlines() == ["received 1: 1000", "received 2: 2000"], (out1, err1)
    lines = out0.splitlines()
    assert len(lines) == 6, (out0, err0)
    polls = int(lines[0].split()[2])
    assert polls >= 2 and lines[0].endswith(": [3.0, 3.0, 3.0, 3.0]"), lines  # joined after two polls
    assert lines[1:] == [
        "reduce-scatter: [0.0, 2.0], given up: 0",
        f"after 3 polls: a pipeline send/recv {_GIVEN_UP}; given up: 1",
        f"after 3 polls: a collective {_GIVEN_UP}",
        f"after 3 polls: a reduce-scatter {_GIVEN_UP}; given up: 2",
        "still pending: True True",
    ], (out0, err0)
