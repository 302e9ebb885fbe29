"""The ``torchpass`` command: run a job, migrate a rank, look at a running job, list the settings.

``torchpass run --local`` runs every process on this machine (:mod:`torchpass.launcher`). Without
``--local``, in the batch script of an ``sbatch --clockwork-ft --clockwork-spares=standby --no-kill`` job, it
starts one job step per node (:mod:`torchpass.node_steps`), each running ``torchpass run`` again as that
node's agent (:mod:`torchpass.agent`); a task per node of one srun step becomes an agent directly. The
command imports no torch; the ranks do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from clockworkd.coordinator_client import RETRY_INTERVAL_S
from torchpass.auth import ENV_JOB_KEY, JobKeyError, read_coordinator_file
from torchpass.config import ConfigError, TorchPassConfig, environment_settings
from torchpass.control import CoordinatorLost, CoordinatorRefused, CoordinatorRpc
from torchpass.events import JsonlEventSink

__all__ = ["main"]

PROG = "torchpass"
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
COORDINATOR_HELP = (
    "the coordinator file `torchpass run --local` printed (address and job key), or tcp://HOST:PORT with the "
    "job key in TORCHPASS_JOB_KEY"
)


def _settings_epilog() -> str:
    lines = ["settings (--set KEY=VALUE, or a TOML/JSON file given to --config):"]
    defaults = TorchPassConfig()
    for key, doc in TorchPassConfig.docs().items():
        lines.append(f"  {key} = {getattr(defaults, key)!r}")
        lines += textwrap.wrap(doc, width=100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="TorchPass: keep a data-parallel PyTorch job running through rank failures, without "
        "checkpoint reloads or recomputed steps.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="launch a training script with spare ranks and a coordinator",
        description="Start NPROC ranks and SPARES standby processes running SCRIPT, and the job's coordinator. "
        "A rank that dies is replaced by a spare, which receives the training state from a healthy replica; "
        "training resumes at the same step. With --local every process runs on this machine and the "
        "coordinator's address is printed (for `torchpass migrate`). Without it, run it in the batch script of "
        "an `sbatch --no-kill --clockwork-ft` job: it starts one job step per node (a node crash then ends only "
        "its own step), each running a node agent; N nodes train and the others wait as spares (N and S from "
        "--nproc/--spares, else one spare for --clockwork-spares=standby; the batch host starts as a spare), and "
        "every agent runs a coordinator replica; `clockwork migrate JOBID --rank R` finds the leader.",
        epilog=_settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--local", action="store_true", help="run every process on this machine (gloo on 127.0.0.1)")
    run.add_argument(
        "--nproc", type=int, metavar="N", help="training ranks (slots); --local default 2, Slurm: nodes - spares"
    )
    run.add_argument(
        "--spares",
        type=int,
        metavar="S",
        help="standby processes (--local default 1) or standby nodes (Slurm: default 1 with "
        "--clockwork-spares=standby, else 0)",
    )
    run.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="Slurm: the agents' ports P and P+1 on every node (default: derived from the job id)",
    )
    run.add_argument("--config", metavar="FILE", help="settings file (TOML, or JSON when named *.json)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one setting (repeatable)")
    run.add_argument(
        "--events",
        metavar="FILE",
        help="append every TorchPass event to FILE as JSON lines ({agent} in FILE: one file per node agent)",
    )
    run.add_argument("--coordinator-file", metavar="FILE", help="write the coordinator's address to FILE")
    run.add_argument(
        "--transparent",
        action="store_true",
        help="model-transparent mode: run an unmodified DDP script (init_process_group, DDP, optimizer, "
        "DataLoader with DistributedSampler) and find its model, optimizers and data position at launch "
        "(default when the job was submitted with --clockwork-ft=transparent)",
    )
    run.add_argument("--no-respawn-spares", action="store_true", help="do not start a new spare when one takes a slot")
    run.add_argument(
        "--restore",
        metavar="latest|PATH",
        help="start from the newest good snapshot in the snapshot directory (latest), in directory PATH, or "
        "from snapshot folder PATH; a damaged one is skipped for the previous one, none good is an error "
        "(default: only after a Slurm requeue)",
    )
    run.add_argument("script", help="the training script (it calls torchpass.init())")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    guest = commands.add_parser(
        "guest",
        help="(internal) the replacement rank's agent on a borrowed node",
        description="Started by a --clockwork-spares=borrow job's agent into the holder allocation on a borrowed "
        "node (srun --jobid=HOLDER --overlap): runs SCRIPT as a spare of the training job's coordinator. Not "
        "for use by hand.",
    )
    guest.add_argument("script", help="the training script")
    guest.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    migrate = commands.add_parser(
        "migrate",
        help="move a rank to a spare at its next step boundary",
        description="Planned migration: at its next step boundary rank SLOT sends its live state to a spare, "
        "which takes its slot, and exits cleanly. Training continues at the next step.",
    )
    migrate.add_argument("--coordinator", required=True, metavar="FILE|ADDR", help=COORDINATOR_HELP)
    migrate.add_argument("--slot", required=True, type=int, metavar="R", help="the rank slot to move")
    migrate.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="keep asking this long while the job cannot migrate yet (no spare is ready, another membership "
        "change is in progress); 0 fails at once (default: %(default)g)",
    )

    snapshot = commands.add_parser(
        "snapshot",
        help="ask a running job to take a snapshot now",
        description="Every rank snapshots the same step, a few steps ahead; the command answers which.",
    )
    snapshot.add_argument("--coordinator", required=True, metavar="FILE|ADDR", help=COORDINATOR_HELP)

    status = commands.add_parser("status", help="show a running job's generation, members and spares")
    status.add_argument("--coordinator", required=True, metavar="FILE|ADDR", help=COORDINATOR_HELP)
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    return parser


def _config(args: argparse.Namespace) -> TorchPassConfig:
    cfg = TorchPassConfig.from_file(args.config) if args.config else TorchPassConfig()
    cfg = cfg.with_overrides(**environment_settings())
    for assignment in args.set:
        cfg = cfg.with_assignment(assignment)
    if args.restore:
        cfg = cfg.with_overrides(restore=args.restore)
    return cfg


def _cmd_run(args: argparse.Namespace) -> int:
    if (args.nproc is not None and args.nproc < 1) or (args.spares is not None and args.spares < 0):
        print(f"{PROG} run: --nproc must be >= 1 and --spares >= 0", file=sys.stderr)
        return EXIT_USAGE
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    from clockworkd.job_options import FtMode, JobOptions, JobOptionsError

    try:
        args.transparent = args.transparent or JobOptions.from_environ().ft is FtMode.TRANSPARENT
    except JobOptionsError as exc:
        print(f"{PROG} run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.local:
        return _cmd_run_slurm(args, script_args)
    from torchpass.launcher import LocalLauncher

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launcher = LocalLauncher(
        args.script,
        script_args,
        nproc=2 if args.nproc is None else args.nproc,
        spares=1 if args.spares is None else args.spares,
        config=_config(args),
        event_sink=JsonlEventSink(args.events) if args.events else None,
        respawn_spares=not args.no_respawn_spares,
        coordinator_file=args.coordinator_file,
        transparent=args.transparent,
    )
    return launcher.run()


def _cmd_run_slurm(args: argparse.Namespace, script_args: list[str]) -> int:
    from torchpass.agent import SlurmAgent
    from torchpass.node_steps import NodeSteps, in_batch_script
    from torchpass.slurm_layout import SlurmLayout, SlurmLayoutError, in_slurm_step

    if not in_batch_script() and not in_slurm_step():
        print(
            f"{PROG} run: not inside a Slurm job (SLURM_JOB_ID unset): run it in the job's batch script "
            "(one step per node), with `srun --ntasks-per-node=1` inside the job, or use --local",
            file=sys.stderr,
        )
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[agent]: %(message)s")
    try:
        if in_batch_script():
            return NodeSteps(args.argv).run()
        layout = SlurmLayout.from_environ(spares=args.spares, nproc=args.nproc, port=args.port)
        agent = SlurmAgent(
            args.script, script_args, layout, _config(args), events_file=args.events, transparent=args.transparent
        )
        return agent.run()
    except SlurmLayoutError as exc:
        print(f"{PROG} run: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _cmd_guest(args: argparse.Namespace) -> int:
    from torchpass.guest import GuestAgent
    from torchpass.slurm_layout import SlurmLayoutError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[guest]: %(message)s")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    try:
        return GuestAgent(args.script, script_args, TorchPassConfig.from_env()).run()
    except SlurmLayoutError as exc:
        print(f"{PROG} guest: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _request(target: str, op: str, **fields: Any) -> dict[str, Any]:
    """One request; a passive replica's redirect to the leader is followed (Slurm mode).

    ``target`` is the coordinator file `torchpass run --local` wrote (address and job key), or an address
    (the job key then comes from ``TORCHPASS_JOB_KEY``)."""
    if target.startswith("tcp://"):
        endpoint = target
    else:
        try:
            endpoint, key = read_coordinator_file(Path(target))
        except OSError as exc:
            raise JobKeyError(f"--coordinator {target}: neither tcp://HOST:PORT nor a readable file ({exc})") from None
        os.environ[ENV_JOB_KEY] = key.hex
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for _ in range(3):
            rpc = CoordinatorRpc(context, endpoint, timeout_s=5.0)
            try:
                return rpc.call(op, **fields)
            except CoordinatorRefused as exc:
                if not exc.leader or exc.leader == endpoint or not exc.leader.startswith("tcp://"):
                    raise
                endpoint = exc.leader
            finally:
                rpc.close()
        raise CoordinatorLost(f"no coordinator replica says it leads (last tried {endpoint})")
    finally:
        context.term()


def _cmd_migrate(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        try:
            reply = _request(args.coordinator, "migrate", slot=args.slot, requester="torchpass migrate")
            break
        except CoordinatorRefused as exc:
            if not exc.retry or time.monotonic() + RETRY_INTERVAL_S > deadline:
                raise
            time.sleep(RETRY_INTERVAL_S)
    print(f"slot {args.slot} moves to {reply['target']} in generation {reply['generation']}")
    return 0


def _cmd_snapshot(args: argparse.Namespace) -> int:
    reply = _request(args.coordinator, "snapshot", requester="torchpass snapshot")
    print(f"every rank snapshots after step {reply['step']}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    status = _request(args.coordinator, "status")["status"]
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    assert isinstance(status, dict)
    print(f"state {status['state']}  generation {status['generation']}  failures {status['failures']}")
    for slot, wid in status["members"].items():
        worker = status["workers"].get(wid, {})
        print(f"  slot {slot}: {wid} pid {worker.get('pid')} step {worker.get('step')}")
    print(f"  spares: {', '.join(status['spares']) or 'none'}")
    if status["vacant"]:
        print(f"  vacant: {status['vacant']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchpass`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # the batch-script launcher starts `torchpass` with the same arguments in every node's step
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "migrate":
            return _cmd_migrate(args)
        if args.command == "guest":
            return _cmd_guest(args)
        if args.command == "snapshot":
            return _cmd_snapshot(args)
        return _cmd_status(args)
    except (ConfigError, JobKeyError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CoordinatorRefused as exc:
        print(f"{PROG}: refused: {exc}", file=sys.stderr)
        return 1
    except CoordinatorLost as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
