"""``clockwork migrate JOBID --rank R``: move one rank of a running TorchPass job to a spare, live;
``clockwork migrate JOBID --ranks-on NODE``: move every rank of a node, before maintenance.

How the job's coordinator is found: every TorchPass node agent posts a ``torchpass.coordinator`` event to its
node daemon when it starts and whenever the coordinator's leader changes (``{leader, endpoints, world_size,
spares, agent, term}``). The newest such event of the job says where the leader is; ``endpoints`` lists every
replica, so a stale record still works: a passive replica answers with a redirect to the leader, and a dead
one is skipped after a timeout. The record lives in the daemon's per-job event log, which the job's own user
may read (no file under a spool folder, which a user's process could not write, and no shared filesystem
needed). The daemon asked is this host's, or ``--node``'s; when this host's daemon does not know the job and
the nodes' run folders are reachable from here (``{node}`` in ``[daemon] run_dir``, as in the sandbox), the
job's nodes (from Slurm) are asked in turn. On a real cluster run the command on one of the job's nodes
(``srun --jobid JOBID --overlap -N1 clockwork migrate JOBID --rank R``).

The request itself speaks TorchPass's coordinator wire format (a msgpack map with ``op`` and ``id`` over a
ZeroMQ DEALER; the reply repeats the id) without importing TorchPass: the CLI must not import torch, and the
dependency direction is torchpass -> clockworkd, never the reverse. It is CURVE-authenticated with the job's
key, which the record carries (:mod:`clockwork.contracts.jobkey`; the daemon shows a job's events only to its owner
and root). The coordinator answers at once; the rank moves at its next step boundary.

A whole node's move (``--ranks-on NODE``) finds the node's ranks from the job's coordinator status (worker id
``aK.N[.J]``: agent K) and the record's ``nodes`` (agent K runs on ``nodes[K]``), then moves them one at a
time, in slot order: each request waits while the previous move is under way, says how many ranks the move has
left (the first goes to a node with room for them all) and names the spare the previous one took (the others
follow it there), so the node's ranks land together on one spare node, each handing its live state over.
"""

from __future__ import annotations

import os
import re
from typing import Any

import click

from clockwork.cli.context import CliContext, pass_ctx
from clockwork.cli.job_events import events_from as _events_from
from clockwork.cli.job_events import job_nodes as _job_nodes
from clockwork.contracts.coordinator_client import (
    COORDINATOR_EVENT,
    COORDINATOR_HELP,
    ask_leader,
    coordinator_record,
    local_record,
    request_migration,
)
from clockwork.contracts.daemon_paths import local_node_name
from clockwork.contracts.errors import ClockworkError

__all__ = [
    "COORDINATOR_EVENT",
    "coordinator_option",
    "coordinator_record",
    "find_coordinator",
    "job_coordinator",
    "migrate",
    "request_migration",
]

coordinator_option = click.option(
    "--coordinator", "coordinator", metavar="FILE|ADDR", help=f"Instead of JOB_ID, a local job: {COORDINATOR_HELP}"
)


def job_coordinator(state: CliContext, job_id: int | None, coordinator: str | None, node: str | None) -> dict[str, Any]:
    """The coordinator record of JOB_ID (from the node daemons) or of ``--coordinator`` (exactly one of them)."""
    if (job_id is None) == (coordinator is None):
        raise click.UsageError("give a JOB_ID (a Slurm job) or --coordinator FILE|ADDR (a local job), not both")
    if coordinator is not None:
        return local_record(coordinator)
    assert job_id is not None
    return find_coordinator(state, job_id, node)


class NotTorchPassJobError(ClockworkError):
    """The job exists but no TorchPass agent ever registered a coordinator for it."""

    exit_code = 2


def find_coordinator(state: CliContext, job_id: int, node: str | None) -> dict[str, Any]:
    """The job's coordinator record, from this node's daemon (or ``node``'s), else from the job's nodes."""
    return _coordinator_of(job_id, find_job_events(state, job_id, node))


def find_job_events(state: CliContext, job_id: int, node: str | None) -> list[dict[str, Any]]:
    """The job's events, from this node's daemon (or ``node``'s), else from the job's nodes."""
    loaded = state.load().config
    cfg = loaded.daemon
    here = local_node_name(cfg)
    asked = [node or here]
    events = _events_from(cfg, asked[0], job_id)
    if events is None and node is None and "{node}" in cfg.run_dir:
        for other in _job_nodes(loaded, job_id):
            if other in asked:
                continue
            asked.append(other)
            events = _events_from(cfg, other, job_id)
            if events is not None:
                break
    if events is None:
        where = ", ".join(asked)
        raise ClockworkError(
            f"job {job_id} is not known to the Clockwork daemon on {where}: run this command on one of the job's "
            f"nodes (e.g. srun --jobid {job_id} --overlap -N1 clockwork migrate {job_id} --rank R), or name one "
            "with --node"
        )
    return list(events)


def _coordinator_of(job_id: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    record = coordinator_record(events)
    if record is None:
        raise NotTorchPassJobError(
            f"job {job_id} is not a TorchPass job: no coordinator was registered for it (launch the training with "
            "`torchpass run ...` in the batch script of an `sbatch --clockwork-ft` job)"
        )
    return record


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@coordinator_option
@click.option("--rank", "--slot", "rank", type=click.IntRange(min=0), help="The rank (slot) to move.")
@click.option(
    "--ranks-on",
    "ranks_on",
    metavar="NODE",
    help="Move every rank running on NODE, together to one spare node (a Slurm job; instead of --rank).",
)
@click.option("--node", "node_name", metavar="NODE", help="Whose daemon to ask (default: this host's).")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds to wait for each coordinator replica.",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to keep asking while the job cannot migrate yet (no spare is ready, another membership change "
    "is in progress); 0 fails at once.",
)
@pass_ctx
def migrate(
    state: CliContext,
    job_id: int | None,
    coordinator: str | None,
    rank: int | None,
    ranks_on: str | None,
    node_name: str | None,
    timeout_s: float,
    wait_s: float,
) -> None:
    """Move rank RANK of TorchPass job JOB_ID (or of the local job --coordinator names) to a spare at its
    next step boundary; or every rank on node NODE (--ranks-on), together to one spare node.

    The rank sends its live training state straight to the spare, which takes its place; the rank then exits
    cleanly and training continues at the next step, with no checkpoint and no step done twice.
    """
    if (rank is None) == (ranks_on is None):
        raise click.UsageError("give --rank R (one rank) or --ranks-on NODE (every rank of a node), one of them")
    if ranks_on is not None:
        if job_id is None:
            raise click.UsageError("--ranks-on NODE moves the ranks of a node of a Slurm job: give its JOB_ID")
        events = find_job_events(state, job_id, node_name)
        record = _coordinator_of(job_id, events)
        slots = ranks_of_node(record, events, ranks_on, timeout_s)
        click.echo(f"job {job_id}: moving the ranks on {ranks_on} ({', '.join(map(str, slots))}) to one spare node")
    else:
        assert rank is not None
        record, slots = job_coordinator(state, job_id, coordinator, node_name), [rank]
    near = ""
    for k, slot in enumerate(slots):
        reply = request_migration(
            record,
            slot,
            timeout_s,
            requester=f"clockwork migrate (uid {os.getuid()})",
            wait_s=wait_s,
            on_wait=lambda why: click.echo(f"clockwork: {why}; asking again for up to {wait_s:g} s", err=True),
            group=len(slots) - k,
            near=near,
        )
        near = str(reply.get("target") or "")
        click.echo(
            f"{f'job {job_id}' if job_id else coordinator}: rank {slot} moves to spare {reply.get('target')} in "
            f"generation {reply.get('generation')} (at its next step boundary)"
        )


_AGENT_WORKER = re.compile(r"a(\d+)\.\d+(?:\.\d+)?")  # a node agent's process: aK.N, or aK.N.J (local index J)


def ranks_of_node(record: dict[str, Any], events: list[dict[str, Any]], node: str, timeout_s: float) -> list[int]:
    """The slots whose ranks run on ``node`` now: the coordinator's members (worker ``aK.N[.J]`` runs under agent
    K) joined with where each agent runs: the record's ``nodes`` (agent K on ``nodes[K]``; every agent's record
    lists them, so the daemon of any one node of the job knows), else the agents' own records (``node``)."""
    agents = {k for k, name in enumerate(record.get("nodes") or []) if name == node}
    agents |= {
        int(fields["agent"])
        for event in events
        if event.get("kind") == COORDINATOR_EVENT
        and isinstance(fields := event.get("fields"), dict)
        and fields.get("node") == node
        and "agent" in fields
    }
    if not agents:
        raise ClockworkError(f"no agent of this job ran on {node} (the nodes are the job's Slurm nodes)", exit_code=2)
    status = ask_leader(record, {"op": "status"}, timeout_s, "asked")["status"]
    slots = []
    for slot, wid in status["members"].items():
        match = _AGENT_WORKER.fullmatch(str(wid))
        if match is not None and int(match.group(1)) in agents:
            slots.append(int(slot))
    if not slots:
        raise ClockworkError(f"no rank of the job runs on {node} now", exit_code=2)
    return sorted(slots)
