"""The exactness fuzzer's grammar: one integer seed draws one case (a training script's features and its faults).

Why a grammar and not a list of hand-made cases: the defects worth finding are the combinations nobody thought of
(issue 40's was accumulation x FSDP2 x a kill in one micro-batch). Every feature is drawn from the seed with the
constraints that keep the script valid (FSDP2's ``set_requires_gradient_sync`` only under FSDP, a
``MixedPrecisionPolicy`` only where there is a ``fully_shard``), so ``--seed N`` replays a case exactly: the same
seed always gives the same :class:`Case`, and its script is rendered from the case alone
(:mod:`fuzz_render`). No torch here: the grammar is checked by fast unit tests.

What the product promises for a case is part of the case too (:meth:`Case.may_stop`): a fault plan that can take
every holder of some state (both ranks of a 2-rank DDP job, both replicas of an HSDP shard, a pure-FSDP shard
and the neighbour holding its peer copy) may end in a stop with the reason; any other must end bitwise equal.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

LAYOUTS = ("ddp2", "fsdp1x2", "fsdp1x4", "hsdp2x2")
MODES = ("transparent", "aware")
ACCUMULATIONS = ("none", "no_sync", "sync_off")
SCHEDULERS = ("none", "per_step", "per_epoch", "plateau")
PRECISIONS = ("fp32", "bf16_policy", "autocast_bf16", "scaler_fp16")
OPTIMIZERS = ("one", "two")
FAULT_TIMINGS = ("mark", "hook", "during", "rejoin")
HOOK_PHASES = ("forward", "backward", "optimizer", "update")  # drawn; "between" (after the first optimizer's
# step, before the next one's) only in a replay's fault plan, so that every seed draws what it drew before

# The model and data every script shares (small: a case is a few seconds on two cores).
VOCAB, WIDTH, CONTEXT = 24, 16, 6
BATCH = 4  # samples per rank per micro-batch


@dataclass(frozen=True)
class Fault:
    """One fault of a case's plan, acted by :mod:`fuzz_faults` while the job trains.

    ``timing``: ``mark`` waits until slot ``slot`` wrote its marker ``mark`` (a micro-batch in transparent mode,
    a step in aware mode), then ``delay`` of a step more: a random moment; ``hook`` is a kill the script makes
    itself in marker ``mark``, at ``phase`` (its first block's forward or backward, the first optimizer's step, or
    right after the last optimizer's step): the same moment in every replay; ``during`` acts ``delay`` seconds
    after the previous fault (inside its recovery); ``rejoin`` waits for the process that took the previous
    victim's slot, then ``delay`` seconds (right after, or inside, the recovery). ``kind`` is ``kill`` (SIGKILL of
    the process holding the slot then) or ``migrate`` (``clockwork migrate --coordinator FILE --rank slot``)."""

    kind: str
    slot: int
    timing: str
    mark: int = 0
    delay: float = 0.0
    phase: str = ""

    def describe(self) -> str:
        where = {
            "mark": f"@mark{self.mark}+{self.delay:.2f}step",
            "hook": f"@mark{self.mark}:{self.phase}",
            "during": f"+{self.delay:.2f}s",
        }
        return f"{self.kind}:{self.slot}{where.get(self.timing, f'@rejoin+{self.delay:.2f}s')}"


@dataclass(frozen=True)
class Case:
    """One generated training script (its features) and the faults it runs under."""

    seed: int
    layout: str
    mode: str
    accumulation: str
    accumulate: int  # micro-batches per optimizer step (1 without accumulation)
    tied: bool
    optimizers: str
    param_groups: bool
    frozen: bool
    scheduler: str
    plateau_after_update: bool  # the loss is all-reduced after the optimizer step (else before it)
    clip: bool
    precision: str
    batchnorm: bool
    dropout: bool
    ema: bool
    drop_last: bool  # transparent: the DistributedSampler's drop_last
    uneven: bool  # transparent: the last batch of a pass is smaller
    epochs: int
    faults: tuple[Fault, ...] = field(default=())

    # ----- derived --------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return {"ddp2": 2, "fsdp1x2": 2, "fsdp1x4": 4, "hsdp2x2": 4}[self.layout]

    @property
    def mesh(self) -> tuple[int, int]:
        """(replicas, shards); DDP is (world, 1)."""
        return {"ddp2": (2, 1), "fsdp1x2": (1, 2), "fsdp1x4": (1, 4), "hsdp2x2": (2, 2)}[self.layout]

    @property
    def sharded(self) -> bool:
        return self.layout != "ddp2"

    @property
    def windows(self) -> int:
        """Optimizer steps per pass over the data (besides the last, partial one when ``uneven``): enough that a
        fault drawn in the first half leaves the ones after it room to land while the job still trains."""
        return 4 if self.sharded else 16  # a 2-rank DDP step takes ~15 ms here: 16 keep a recovery inside training

    @property
    def per_rank(self) -> int:
        """Samples each rank sees per pass (transparent: the sampler's share; aware: a StepLoader epoch)."""
        return BATCH * self.accumulate * self.windows + (2 if self.uneven else 0)

    @property
    def samples(self) -> int:
        """Dataset rows: ``per_rank`` per rank either way, one row over (``drop_last`` drops it) or one short (the
        sampler pads it) in transparent mode, exactly that many in aware mode (a StepLoader epoch)."""
        if self.mode == "aware":
            return self.per_rank * self.world
        return self.per_rank * self.world + (1 if self.drop_last else -1)

    @property
    def batches_per_pass(self) -> int:
        """Transparent: the loader's batches per pass (the last one smaller when ``uneven``)."""
        return -(-self.per_rank // BATCH)

    @property
    def steps(self) -> int:
        """Optimizer steps in the whole run (aware: ``ctx.steps``' total)."""
        if self.mode == "aware":
            return self.epochs * self.steps_per_epoch
        return self.epochs * -(-self.batches_per_pass // self.accumulate)

    @property
    def steps_per_epoch(self) -> int:
        """Aware: steps per StepLoader epoch (the per-epoch scheduler steps at its end)."""
        return self.per_rank // (BATCH * self.accumulate)

    @property
    def marks(self) -> int:
        """Markers a slot writes in a fault-free run: one per micro-batch (transparent) or per step (aware)."""
        return self.epochs * self.batches_per_pass if self.mode == "transparent" else self.steps

    @property
    def mark_per_step(self) -> int:
        """Markers per optimizer step (a later fault waits this many per step it must stay clear of)."""
        return self.accumulate if self.mode == "transparent" else 1

    def update_marks(self) -> list[int]:
        """The markers whose micro-batch (or step) ends with the optimizer step."""
        if self.mode == "aware":
            return list(range(self.marks))
        per_pass = self.batches_per_pass
        last = [i for i in range(per_pass) if (i + 1) % self.accumulate == 0 or i + 1 == per_pass]
        return [epoch * per_pass + i for epoch in range(self.epochs) for i in last]

    def hook_kills(self) -> str:
        """``CW_FUZZ_KILLS`` of the faulted run: the kills the script makes itself, ``slot:mark:phase``."""
        return ",".join(f"{f.slot}:{f.mark}:{f.phase}" for f in self.faults if f.timing == "hook")

    def features(self) -> dict[str, Any]:
        """The feature values, as printed per case and counted in the coverage table."""
        values = asdict(self)
        values.pop("seed")
        values["faults"] = " ".join(f.describe() for f in self.faults)
        values["kills"] = sum(f.kind == "kill" for f in self.faults)
        values["migration"] = any(f.kind == "migrate" for f in self.faults)
        values["slot0_killed"] = any(f.kind == "kill" and f.slot == 0 for f in self.faults)
        values["kill_in_recovery"] = any(f.timing in ("during", "rejoin") for f in self.faults)
        values["hook_kill"] = any(f.timing == "hook" for f in self.faults)
        return values

    def describe(self) -> str:
        skip = {"faults", "kills", "migration", "slot0_killed", "kill_in_recovery", "hook_kill"}
        parts = [f"{k}={v}" for k, v in self.features().items() if k not in skip]
        return " ".join(parts) + f" faults=[{self.features()['faults']}]"

    # ----- what the product promises -----------------------------------------------------------------

    def co_holders(self, a: int, b: int) -> bool:
        """Whether losing slots ``a`` and ``b`` together loses some state: both ranks of DDP, the two replicas of
        an HSDP shard, or in pure FSDP a shard and its ring successor (which keeps its only peer copy)."""
        if a == b:
            return False
        replicas, shards = self.mesh
        if not self.sharded:
            return True  # two ranks: every member
        if replicas > 1:
            return a % shards == b % shards
        return (a + 1) % shards == b or (b + 1) % shards == a

    def may_stop(self) -> bool:
        """Whether the fault plan may take every holder of some state (then a stop with the reason is right): two
        kills of co-holders in one chain of faults, each inside the recovery of the one before it."""
        for j, after in enumerate(self.faults):
            i = j
            while i > 0 and self.faults[i].timing in ("during", "rejoin"):
                i -= 1
                before = self.faults[i]
                if "migrate" not in (before.kind, after.kind) and self.co_holders(before.slot, after.slot):
                    return True
        return False


def draw_case(seed: int, layouts: tuple[str, ...] = LAYOUTS, modes: tuple[str, ...] = MODES) -> Case:
    """The case of ``seed`` (restricted to ``layouts`` and ``modes``: a filter changes which case a seed draws,
    so a replay gives the same filters)."""
    rng = random.Random(seed)
    layout, mode = rng.choice(layouts), rng.choice(modes)
    sharded = layout != "ddp2"
    accumulation = rng.choice(["none", "sync_off" if sharded else "no_sync"])
    accumulate = 1 if accumulation == "none" else rng.choice([2, 3])
    scheduler = rng.choice(SCHEDULERS)
    precisions = ["fp32", "autocast_bf16", "scaler_fp16"] + (["bf16_policy"] if sharded else [])
    # AveragedModel deep-copies its module, which FSDP2 refuses: an unmodified FSDP2 script keeps no such EMA.
    ema = rng.random() < 0.35 and not (mode == "transparent" and sharded)
    precision = rng.choice(precisions)
    case = Case(
        seed=seed,
        layout=layout,
        mode=mode,
        accumulation=accumulation,
        accumulate=accumulate,
        tied=rng.random() < 0.5,
        optimizers=rng.choice(OPTIMIZERS),
        param_groups=rng.random() < 0.5,
        frozen=rng.random() < 0.3,
        scheduler=scheduler,
        # The model-aware API's rule: a ctx.all_reduce after the update serves a log line, never state (it returns
        # False when it fails, and a script that then skips or keeps a scheduler step differs from its fault-free
        # run unseen): such a script is outside the contract, so only transparent mode draws it (the draw is kept).
        plateau_after_update=scheduler == "plateau" and rng.random() < 0.3 and mode == "transparent",
        clip=rng.random() < 0.5,
        precision=precision,
        # FSDP2 casts BatchNorm's weights to a MixedPrecisionPolicy's bf16 but not its statistics: torch refuses.
        # Under HSDP a rank rebuilt from another replica gets that replica's statistics (documented, warned about at
        # start): not generated as a case that must end bitwise.
        batchnorm=rng.random() < 0.3 and precision != "bf16_policy" and layout != "hsdp2x2",
        dropout=rng.random() < 0.6,
        ema=ema,
        drop_last=mode == "transparent" and rng.random() < 0.5,
        uneven=mode == "transparent" and rng.random() < 0.5,
        epochs=rng.choice([2, 3]),
    )
    return _with_faults(case, rng)


def _with_faults(case: Case, rng: random.Random) -> Case:
    """1-3 faults: the first in the first third of training (a migration, 15 %, or a kill), slot 0 often among the
    victims; each next one a kill inside the previous one's recovery (``during``, ``rejoin``) or a few steps later
    (``mark``, ``hook``)."""
    world, gap = case.world, 2 * case.mark_per_step + 1
    faults = [_later(case, rng, 1, case.marks // 3, migrate=rng.random() < 0.15)]
    for _ in range(rng.choice([0, 1, 1, 2])):
        before = faults[-1]
        timing = rng.choice(FAULT_TIMINGS)
        if before.kind == "migrate" and timing in ("during", "rejoin"):
            timing = "mark"
        if timing in ("during", "rejoin") and max(f.mark for f in faults) >= case.marks - 3 * case.mark_per_step:
            # A kill timed from a fault in the last steps could land after training ended (seed 3447: 0.38 s
            # after a recovery, when an idle machine trains the rest in 0.3 s): a fault that was never injected.
            timing = "mark"
        if timing in ("mark", "hook"):
            start = max(f.mark for f in faults) + gap
            if start >= case.marks - 2 * case.mark_per_step:
                break  # no room left before the end of training
            # Kills only: a migration needs a ready spare, which the kills before it may have used up until the
            # launcher's new one is up, and a short job can end meanwhile (the migration then never happens).
            faults.append(_later(case, rng, start, case.marks - 2 * case.mark_per_step, migrate=False, hook=timing))
        elif timing == "during":
            faults.append(Fault("kill", rng.randrange(world), "during", 0, round(rng.uniform(0.0, 0.4), 3)))
        else:
            slot = before.slot if rng.random() < 0.5 else rng.randrange(world)
            faults.append(Fault("kill", slot, "rejoin", 0, round(rng.uniform(0.0, 0.3), 3)))
    if not any(f.slot == 0 for f in faults) and rng.random() < 0.4:
        faults[0] = replace(faults[0], slot=0)
    return replace(case, faults=tuple(faults))


def _later(case: Case, rng: random.Random, low: int, high: int, *, migrate: bool, hook: str = "") -> Fault:
    """A fault at a marker in [low, high): a migration or a kill at a random moment (``mark``), or a kill the
    script makes itself at a phase (``hook``; drawn half the time when ``hook`` is not given)."""
    slot = rng.randrange(case.world)
    if migrate:
        return Fault("migrate", slot, "mark", rng.randrange(low, max(low + 1, high)), round(rng.random(), 3))
    timing = hook or rng.choice(["mark", "hook"])
    if timing == "mark":
        return Fault("kill", slot, "mark", rng.randrange(low, max(low + 1, high)), round(rng.random(), 3))
    phases = HOOK_PHASES if case.precision != "scaler_fp16" else HOOK_PHASES[:2]  # a scaler may skip the step
    phase = rng.choice(phases)
    if phase in ("optimizer", "update"):
        marks = [m for m in case.update_marks() if low <= m < max(low + 1, high)] or [case.update_marks()[-2]]
        return Fault("kill", slot, "hook", rng.choice(marks), 0.0, phase)
    return Fault("kill", slot, "hook", rng.randrange(low, max(low + 1, high)), 0.0, phase)
