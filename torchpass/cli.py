"""The ``torchpass`` command: run a job (``torchpass run``), look at a running local one (``torchpass status``).

``torchpass run --local`` runs every process on this machine (:mod:`torchpass.launch.launcher`). Without
``--local``, in the batch script of an ``sbatch --clockwork-ft --clockwork-spares=standby --no-kill`` job, it
starts one job step per node (:mod:`torchpass.launch.node_steps`), each running ``torchpass run`` again as that
node's agent (:mod:`torchpass.launch.agent`); a task per node of one srun step becomes an agent directly. Moving a
rank and taking a snapshot are ``clockwork migrate`` and ``clockwork snapshot take`` (``--coordinator FILE``
for a local job): one implementation each. On click, with ``clockwork``'s error and exit-code handling
(:mod:`clockwork.contracts.invoke`). The command imports no torch; the ranks do.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import click

from clockwork.contracts.coordinator_client import COORDINATOR_HELP, ask_leader, local_record
from clockwork.contracts.invoke import invoke
from clockwork.contracts.job_options import FtMode, JobOptions, JobOptionsError
from torchpass.auth import JobKeyError
from torchpass.config import ConfigError, TorchPassConfig, environment_settings
from torchpass.events import JsonlEventSink
from torchpass.launch.site_policy import apply_site_policy

__all__ = ["cli", "main"]

log = logging.getLogger("clockwork.torchpass.cli")

PROG = "torchpass"
EXIT_USAGE = 2
SCRIPT_ARGS = {"ignore_unknown_options": True, "allow_interspersed_args": False}


def _settings_epilog() -> str:
    lines = ["\b", "Settings (--set KEY=VALUE, or a TOML/JSON file given to --config):"]
    defaults = TorchPassConfig()
    for key, doc in TorchPassConfig.docs().items():
        lines.append(f"  {key} = {getattr(defaults, key)!r}")
        lines += textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def cli() -> None:
    """TorchPass: keep a data-parallel PyTorch job running through rank failures, without checkpoint reloads
    or recomputed steps.

    \b
    Move a rank to a spare: clockwork migrate JOBID --rank R (a Slurm job), or
                            clockwork migrate --coordinator FILE --rank R (a local job).
    Move a node's ranks:    clockwork migrate JOBID --ranks-on NODE (together, to one spare node).
    Take a snapshot now:    clockwork snapshot take JOBID (or --coordinator FILE).
    """


def _script_args(args: Sequence[str]) -> list[str]:
    return list(args[1:] if args[:1] == ("--",) or args[:1] == ["--"] else args)


# torchrun's options that have no place in `torchpass run`, and what to do instead.
TORCHRUN_ONLY = {
    "--nnodes": "the nodes come from the Slurm allocation (sbatch -N), or --local runs on this machine",
    "--node-rank": "each node's agent knows its place from Slurm",
    "--rdzv-backend": "TorchPass runs its own rendezvous",
    "--rdzv-endpoint": "TorchPass runs its own rendezvous",
    "--rdzv-id": "TorchPass runs its own rendezvous",
    "--rdzv-conf": "TorchPass runs its own rendezvous",
    "--master-addr": "TorchPass runs its own rendezvous",
    "--master-port": "TorchPass runs its own rendezvous (--port sets the agents' ports under Slurm)",
    "--standalone": "TorchPass runs its own rendezvous",
    "--max-restarts": "TorchPass replaces a failed rank itself (the max_failures setting)",
}


class UnknownRunOption(click.UsageError):
    """An option before the script that `torchpass run` does not know (nothing was started)."""


def check_options_before_script(command: click.Command, ctx: click.Context, args: Sequence[str]) -> None:
    """Refuse an option before SCRIPT that ``command`` does not know, naming the nearest known one (difflib).

    Options after SCRIPT are the script's own, so a command that passes them on unparsed cannot let click reject
    unknown options; without this check the first unknown one would be taken for the script's path and every
    rank would fail on "No such file or directory" (under Slurm, each node's agent would start spare after spare).
    """
    flags: set[str] = set()
    valued: set[str] = set()
    for param in command.get_params(ctx):
        if isinstance(param, click.Option):
            names = [*param.opts, *param.secondary_opts]
            (flags if param.is_flag or param.count else valued).update(names)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--" or token == "-" or not token.startswith("-"):
            return  # the script (or the end of the options) is reached
        name, has_value = token.split("=", 1)[0], "=" in token
        if name in flags:
            i += 1
        elif name in valued:
            i += 1 if has_value else 2
        else:
            raise UnknownRunOption(_unknown_option_message(name, sorted(flags | valued)), ctx)


def _unknown_option_message(name: str, known: list[str]) -> str:
    longs = [k for k in known if k.startswith("--")]
    spelled = name.replace("_", "-") if name.startswith("--") else name
    if spelled in known and spelled != name:
        hint = f"did you mean {spelled}?"
    elif spelled in TORCHRUN_ONLY:
        hint = f"{spelled} is torchrun's: {TORCHRUN_ONLY[spelled]}"
    else:
        close = difflib.get_close_matches(spelled, longs, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"the known options: {', '.join(longs)}"
    return (
        f"unknown option {name} before the script ({hint}); nothing was started. The command's own options go "
        "before SCRIPT, the script's after it."
    )


class RunCommand(click.Command):
    """A command whose arguments after SCRIPT are the script's: an unknown option before it is an error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        check_options_before_script(self, ctx, args)
        return super().parse_args(ctx, args)


@cli.command("run", cls=RunCommand, context_settings=SCRIPT_ARGS, epilog=_settings_epilog())
@click.option("--local", is_flag=True, help="Run every process on this machine (gloo on 127.0.0.1).")
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    metavar="N",
    help="Training ranks (slots); --local default 2, Slurm: (nodes - spares) x G, whole nodes.",
)
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    type=click.IntRange(min=1),
    metavar="G",
    help="Slurm: ranks per node (torchrun's spelling); default one per GPU (SLURM_GPUS_PER_NODE, else "
    "SLURM_GPUS_ON_NODE), else --ntasks-per-node of the job, else 1. --local: the same as --nproc.",
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    metavar="S",
    help="Standby processes (--local default 1) or standby nodes (Slurm: default 1 with --clockwork-spares=standby, "
    "else 0).",
)
@click.option(
    "--port", type=int, metavar="P", help="Slurm: the agents' ports P and P+1 on every node (default: from the job id)."
)
@click.option("--config", "config_file", metavar="FILE", help="Settings file (TOML, or JSON when named *.json).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="One setting (repeatable).")
@click.option(
    "--events", metavar="FILE", help="Append every TorchPass event to FILE as JSON lines ({agent}: one file per agent)."
)
@click.option("--coordinator-file", metavar="FILE", help="Write the coordinator's address and job key to FILE.")
@click.option(
    "--transparent",
    is_flag=True,
    help="Model-transparent mode: run an unmodified DDP script (init_process_group, DDP, optimizer, DataLoader with "
    "DistributedSampler) and find its model, optimizers and data position at launch (default when the job was "
    "submitted with --clockwork-ft=transparent).",
)
@click.option("--no-respawn-spares", is_flag=True, help="Do not start a new spare when one takes a slot.")
@click.option(
    "--container",
    "container_bundle",
    metavar="BUNDLE",
    help="Slurm: run every node agent and its ranks in this OCI bundle (srun --container; default: the job's "
    "sbatch --container, SLURM_CONTAINER). A job submitted with pyxis's --container-image needs nothing here.",
)
@click.option(
    "--container-python",
    metavar="PATH",
    help="Slurm: the Python interpreter inside the container that runs the agents (default: this one's path).",
)
@click.option(
    "--restore",
    metavar="latest|PATH",
    help="Start from the newest good snapshot in the snapshot directory (latest), in directory PATH, or from "
    "snapshot folder PATH; a damaged one is skipped for the previous one, none good is an error (default: only "
    "after a Slurm requeue).",
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_cmd(ctx: click.Context, **params: Any) -> int:
    """Start NPROC ranks and SPARES standby processes running SCRIPT, and the job's coordinator.

    \b
    On 8 nodes of 8 GPUs, one rank per GPU (64 ranks):
      sbatch -N8 --gpus-per-node=8 --no-kill --clockwork-ft --wrap 'torchpass run train.py'
    With a standby node whose 8 GPUs are 8 spare slots (a crashed node's 8 ranks move there at once):
      sbatch -N9 --gpus-per-node=8 --no-kill --clockwork-ft --clockwork-spares=standby \\
             --wrap 'torchpass run train.py'
    On this machine:
      torchpass run --local --nproc 3 --spares 1 train.py

    A rank that dies is replaced by a spare, which receives the training state from a healthy replica; training
    resumes at the same step. In a batch script it starts one job step per node (a node crash then ends only its
    own step), each running a node agent that supervises G ranks, G from --nproc-per-node, else one per GPU
    (SLURM_GPUS_PER_NODE, SLURM_GPUS_ON_NODE), else the job's --ntasks-per-node, else 1 (never CPUs per node).
    Ranks are numbered per node as torchrun does (LOCAL_RANK is the GPU). The first nodes train, the others wait
    as standby nodes of G spare slots (--spares S nodes, or --nproc N ranks; else one standby node for
    --clockwork-spares=standby; the batch host starts as a standby node). Every agent runs a coordinator
    replica; `clockwork migrate JOBID --rank R` finds the leader. With --local every process runs on this
    machine and the coordinator file is printed (for `clockwork migrate --coordinator`). Options of the command
    go before SCRIPT, the script's own after it.
    """
    script_args = _script_args(params["args"])
    try:
        transparent = params["transparent"] or JobOptions.from_environ().ft is FtMode.TRANSPARENT
    except JobOptionsError as exc:
        raise click.UsageError(str(exc)) from None
    if not params["local"]:
        return _run_slurm(params, script_args, transparent, list(ctx.obj or []))
    from torchpass.launch.launcher import LocalLauncher

    per_node, nproc = params["nproc_per_node"], params["nproc"]
    if per_node is not None and nproc is not None and per_node != nproc:
        raise click.UsageError(f"--local runs one node: --nproc {nproc} and --nproc-per-node {per_node} disagree")
    nproc = per_node if nproc is None else nproc

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launcher = LocalLauncher(
        params["script"],
        script_args,
        nproc=2 if nproc is None else nproc,
        spares=1 if params["spares"] is None else params["spares"],
        config=_config(params),
        event_sink=JsonlEventSink(params["events"]) if params["events"] else None,
        respawn_spares=not params["no_respawn_spares"],
        coordinator_file=params["coordinator_file"],
        transparent=transparent,
    )
    return launcher.run()


def _config(params: Mapping[str, Any]) -> TorchPassConfig:
    """The run's settings: --set > environment > --config file > defaults; --restore last."""
    cfg = TorchPassConfig.from_file(params["config_file"]) if params.get("config_file") else TorchPassConfig()
    cfg = cfg.with_overrides(**environment_settings())
    for assignment in params.get("sets") or ():
        cfg = cfg.with_assignment(assignment)
    if params.get("restore"):
        cfg = cfg.with_overrides(restore=params["restore"])
    return apply_site_policy(cfg)  # the admin's snapshot root and quota (clockwork.toml [snapshots])


def _run_slurm(params: Mapping[str, Any], script_args: list[str], transparent: bool, argv: list[str]) -> int:
    from torchpass.launch.agent import SlurmAgent
    from torchpass.launch.container import container_from_environ
    from torchpass.launch.node_ranks import ranks_per_node
    from torchpass.launch.node_steps import NodeSteps, in_batch_script
    from torchpass.launch.slurm_layout import SlurmLayout, SlurmLayoutError, in_slurm_step, training_nodes

    if not in_batch_script() and not in_slurm_step():
        raise click.UsageError(
            "not inside a Slurm job (SLURM_JOB_ID unset): run it in the job's batch script (one step per node), "
            "with `srun --ntasks-per-node=1` inside the job, or use --local"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[agent]: %(message)s")
    try:
        batch = in_batch_script()
        per_node = ranks_per_node(os.environ, params["nproc_per_node"], batch=batch)
        if params["nproc"] is not None:
            training_nodes(params["nproc"], per_node.count)  # refused here, before any step starts
        if batch:  # every node's step runs `torchpass` with the same arguments, and G decided once here
            log.info("%s", per_node)
            container = container_from_environ(os.environ, bundle=params["container_bundle"])
            python = params["container_python"] or sys.executable
            return NodeSteps(argv, python=python, ranks_per_node=per_node.count, container=container).run()
        layout = SlurmLayout.from_environ(
            spares=params["spares"], nproc=params["nproc"], port=params["port"], ranks_per_node=per_node.count
        )
        log.info("%s", per_node)
        agent = SlurmAgent(
            params["script"],
            script_args,
            layout,
            _config(params),
            events_file=params["events"],
            transparent=transparent,
        )
        return agent.run()
    except SlurmLayoutError as exc:
        raise click.UsageError(str(exc)) from None


@cli.command("guest", context_settings=SCRIPT_ARGS, hidden=True)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def guest_cmd(script: str, args: tuple[str, ...]) -> int:
    """(Internal) the replacement rank's agent on a borrowed node.

    Started by a --clockwork-spares=borrow job's agent into the holder allocation on a borrowed node (srun
    --jobid=HOLDER --overlap): runs SCRIPT as a spare of the training job's coordinator. Not for use by hand.
    """
    from torchpass.launch.guest import GuestAgent
    from torchpass.launch.slurm_layout import SlurmLayoutError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[guest]: %(message)s")
    try:
        return GuestAgent(script, _script_args(args), TorchPassConfig.from_env()).run()
    except SlurmLayoutError as exc:
        raise click.UsageError(str(exc)) from None


@cli.command("status")
@click.option("--coordinator", required=True, metavar="FILE|ADDR", help=COORDINATOR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def status_cmd(coordinator: str, as_json: bool) -> None:
    """Show a running job's generation, members and spares."""
    status = ask_leader(local_record(coordinator), {"op": "status"}, 5.0, "asked")["status"]
    if as_json:
        click.echo(json.dumps(status, indent=2, sort_keys=True))
        return
    click.echo(f"state {status['state']}  generation {status['generation']}  failures {status['failures']}")
    for slot, wid in status["members"].items():
        worker = status["workers"].get(wid, {})
        click.echo(f"  slot {slot}: {wid} pid {worker.get('pid')} step {worker.get('step')}")
    click.echo(f"  spares: {', '.join(status['spares']) or 'none'}")
    if status["vacant"]:
        click.echo(f"  vacant: {status['vacant']}")


def _moved(name: str, replacement: str) -> click.Command:
    @click.command(name, hidden=True, context_settings={**SCRIPT_ARGS, "help_option_names": []})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def moved(args: tuple[str, ...]) -> None:
        raise click.UsageError(f"`torchpass {name}` is now `{replacement}` (one command for Slurm and local jobs)")

    return moved


cli.add_command(_moved("migrate", "clockwork migrate --coordinator FILE --rank R"))
cli.add_command(_moved("snapshot", "clockwork snapshot take --coordinator FILE"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchpass`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return invoke(cli, args, PROG, obj=args)
    except (ConfigError, JobKeyError) as exc:
        click.echo(f"{PROG}: {exc}", err=True)
        return EXIT_USAGE
