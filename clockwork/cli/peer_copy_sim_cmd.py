"""``clockwork simulate-peer-copy``: where keeping every FSDP shard in a neighbour's host memory pays off.

The model is :mod:`clockwork.cli.peer_copy_model`; every input is an option.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from clockwork.cli.goodput import SOURCES
from clockwork.cli.peer_copy_model import MODELS, PeerCopyInputs, PeerCopyResult, peer_copy

DEFAULT_GPUS = (64, 128, 256, 512, 1024)


def _row(name: str, result: PeerCopyResult) -> dict[str, object]:
    return {
        "model": name,
        "gpus": result.inputs.gpus,
        "step_s": round(result.step_s, 3),
        "shard_gb": round(result.shard_gb, 3),
        "host_gb_per_gpu": round(result.host_gb, 3),
        "stream_ms": round(1000 * result.stream_s, 1),
        "hidden": result.hidden,
        "overhead_pct": round(100 * result.overhead, 3),
        "nic_share_pct": round(100 * result.nic_share, 3),
        "mttf_h": round(result.mttf_h, 2),
        "redo_steps": round(result.redo_steps, 2),
        "checkpoint_restart_wall_h": round(result.ckpt_wall_h, 2),
        "peer_copy_wall_h": round(result.copies_wall_h, 2),
        "hours_saved": round(result.hours_saved, 2),
    }


@click.command()
@click.option("--model", "models", type=click.Choice(sorted(MODELS)), multiple=True, help="Default: all.")
@click.option("--gpus", "scales", type=click.IntRange(min=2), multiple=True, help="Default: 64 128 256 512 1024.")
@click.option("--copies", type=click.IntRange(1, 2), default=1, show_default=True, help="r: neighbours per shard.")
@click.option("--every-steps", type=click.IntRange(min=1), default=1, show_default=True, help="K: steps per round.")
@click.option("--sync", is_flag=True, help="peer_copy_sync: each commit waits for its round (needs K = 1).")
@click.option("--nic-gbps", type=click.FloatRange(min=1), default=400.0, show_default=True, help="NIC Gb/s per GPU.")
@click.option("--host-copy-gbs", type=click.FloatRange(min=0.1), default=25.0, show_default=True, help="GPU to host.")
@click.option("--tokens-per-gpu", type=click.IntRange(min=1), default=16384, show_default=True, help="Per step.")
@click.option("--gpu-tflops", type=click.FloatRange(min=1), default=989.0, show_default=True, help="bf16 peak.")
@click.option("--mfu", type=click.FloatRange(0.01, 1), default=0.4, show_default=True, help="Model FLOPs utilisation.")
@click.option("--work-hours", type=click.FloatRange(min=0.1), default=720.0, show_default=True, help="Training time.")
@click.option("--checkpoint-interval-min", type=click.FloatRange(min=0.1), default=30.0, show_default=True)
@click.option("--restart-cost-s", type=click.FloatRange(min=0), default=600.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def peer_copy_sim_cmd(
    models: tuple[str, ...],
    scales: tuple[int, ...],
    copies: int,
    every_steps: int,
    sync: bool,
    nic_gbps: float,
    host_copy_gbs: float,
    tokens_per_gpu: int,
    gpu_tflops: float,
    mfu: float,
    work_hours: float,
    checkpoint_interval_min: float,
    restart_cost_s: float,
    as_json: bool,
) -> None:
    """Pure FSDP with peer copies against checkpoint-restart: host memory, stream, step overhead, hours saved."""
    rows: list[dict[str, object]] = []
    for name in models or tuple(MODELS):
        for gpus in scales or DEFAULT_GPUS:
            inputs = PeerCopyInputs(
                params=MODELS[name],
                gpus=gpus,
                copies=copies,
                every_steps=every_steps,
                sync=sync,
                nic_gbps=nic_gbps,
                host_copy_gbs=host_copy_gbs,
                tokens_per_gpu=tokens_per_gpu,
                gpu_tflops=gpu_tflops,
                mfu=mfu,
                work_h=work_hours,
                checkpoint_interval_h=checkpoint_interval_min / 60,
                restart_cost_s=restart_cost_s,
            )
            rows.append(_row(name, peer_copy(inputs)))
    if as_json:
        settings = {k: v for k, v in asdict(inputs).items() if k not in ("params", "gpus")}
        click.echo(json.dumps({"inputs": settings, "results": rows, "sources": list(SOURCES)}, indent=2))
        return
    click.echo(
        f"Pure FSDP, {work_hours:g} h of training; peer copies r = {copies} every K = {every_steps} step(s)"
        f"{' (synchronous: a commit waits for its round)' if sync else ''} against "
        f"checkpoint-restart every {checkpoint_interval_min:g} min ({restart_cost_s:g} s per restart).\n"
    )
    click.echo(
        f"{'model':>5} {'GPUs':>5} {'step s':>6} {'shard GB':>8} {'host GB':>7} {'stream ms':>9} {'stall %':>7} "
        f"{'NIC %':>6} | {'ckpt h':>7} {'copies h':>8} {'saved h':>8}"
    )
    for r in rows:
        click.echo(
            f"{r['model']:>5} {r['gpus']:>5} {r['step_s']:>6.2f} {r['shard_gb']:>8.2f} {r['host_gb_per_gpu']:>7.2f} "
            f"{r['stream_ms']:>9.1f} {r['overhead_pct']:>7.2f} {r['nic_share_pct']:>6.2f} | "
            f"{r['checkpoint_restart_wall_h']:>7.1f} {r['peer_copy_wall_h']:>8.1f} {r['hours_saved']:>8.1f}"
        )
    click.echo(
        "(host GB: per GPU, 3 own copies (2 with --sync) + 2 per neighbour; stall: step time lost when a round does "
        "not fit under the K steps' forward and backward passes, or with --sync the whole round; NIC: the stream's "
        "bytes against FSDP's own per step)"
    )
    click.echo("\nSources (failure rates and the checkpoint-restart model):")
    for source in SOURCES:
        click.echo(f"  - {source}")
