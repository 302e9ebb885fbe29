"""Where peer copies pay off: pure FSDP with every shard also in a ring neighbour's host memory, against
checkpoint-restart, for a model of P parameters on G GPUs (``clockwork simulate-peer-copy``).

The inputs that decide it, and what the model makes of them:

* **State per GPU.** What moves is each GPU's shard of the fp32 parameters and of AdamW's two fp32 moments:
  ``bytes_per_param`` (12 by default; FSDP2's mixed precision gathers bf16 copies but keeps the fp32 shard)
  x P / G. Host memory per GPU for copies: that x (3 + 2r) (TorchPass keeps three of its own, two with
  ``sync``, and two per neighbour; ``docs/user-guide.md``, Peer copies).
* **Step time** (weak scaling: every GPU trains ``tokens_per_gpu`` tokens a step): 6 P tokens / (peak x MFU).
* **A round's stream**: the shard copied to host memory (``host_copy_gbs``) and sent to r neighbours over the
  GPU's share of the NIC (``nic_gbps``), one after the other. It is hidden when it fits in the forward and
  backward passes of the K steps until the next round (``overlap`` of each step); what does not fit stalls
  the next optimizer step, the only cost in step time. With ``sync`` (``peer_copy_sync``, K = 1) every step's
  commit waits for its round instead: the whole stream is step time, and nothing committed is ever redone.
* **The NIC's share**: the stream's bytes per step against FSDP's own traffic per step (about 3 x 2 P bytes
  per GPU: bf16 all-gathers in forward and backward, the reduce-scatter of the gradients): ``2 r / (G K)``
  with the defaults, small because a shard is 1/G of the state while FSDP moves the whole model each step.
* **Failures**: MTTF from :func:`clockwork.cli.goodput.mttf_hours` (published rates). With copies, a share
  ``live_fraction`` of them is rebuilt in place: ``recovery_s`` plus the steps computed again (half the step in
  progress, (K - 1) / 2 on average since the last round, and one more step when the crash lands while a round
  streams; with ``sync`` only half the step in progress, its round included); the rest (a whole-job loss, or
  more adjacent GPUs than r) restart from a checkpoint (Daly's model, as ``clockwork simulate``). Without copies
  every crash of pure FSDP is a checkpoint restart.

Imports nothing outside the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clockwork.cli.goodput import daly_wall_hours, mttf_hours

__all__ = ["MODELS", "PeerCopyInputs", "PeerCopyResult", "peer_copy"]

#: Model sizes offered by name (parameters).
MODELS = {"7B": 7e9, "13B": 13e9, "34B": 34e9, "70B": 70e9}


@dataclass(frozen=True)
class PeerCopyInputs:
    """One scenario (times in hours unless the name says seconds)."""

    params: float
    gpus: int
    copies: int = 1  # r: neighbours keeping each shard
    every_steps: int = 1  # K: a round after every K-th step
    sync: bool = False  # peer_copy_sync: each commit waits for its round (K = 1)
    bytes_per_param: float = 12.0  # fp32 parameter shard + AdamW's two fp32 moments
    tokens_per_gpu: int = 16384  # per step
    gpu_tflops: float = 989.0  # dense bf16 peak (H100 SXM)
    mfu: float = 0.4
    nic_gbps: float = 400.0  # the GPU's share of the node's NICs, Gb/s
    host_copy_gbs: float = 25.0  # device to pinned host memory, GB/s
    overlap: float = 0.9  # share of a step the stream can run under (forward and backward)
    work_h: float = 24.0 * 30
    mttf_h: float | None = None  # None: from the published rates at this size
    checkpoint_interval_h: float = 0.5
    checkpoint_cost_s: float = 60.0
    restart_cost_s: float = 600.0
    recovery_s: float = 2.1  # fault to training again (clockwork simulate's default)
    live_fraction: float = 0.95  # failures rebuilt from a copy; the rest restart from a checkpoint


@dataclass(frozen=True)
class PeerCopyResult:
    """What one scenario comes to."""

    inputs: PeerCopyInputs
    step_s: float
    shard_gb: float  # state per GPU that a round copies
    host_gb: float  # host memory per GPU held for copies
    stream_s: float  # one round: host copy + r sends
    hidden: bool  # the stream fits under the K steps' forward and backward passes (never with sync)
    overhead: float  # share of step time lost to stalls
    nic_share: float  # the stream's bytes against FSDP's own traffic, per step
    mttf_h: float
    redo_steps: float  # steps computed again per repaired crash, on average
    ckpt_wall_h: float  # pure FSDP, checkpoint-restart
    copies_wall_h: float  # with peer copies (and checkpoints for what they cannot repair)

    @property
    def hours_saved(self) -> float:
        """Wall time the copies save over the job (negative: they cost more than they save)."""
        return self.ckpt_wall_h - self.copies_wall_h


def peer_copy(inputs: PeerCopyInputs) -> PeerCopyResult:
    """The model above for one scenario."""
    if inputs.gpus < 2 or inputs.copies < 1 or inputs.every_steps < 1:
        raise ValueError("peer copies need at least 2 GPUs, copies >= 1 and every_steps >= 1")
    if not 0.0 <= inputs.live_fraction <= 1.0 or not 0.0 < inputs.overlap <= 1.0:
        raise ValueError("live_fraction must be within 0..1 and overlap within (0, 1]")
    if inputs.sync and inputs.every_steps != 1:
        raise ValueError("sync (peer_copy_sync) needs every_steps = 1")
    p, g, r, k = inputs.params, inputs.gpus, inputs.copies, inputs.every_steps
    step_s = 6 * p * inputs.tokens_per_gpu / (inputs.gpu_tflops * 1e12 * inputs.mfu)
    shard = p * inputs.bytes_per_param / g
    stream_s = shard / (inputs.host_copy_gbs * 1e9) + r * shard / (inputs.nic_gbps * 1e9 / 8)
    window_s = k * inputs.overlap * step_s
    hidden = not inputs.sync and stream_s <= window_s
    overhead = stream_s / step_s if inputs.sync else max(0.0, stream_s - window_s) / (k * step_s)
    nic_share = (r * shard / k) / (3 * 2 * p)
    mttf = inputs.mttf_h if inputs.mttf_h is not None else mttf_hours(g)
    ckpt_h, restart_h = inputs.checkpoint_cost_s / 3600, inputs.restart_cost_s / 3600
    ckpt_wall = daly_wall_hours(inputs.work_h, mttf, inputs.checkpoint_interval_h, ckpt_h, restart_h)
    work = inputs.work_h * (1 + overhead)
    if inputs.live_fraction < 1:
        base = daly_wall_hours(work, mttf / (1 - inputs.live_fraction), inputs.checkpoint_interval_h, ckpt_h, restart_h)
    else:
        base = work * (1 + ckpt_h / inputs.checkpoint_interval_h)
    redo = 0.5 * (1 + overhead) if inputs.sync else 0.5 + (k - 1) / 2 + min(stream_s / step_s, k)
    load = inputs.live_fraction / mttf * (inputs.recovery_s + redo * step_s) / 3600
    copies_wall = base / (1 - load) if load < 1 else math.inf
    return PeerCopyResult(
        inputs=inputs,
        step_s=step_s,
        shard_gb=shard / 1e9,
        host_gb=shard * ((2 if inputs.sync else 3) + 2 * r) / 1e9,
        stream_s=stream_s,
        hidden=hidden,
        overhead=overhead,
        nic_share=nic_share,
        mttf_h=mttf,
        redo_steps=redo,
        ckpt_wall_h=ckpt_wall,
        copies_wall_h=copies_wall,
    )
