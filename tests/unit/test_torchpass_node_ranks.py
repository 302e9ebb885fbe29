"""G ranks per node under Slurm, without Slurm and without torch: how G is chosen, how slots are numbered per
node, what each rank is told about its place, what the batch launcher hands every agent, and which spares fill
the slots a node crash or a rank crash vacates."""

from __future__ import annotations

import pytest

from torchpass.coordinator.placement import choose_spares, slot_moves
from torchpass.coordinator.records import agent_of, local_of, node_key, worker_id
from torchpass.launch.node_ranks import gpu_count, rank_environment, ranks_per_node
from torchpass.launch.node_steps import NodeSteps
from torchpass.launch.slurm_layout import SlurmLayout, SlurmLayoutError, training_nodes

# ----- G: the order of the sources ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "nproc_per_node", "batch", "count", "source"),
    [
        # the command line wins over everything the allocation says
        ({"SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "4"}, 2, True, 2, "--nproc-per-node"),
        # what the batch launcher decided for every agent wins over the agent's own environment
        ({"TORCHPASS_RANKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "8"}, None, False, 4, "decided by the batch"),
        # one rank per GPU: --gpus-per-node (the same on every node) before this node's own count
        ({"SLURM_GPUS_PER_NODE": "h100:8", "SLURM_GPUS_ON_NODE": "4"}, None, False, 8, "SLURM_GPUS_PER_NODE"),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "2"}, None, True, 4, "SLURM_GPUS_ON_NODE=4"),
        # no GPUs: the job's --ntasks-per-node, in the batch script only (inside a step it counts the agents)
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "64"}, None, True, 2, "SLURM_NTASKS_PER_NODE=2"),
        ({"SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_ON_NODE": "64"}, None, False, 1, "no GPUs"),
        # CPUs are never a default: a 64-CPU node without GPUs runs one rank unless asked for more
        ({"SLURM_CPUS_ON_NODE": "64", "SLURM_JOB_CPUS_PER_NODE": "64(x4)"}, None, True, 1, "no GPUs"),
        ({"SLURM_GPUS_ON_NODE": "0"}, None, True, 1, "no GPUs"),
    ],
)
def test_ranks_per_node_follows_the_documented_order(
    env: dict[str, str], nproc_per_node: int | None, batch: bool, count: int, source: str
) -> None:
    chosen = ranks_per_node(env, nproc_per_node, batch=batch)
    assert chosen.count == count and source in chosen.source, chosen
    assert str(count) in str(chosen)


@pytest.mark.parametrize(
    ("expr", "count"), [("8", 8), ("h100:8", 8), ("gpu:h100:4", 4), ("a100:2,v100:1", 3), ("8(S:0-1)", 8)]
)
def test_gpu_counts_in_slurms_spellings(expr: str, count: int) -> None:
    assert gpu_count("SLURM_GPUS_PER_NODE", expr) == count


@pytest.mark.parametrize(
    ("env", "nproc_per_node", "message"),
    [
        ({"SLURM_GPUS_PER_NODE": "h100:many"}, None, "cannot read a GPU count"),
        ({"TORCHPASS_RANKS_PER_NODE": "0"}, None, "not a positive integer"),
        ({}, 0, "at least one rank"),
    ],
)
def test_bad_sources_of_g_say_what_is_wrong(env: dict[str, str], nproc_per_node: int | None, message: str) -> None:
    with pytest.raises(SlurmLayoutError, match=message):
        ranks_per_node(env, nproc_per_node, batch=True)


def test_each_rank_gets_its_local_index_and_a_gpu_of_its_own() -> None:
    slurm_gpus = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # as Slurm sets it for a step holding GPUs 4-7 of the node
    assert rank_environment(dict(slurm_gpus, OMP_NUM_THREADS="6"), 3, 4) == {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    # a CPU node: no GPU check; several ranks and no thread count of the user's: one thread each, as torchrun sets
    assert rank_environment({}, 1, 2) == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    assert rank_environment({}, 0, 1) == {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # one rank: torch's own default
    with pytest.raises(SlurmLayoutError, match="sees 2 GPU"):  # 4 ranks cannot share 2 GPUs one each
        rank_environment({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, 4)
    with pytest.raises(ValueError, match="local index 2"):
        rank_environment({}, 2, 2)


# ----- slots per node: torchrun's numbering ------------------------------------------------------


def _env(procid: int, ntasks: int = 5, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NODEID": str(procid),
        "SLURM_STEP_NODELIST": f"127.0.0.[1-{ntasks}]",
        "SLURMD_NODENAME": f"127.0.0.{procid + 1}",
        "CLOCKWORK_SPARES": "standby",
        **extra,
    }


def test_a_nodes_slots_are_contiguous_as_torchrun_numbers_them() -> None:
    """4 training nodes of 2 ranks and 1 standby node: slots 0-7 by node, the standby node's 2 spares."""
    layouts = [SlurmLayout.from_environ(_env(k), ranks_per_node=2) for k in range(5)]
    assert all((lay.world_size, lay.spares, lay.training_agents) == (8, 1, 4) for lay in layouts)
    assert [lay.initial_roles() for lay in layouts] == [
        ["slot:0", "slot:1"],
        ["slot:2", "slot:3"],
        ["slot:4", "slot:5"],
        ["slot:6", "slot:7"],
        ["spare", "spare"],
    ]
    assert layouts[2].initial_role == "slot:4"
    # --nproc counts ranks (whole nodes of them), --spares nodes
    assert SlurmLayout.from_environ(_env(0, CLOCKWORK_SPARES="none"), nproc=6, ranks_per_node=2).spares == 2
    assert SlurmLayout.from_environ(_env(0), spares=2, ranks_per_node=2).world_size == 6
    with pytest.raises(SlurmLayoutError, match="not a multiple of 2"):
        SlurmLayout.from_environ(_env(0), nproc=5, ranks_per_node=2)
    assert training_nodes(8, 4) == 2
    with pytest.raises(SlurmLayoutError, match="whole nodes"):
        SlurmLayout(1, 0, 3, 1, ("a", "b"), ("1", "2"), 30000, 2)


def test_worker_ids_name_the_agent_and_the_local_index() -> None:
    assert worker_id(3, 0, 0, 1) == "a3.0"  # a node of one rank: the ids of before
    assert worker_id(3, 5, 1, 2) == "a3.5.1"
    for wid, agent, local in (("a3.0", 3, 0), ("a3.5.1", 3, 1), ("a12.7.6", 12, 6), ("w4", -1, 0), ("g9.0", -1, 0)):
        assert (agent_of(wid), local_of(wid)) == (agent, local), wid
    # a borrowed node's guest has no agent, but is a node of its own, with local indices like any node's
    for wid, node, local in (("a3.5.1", "a3", 1), ("g9.0", "g9", 0), ("g9.1.1", "g9", 1), ("w4", "", 0)):
        assert (node_key(wid), local_of(wid)) == (node, local), wid


def test_the_batch_launcher_decides_g_once_for_every_agent() -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1"}
    plan = NodeSteps(["run", "train.py"], srun="srun", python="py", environ=env, ranks_per_node=8).commands()
    assert [step_env["TORCHPASS_RANKS_PER_NODE"] for _, _, step_env in plan] == ["8", "8", "8"]
    plan = NodeSteps(["run", "train.py"], srun="srun", python="py", environ=env).commands()
    assert all("TORCHPASS_RANKS_PER_NODE" not in step_env for _, _, step_env in plan)


# ----- which spares fill which slots -------------------------------------------------------------


def test_a_node_crash_is_rebuilt_on_one_spare_node_in_local_order() -> None:
    # Node 1 (slots 2, 3) is lost. Ready: a lone spare on node 0 (its rank 1 crashed earlier and its agent
    # started a spare on that GPU), then the standby node 4's two spares, registered in reverse local order.
    spares = ["a0.2.1", "a4.1.1", "a4.0.0"]
    assert choose_spares([3, 2], spares) == {2: "a4.0.0", 3: "a4.1.1"}


def test_single_rank_crashes_take_lone_spare_slots_first_and_keep_spare_nodes_whole() -> None:
    assert choose_spares([5], ["a4.0.0", "a4.1.1", "a0.2.1"]) == {5: "a0.2.1"}
    # With none lone, one standby node absorbs single-GPU failures of different nodes one slot at a time.
    pool = ["a4.0.0", "a4.1.1"]
    first = choose_spares([1], pool)
    second = choose_spares([6], [w for w in pool if w not in first.values()])
    assert first == {1: "a4.0.0"} and second == {6: "a4.1.1"}


def test_a_node_gives_its_lower_local_index_first_whatever_registered_first() -> None:
    assert choose_spares([6], ["a4.1.1", "a4.0.0"]) == {6: "a4.0.0"}
    assert choose_spares([1, 6], ["a4.3.1", "a5.1.1", "a4.2.0"]) == {1: "a4.2.0", 6: "a4.3.1"}


def test_a_borrowed_node_of_g_spare_slots_takes_a_crashed_nodes_ranks_together() -> None:
    """A borrowed node's guest offers G spares (``gH.J.J``): a node crash lands on one borrowed node, in local
    order, and a lone slot of another borrowed node is not mixed in (each holder's node is a node of its own)."""
    assert choose_spares([3, 2], ["g900.1.1", "g900.0.0"]) == {2: "g900.0.0", 3: "g900.1.1"}
    assert choose_spares([2, 3], ["g900.0.0", "g901.0.0", "g901.1.1"]) == {2: "g901.0.0", 3: "g901.1.1"}
    assert choose_spares([5], ["g901.0.0", "g901.1.1", "g900.1.1"]) == {5: "g900.1.1"}  # best fit: the lone slot


def test_without_a_node_that_fits_the_fullest_nodes_give_first() -> None:
    spares = ["a5.0.0", "a4.0.0", "a4.1.1"]
    assert choose_spares([0, 1, 2], spares) == {0: "a5.0.0", 1: "a4.0.0", 2: "a4.1.1"}
    assert choose_spares([0, 1], ["a5.0.0", "a6.1.1", "a7.0.0"]) == {0: "a5.0.0", 1: "a6.1.1"}


@pytest.mark.parametrize(
    ("vacant", "spares", "expected"),
    [
        ([1], ["w3", "w4"], {1: "w3"}),  # local mode: ready order, as always
        ([0, 2], ["w5", "w3", "w4"], {0: "w5", 2: "w3"}),
        ([2], ["a3.0", "a1.1"], {2: "a3.0"}),  # one rank per node: the first ready spare, as before
        ([0, 1], ["a4.0", "a3.0"], {0: "a4.0", 1: "a3.0"}),
    ],
)
def test_one_rank_per_node_and_local_mode_keep_ready_order(
    vacant: list[int], spares: list[str], expected: dict[int, str]
) -> None:
    assert choose_spares(vacant, spares) == expected


def test_a_planned_migration_keeps_its_target() -> None:
    assert choose_spares([1, 4], ["a4.0.0", "a4.1.1"], {4: "a4.0.0"}) == {1: "a4.1.1", 4: "a4.0.0"}
    with pytest.raises(ValueError, match="2 slot"):
        choose_spares([1, 2], ["a4.0.0"])


@pytest.mark.usefixtures("job_key")
def test_the_agent_tells_each_rank_its_place_and_keeps_slurms_gpus() -> None:
    """What node 1's agent of a 2-rank-per-node job puts in the environment of its rank with local index 1
    (built, not started: nothing binds until the agent runs)."""
    from torchpass.config import TorchPassConfig
    from torchpass.launch.agent import SlurmAgent

    nodes = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    layout = SlurmLayout(4242, 1, 4, 1, nodes, nodes, 30000, 2)
    environ = {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_JOB_ID": "4242"}
    agent = SlurmAgent("train.py", [], layout, TorchPassConfig(), environ=environ)
    env = agent._environment("a1.1.1", layout.role_of(1, 1), 1)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"]) == ("1", "2", "2,3")
    assert (env["TORCHPASS_ROLE"], env["TORCHPASS_WORKER_ID"], env["TORCHPASS_AGENT"]) == ("slot:3", "a1.1.1", "1")
    assert env["TORCHPASS_WORLD_SIZE"] == "4" and env["TORCHPASS_HOST"] == "127.0.0.2"
    with pytest.raises(SlurmLayoutError, match="sees 1 GPU"):  # a node short of GPUs stops before any rank
        SlurmAgent("train.py", [], layout, TorchPassConfig(), environ={"CUDA_VISIBLE_DEVICES": "0"})


def test_the_slots_moved_name_node_and_local_index_at_both_ends() -> None:
    """What the job's end reports (the AdminComment's ``slots moved``): each slot held by another process than
    its first, from where to where; a borrowed node by its holder job, a respawn in place too."""
    nodes = ["node2", "node3", "node1"]
    initial = {0: "a0.0.0", 1: "a0.1.1", 2: "a1.0.0", 3: "a1.1.1"}
    members = {0: "a0.0.0", 1: "a0.2.1", 2: "a2.0.0", 3: "g900.1.1"}
    assert slot_moves(initial, members, nodes) == {
        1: ("node2/1", "node2/1"),  # its GPU's own new spare took it: in place
        2: ("node3/0", "node1/0"),
        3: ("node3/1", "holder900/1"),
    }
    assert slot_moves(initial, initial, nodes) == {}
