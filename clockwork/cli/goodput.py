"""Expected completion time of a long training job under failures: checkpoint-restart vs TorchPass.

Failures arrive as a Poisson process whose mean time to failure (MTTF) depends on the job's GPU count.
Two published points anchor it, and the MTTF is interpolated between them on log-log axes (a power law in
the GPU count), extrapolated the same way outside them:

* 7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs: the MTTF projection for A100 training jobs in Kokolis et
  al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters" (arXiv:2410.21680, HPCA
  2025; Meta's research clusters), as quoted in the product's requirements;
* for comparison, the Llama 3 405B pre-training on 16,384 H100 GPUs saw 419 unexpected interruptions in a
  54-day window, an MTTF of about 3.1 h (Llama Team, "The Llama 3 Herd of Models", 2024).

**Checkpoint-restart** uses Daly's model ("A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 2006), exact for exponential failures that may also strike during restarts and
checkpoints: with MTTF ``M``, work ``W`` between checkpoints ``tau``, checkpoint cost ``delta`` and restart
cost ``R``, the expected wall time is ``M * exp(R / M) * (exp((tau + delta) / M) - 1) * W / tau``.

**TorchPass** repairs a fraction ``live`` of failures in place (a rank or node lost while a replica and a
spare remain): each costs the measured recovery time plus half a step redone on average, and never a
rollback. The rest (a whole-job loss) fall back to checkpoint-restart with the same interval. Both kinds are
independent Poisson processes, so the expected time is Daly's for the fallback failures alone (MTTF
``M / (1 - live)``), stretched by ``1 / (1 - rate_live * cost_live)`` for the live repairs.

Imports nothing outside the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PUBLISHED_MTTF", "SOURCES", "GoodputInputs", "GoodputResult", "daly_wall_hours", "mttf_hours", "simulate"]

#: (GPUs, MTTF in hours) anchoring the interpolation.
PUBLISHED_MTTF = ((1024, 7.9), (16384, 1.8))
SOURCES = (
    "MTTF 7.9 h at 1,024 GPUs and 1.8 h at 16,384 (power law between): the MTTF projection of Kokolis et al., "
    "'Revisiting Reliability in Large-Scale Machine Learning Research Clusters', arXiv:2410.21680 / HPCA 2025 "
    "(Meta research clusters, A100), as quoted in Clockwork's requirements",
    "cross-check: Llama 3 405B on 16,384 H100s, 419 unexpected interruptions in 54 days (MTTF about 3.1 h): "
    "Llama Team, 'The Llama 3 Herd of Models', 2024",
    "checkpoint-restart model: J. T. Daly, 'A higher order estimate of the optimum checkpoint interval for "
    "restart dumps', Future Generation Computer Systems 22(3), 2006",
)


def mttf_hours(gpus: int) -> float:
    """The job's MTTF at ``gpus`` GPUs: a power law through the published points."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, not {gpus}")
    (n1, m1), (n2, m2) = PUBLISHED_MTTF
    slope = math.log(m2 / m1) / math.log(n2 / n1)
    return m1 * (gpus / n1) ** slope


def daly_wall_hours(work_h: float, mttf_h: float, interval_h: float, checkpoint_h: float, restart_h: float) -> float:
    """Daly's expected wall time to finish ``work_h`` of training with checkpoints every ``interval_h``."""
    if interval_h <= 0 or mttf_h <= 0:
        raise ValueError("the checkpoint interval and the MTTF must be positive")
    m = mttf_h
    return m * math.exp(restart_h / m) * math.expm1((interval_h + checkpoint_h) / m) * work_h / interval_h


@dataclass(frozen=True)
class GoodputInputs:
    """One scenario; every time in hours unless the name says seconds."""

    gpus: int
    work_h: float = 24.0 * 30  # training time the job needs with no failure
    mttf_h: float | None = None  # None: from the published points
    checkpoint_interval_h: float = 0.5
    checkpoint_cost_s: float = 60.0  # training stalled per checkpoint (a synchronous save)
    restart_cost_s: float = 600.0  # requeue, reschedule, start, reload the checkpoint
    torchpass_recovery_s: float = 2.1  # fault to the first step after resume (bench/torchpass_recovery.py)
    step_s: float = 1.0  # one training step; half of one is redone per live repair on average
    live_fraction: float = 0.95  # failures TorchPass repairs in place; the rest fall back to checkpoints


@dataclass(frozen=True)
class GoodputResult:
    inputs: GoodputInputs
    mttf_h: float
    failures_ckpt: float  # expected failures during the checkpoint-restart run
    ckpt_wall_h: float
    torchpass_wall_h: float

    @property
    def ckpt_goodput(self) -> float:
        """Share of the wall time that is useful training, checkpoint-restart."""
        return self.inputs.work_h / self.ckpt_wall_h

    @property
    def torchpass_goodput(self) -> float:
        return self.inputs.work_h / self.torchpass_wall_h


def simulate(inputs: GoodputInputs) -> GoodputResult:
    """Expected wall time of both strategies for one scenario (see the module docstring)."""
    if not 0.0 <= inputs.live_fraction <= 1.0:
        raise ValueError(f"live_fraction must be within 0..1, not {inputs.live_fraction}")
    mttf = inputs.mttf_h if inputs.mttf_h is not None else mttf_hours(inputs.gpus)
    ckpt_h, restart_h = inputs.checkpoint_cost_s / 3600, inputs.restart_cost_s / 3600
    ckpt_wall = daly_wall_hours(inputs.work_h, mttf, inputs.checkpoint_interval_h, ckpt_h, restart_h)
    fallback_mttf = mttf / (1 - inputs.live_fraction) if inputs.live_fraction < 1 else math.inf
    base = (
        inputs.work_h * (1 + ckpt_h / inputs.checkpoint_interval_h)
        if math.isinf(fallback_mttf)
        else daly_wall_hours(inputs.work_h, fallback_mttf, inputs.checkpoint_interval_h, ckpt_h, restart_h)
    )
    live_cost_h = (inputs.torchpass_recovery_s + inputs.step_s / 2) / 3600
    live_load = inputs.live_fraction / mttf * live_cost_h
    if live_load >= 1:
        raise ValueError("failures come faster than TorchPass can repair them: the job never finishes")
    return GoodputResult(inputs, mttf, ckpt_wall / mttf, ckpt_wall, base / (1 - live_load))
