"""``clockwork simulate``: what failures cost a long training job at scale, with and without TorchPass.

The model and its sources are in :mod:`clockwork.cli.goodput`; every input is an option, and the output
states the sources of the failure rates it used.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from clockwork.cli.goodput import SOURCES, GoodputInputs, GoodputResult, simulate

DEFAULT_SCALES = (1024, 2048, 4096, 8192, 16384)


def _row(result: GoodputResult) -> dict[str, object]:
    return {
        "gpus": result.inputs.gpus,
        "mttf_h": round(result.mttf_h, 3),
        "failures": round(result.failures_ckpt, 1),
        "checkpoint_restart_wall_h": round(result.ckpt_wall_h, 2),
        "checkpoint_restart_goodput": round(result.ckpt_goodput, 4),
        "torchpass_wall_h": round(result.torchpass_wall_h, 2),
        "torchpass_goodput": round(result.torchpass_goodput, 4),
        "hours_saved": round(result.ckpt_wall_h - result.torchpass_wall_h, 2),
    }


@click.command()
@click.option(
    "--gpus",
    "scales",
    type=click.IntRange(min=1),
    multiple=True,
    help="Job size in GPUs (repeatable; default 1024 2048 4096 8192 16384).",
)
@click.option(
    "--work-hours",
    type=click.FloatRange(min=0.1),
    default=720.0,
    show_default=True,
    help="Training time without failures.",
)
@click.option(
    "--mttf-hours", type=click.FloatRange(min=0.01), help="Use this MTTF at every size instead of the published rates."
)
@click.option(
    "--checkpoint-interval-min",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Minutes of training between checkpoints (checkpoint-restart, and TorchPass's fallback).",
)
@click.option(
    "--checkpoint-cost-s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Training stalled per checkpoint.",
)
@click.option(
    "--restart-cost-s",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Requeue, start and reload after a failure.",
)
@click.option(
    "--recovery-s",
    type=click.FloatRange(min=0),
    default=2.1,
    show_default=True,
    help="TorchPass: fault to the first step after resume (bench/torchpass_recovery.py).",
)
@click.option(
    "--step-s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="One training step (half is redone per repair).",
)
@click.option(
    "--live-fraction",
    type=click.FloatRange(0, 1),
    default=0.95,
    show_default=True,
    help="Share of failures TorchPass repairs in place.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def simulate_cmd(
    scales: tuple[int, ...],
    work_hours: float,
    mttf_hours: float | None,
    checkpoint_interval_min: float,
    checkpoint_cost_s: float,
    restart_cost_s: float,
    recovery_s: float,
    step_s: float,
    live_fraction: float,
    as_json: bool,
) -> None:
    """Expected completion time and goodput of a long training job, checkpoint-restart vs TorchPass."""
    results = [
        simulate(
            GoodputInputs(
                gpus=gpus,
                work_h=work_hours,
                mttf_h=mttf_hours,
                checkpoint_interval_h=checkpoint_interval_min / 60,
                checkpoint_cost_s=checkpoint_cost_s,
                restart_cost_s=restart_cost_s,
                torchpass_recovery_s=recovery_s,
                step_s=step_s,
                live_fraction=live_fraction,
            )
        )
        for gpus in scales or DEFAULT_SCALES
    ]
    rows = [_row(r) for r in results]
    if as_json:
        inputs = {k: v for k, v in asdict(results[0].inputs).items() if k != "gpus"}
        click.echo(json.dumps({"inputs": inputs, "results": rows, "sources": list(SOURCES)}, indent=2))
        return
    click.echo(
        f"A job that needs {work_hours:g} h of training; checkpoints every {checkpoint_interval_min:g} min "
        f"({checkpoint_cost_s:g} s each), {restart_cost_s:g} s per restart; TorchPass repairs "
        f"{live_fraction:.0%} of failures in {recovery_s:g} s (+ half a {step_s:g} s step).\n"
    )
    head = f"{'GPUs':>6} {'MTTF h':>7} {'failures':>8} | {'ckpt-restart h':>14} {'goodput':>7} | "
    click.echo(head + f"{'TorchPass h':>11} {'goodput':>7} | {'saved h':>8}")
    for r in rows:
        click.echo(
            f"{r['gpus']:>6} {r['mttf_h']:>7.2f} {r['failures']:>8.0f} | {r['checkpoint_restart_wall_h']:>14.1f} "
            f"{r['checkpoint_restart_goodput']:>7.1%} | {r['torchpass_wall_h']:>11.1f} {r['torchpass_goodput']:>7.1%} "
            f"| {r['hours_saved']:>8.1f}"
        )
    click.echo("(failures: expected during the checkpoint-restart run; goodput: training time / wall time)")
    click.echo("\nSources:")
    for source in SOURCES if mttf_hours is None else SOURCES[2:]:
        click.echo(f"  - {source}")
    if mttf_hours is not None:
        click.echo(f"  - MTTF {mttf_hours:g} h at every size (--mttf-hours)")
