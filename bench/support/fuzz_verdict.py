"""A case's verdict, from its fault-free job and its faulted one: ``bitwise``, ``refused``, ``stopped``, or ``FAIL``.

Why these and only these: the product promises that a job with faults ends with every slot's state bitwise equal
to the fault-free run's, or is refused at start with a message, or stops with a diagnosis: where the faults took
every holder of some state (:meth:`fuzz_grammar.Case.may_stop`, or as they landed: :func:`lost_together`), or where
a collective of the script failed after the update and the script then stepped ReduceLROnPlateau with a metric.
Anything else is a defect: a silent difference (exit 0, some tensor or number differs), a hang (the job outlived
its limit), a crash (it failed, and not with a diagnosis the fault plan explains, e.g. a crash loop), a stop the
faults do not explain, or a failure nobody injected. A planned fault that could not be acted is a failure too: a
case that silently tested nothing would count as a pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fuzz_grammar import Case
from .fuzz_jobs import Job

STOP_DIAGNOSES = re.compile(r"no member holds|no replica holds")
# Stops the product documents for what a script does, with the feature that makes each possible.
PLATEAU_AFTER_UPDATE = re.compile(r"stepped ReduceLROnPlateau with a metric")
LATE_KILLS = re.compile(r"job finished but some ranks exited with errors: (\{[^}]*\})")
BN_BUFFERS = re.compile(r"\.bn\.(running_mean|running_var|num_batches_tracked)$")
EMA_BN_BUFFERS = re.compile(r"\.ema\.module\..*\.bn\.(running_mean|running_var|num_batches_tracked)$")


@dataclass(frozen=True)
class Verdict:
    """``verdict`` is one of bitwise, refused, stopped, FAIL; ``kind`` says which failure; ``detail`` the facts."""

    verdict: str
    kind: str = ""
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"


def load_final(folder: Path, slot: int) -> dict[str, Any] | None:
    """The state slot ``slot`` saved at its end, or None when it wrote none."""
    import torch

    path = folder / f"final-slot{slot}.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def first_difference(a: Any, b: Any, where: str, skip: re.Pattern[str] | None = None) -> str | None:
    """Where ``a`` and ``b`` (nested dicts, lists, tensors, numbers) first differ to the bit, or None. Keys whose
    place matches ``skip`` are not compared."""
    import torch

    if skip is not None and skip.search(where):
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
            return f"{where}: tensors differ (max abs diff {diff})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}.{key}", skip)
            if found:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{where}[{i}]", skip)
            if found:
                return found
        return None
    if a != b and not (a != a and b != b):  # NaN == NaN here: the same number
        return f"{where}: {a!r} != {b!r}"
    return None


def replica_difference(case: Case, folder: Path) -> str | None:
    """In the fault-free run, slots that hold the same state must end equal: every DDP rank, every replica of an
    HSDP shard. BatchNorm statistics under FSDP2 are per rank by design (FSDP2 does not synchronise buffers), and
    so are an ``AveragedModel``'s copies of them (it copies the model's buffers as they are after the forward pass,
    before DDP's next broadcast), so they are left out here; the faulted run is compared with them, slot by slot."""
    replicas, shards = case.mesh
    skip = BN_BUFFERS if case.sharded else EMA_BN_BUFFERS
    for slot in range(case.world):
        twin = slot % shards if case.sharded else 0
        if twin == slot or (replicas == 1 and case.sharded):
            continue
        mine, theirs = load_final(folder, slot), load_final(folder, twin)
        if mine is None or theirs is None:
            return f"slot {slot if mine is None else twin} wrote no final state"
        found = first_difference(mine, theirs, f"slot {slot} vs slot {twin}", skip)
        if found:
            return found
    return None


def lost_together(case: Case, job: Job) -> bool:
    """Whether the faults, as they landed, took every holder of some state: co-holders failed with no recovery
    finished between their failures (the coordinator's events, in order). The plan (:meth:`Case.may_stop`) cannot
    always say so: a kill timed after one recovery may land at the same moment as one planned at a mark.

    Under HSDP (no peer copies) a second failure inside an unfinished recovery counts too, whoever it hit: the
    first failure may have abandoned a step on one replica of a shard that the other replica committed (the
    replicas are a step apart until the recovery evens them out), and when the one ahead dies then, no member
    holds the shard at a step the other shards can be brought to (fuzzer seed 500141: slots 0 and 3 killed
    240 ms apart, slot 1 a step behind slot 3)."""
    lost: list[int] = []
    hsdp = case.mesh[0] > 1 and case.mesh[1] > 1
    for event in job.events:
        kind, fields = event.get("kind"), event.get("fields", {})
        if kind == "torchpass.recovered":
            lost = []
        elif kind == "torchpass.member_failed" and isinstance(fields.get("slot"), int):
            slot = int(fields["slot"])
            if any(case.co_holders(other, slot) or hsdp for other in lost):
                return True
            lost.append(slot)
    return False


def judge_reference(case: Case, job: Job) -> Verdict | None:
    """The fault-free run: None when it trained to its end (the faulted run is judged against it), a ``refused``
    verdict when it failed at start with a message, a failure otherwise."""
    if job.timed_out:
        return Verdict("FAIL", "hang", f"the fault-free run did not end in {job.wall_s:.0f} s")
    crashed = job.of_kind("torchpass.member_failed")
    if crashed:
        whys = "; ".join(f"slot {f.get('slot')}: {f.get('why')}" for f in crashed)
        return Verdict("FAIL", "crash", f"a process of the fault-free run died ({whys}): {job.failure()}")
    if job.returncode != 0:
        reason = job.failure()
        if not job.reached(2 * case.mark_per_step) and reason:
            return Verdict("refused", "", reason)
        return Verdict("FAIL", "crash", f"the fault-free run failed (exit {job.returncode}): {reason}")
    for slot in range(case.world):
        if load_final(job.folder, slot) is None:
            return Verdict("FAIL", "crash", f"the fault-free run ended without slot {slot}'s final state")
    differ = replica_difference(case, job.folder)
    if differ:
        return Verdict("FAIL", "replicas-differ", f"the fault-free run's replicas disagree: {differ}")
    return None


def judge_faulted(case: Case, reference: Job, job: Job) -> Verdict:
    """The faulted run against the fault-free one."""
    if job.timed_out:
        return Verdict("FAIL", "hang", f"the faulted run did not end in {job.wall_s:.0f} s: {job.failure()[:300]}")
    kills = sum(a.done and a.fault.kind == "kill" for a in job.acted)
    failed = job.of_kind("torchpass.member_failed")
    if len(failed) > kills:
        whys = "; ".join(f"slot {f.get('slot')}: {f.get('why')}" for f in failed)
        return Verdict("FAIL", "not-injected-failure", f"{len(failed)} member failures for {kills} kills: {whys}")
    if job.returncode != 0 and job.of_kind("torchpass.finished"):
        late = LATE_KILLS.search(job.output)
        if late and set(re.findall(r"': (-?\d+)", late.group(1))) == {"-9"}:
            return Verdict("FAIL", "fault-not-injected", f"a kill landed after training had finished: {late.group(0)}")
    if job.returncode != 0:
        reason = job.failure()
        if STOP_DIAGNOSES.search(reason):
            if case.may_stop() or lost_together(case, job):
                return Verdict("stopped", "", reason)
            return Verdict(
                "FAIL", "unexpected-stop", f"stopped, though the faults left a holder of every state: {reason}"
            )
        if PLATEAU_AFTER_UPDATE.search(reason) and case.scheduler == "plateau" and case.plateau_after_update:
            return Verdict("stopped", "", reason)  # a metric a failed collective made cannot be trusted
        return Verdict("FAIL", "crash", f"exit {job.returncode}: {reason}")
    if job.missing:
        return Verdict("FAIL", "fault-not-injected", "; ".join(job.missing))
    if len(failed) < kills:
        return Verdict("FAIL", "fault-not-injected", f"{kills} kills, {len(failed)} member failures: a kill came late")
    migrations = sum(a.done and a.fault.kind == "migrate" for a in job.acted)
    handed = len(job.of_kind("torchpass.migrated")) + len(job.of_kind("torchpass.departed"))
    if migrations and not handed:
        return Verdict("FAIL", "fault-not-injected", "a migration was accepted but never happened")
    for slot in range(case.world):
        mine, theirs = load_final(job.folder, slot), load_final(reference.folder, slot)
        if mine is None:
            return Verdict("FAIL", "crash", f"exit 0, but slot {slot} wrote no final state")
        found = first_difference(mine, theirs, f"slot {slot}")
        if found:
            return Verdict("FAIL", "silent-difference", found)
    return Verdict("bitwise")
