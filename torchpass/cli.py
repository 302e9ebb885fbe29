"""The ``torchpass`` command: run a job, migrate a rank, look at a running job, list the settings.

``torchpass run --local`` is implemented here; under Slurm (``srun torchpass run ...`` inside an
``sbatch --clockwork-ft`` job) the launcher is wired in a later change and this command says so. The command
imports no torch; the ranks do.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import zmq

from torchpass.config import ConfigError, TorchPassConfig
from torchpass.control import CoordinatorLost, CoordinatorRefused, CoordinatorRpc
from torchpass.events import JsonlEventSink

__all__ = ["main"]

PROG = "torchpass"
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


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
        "training resumes at the same step. Prints the coordinator's address (for `torchpass migrate`).",
        epilog=_settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--local", action="store_true", help="run every process on this machine (gloo on 127.0.0.1)")
    run.add_argument("--nproc", type=int, default=2, metavar="N", help="training ranks (slots); default 2")
    run.add_argument("--spares", type=int, default=1, metavar="S", help="standby processes; default 1")
    run.add_argument("--config", metavar="FILE", help="settings file (TOML, or JSON when named *.json)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one setting (repeatable)")
    run.add_argument("--events", metavar="FILE", help="append every TorchPass event to FILE as JSON lines")
    run.add_argument("--coordinator-file", metavar="FILE", help="write the coordinator's address to FILE")
    run.add_argument("--no-respawn-spares", action="store_true", help="do not start a new spare when one takes a slot")
    run.add_argument("script", help="the training script (it calls torchpass.init())")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    migrate = commands.add_parser(
        "migrate",
        help="move a rank to a spare at its next step boundary",
        description="Planned migration: at its next step boundary rank SLOT sends its live state to a spare, "
        "which takes its slot, and exits cleanly. Training continues at the next step.",
    )
    migrate.add_argument("--coordinator", required=True, metavar="ADDR", help="tcp://HOST:PORT (printed by run)")
    migrate.add_argument("--slot", required=True, type=int, metavar="R", help="the rank slot to move")

    status = commands.add_parser("status", help="show a running job's generation, members and spares")
    status.add_argument("--coordinator", required=True, metavar="ADDR", help="tcp://HOST:PORT (printed by run)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    return parser


def _config(args: argparse.Namespace) -> TorchPassConfig:
    cfg = TorchPassConfig.from_file(args.config) if args.config else TorchPassConfig()
    for assignment in args.set:
        cfg = cfg.with_assignment(assignment)
    return cfg


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print(
            f"{PROG} run: only --local is available yet (launching under srun is wired with Slurm later)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.nproc < 1 or args.spares < 0:
        print(f"{PROG} run: --nproc must be >= 1 and --spares >= 0", file=sys.stderr)
        return EXIT_USAGE
    from torchpass.launcher import LocalLauncher

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    launcher = LocalLauncher(
        args.script,
        script_args,
        nproc=args.nproc,
        spares=args.spares,
        config=_config(args),
        event_sink=JsonlEventSink(args.events) if args.events else None,
        respawn_spares=not args.no_respawn_spares,
        coordinator_file=args.coordinator_file,
    )
    return launcher.run()


def _request(endpoint: str, op: str, **fields: Any) -> dict[str, Any]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rpc = CoordinatorRpc(context, endpoint, timeout_s=5.0)
    try:
        return rpc.call(op, **fields)
    finally:
        rpc.close()
        context.term()


def _cmd_migrate(args: argparse.Namespace) -> int:
    reply = _request(args.coordinator, "migrate", slot=args.slot, requester="torchpass migrate")
    print(f"slot {args.slot} moves to {reply['target']} in generation {reply['generation']}")
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
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "migrate":
            return _cmd_migrate(args)
        return _cmd_status(args)
    except ConfigError as exc:
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
