"""Whether a node's failing fabric link is the node's fault or its switch's: the health check's drain rule.

Why: a leaf switch (or a rail's switch) that fails takes every node's link on it down at once. Judged node by
node, each of those nodes' health checks sees its own NIC without carrier (or Fleet Lens suspecting its link)
and drains itself: a whole rail of healthy nodes is lost to one switch. The rule here judges such a fault as one
fault, with Fleet Lens's evidence (every daemon holds every raised suspect, each naming the switch the link
hangs on):

* A link problem of this node (a NIC down or without carrier, or Lens suspecting the node's link) on switch S is
  a **switch fault** when Lens suspects the node links of at least ``switch_fault_nodes`` distinct nodes on S
  (this one included) with confidence :data:`SWITCH_EVIDENCE_CONFIDENCE` or more: nothing is drained for it;
  the health check logs it, and a node it drained for that link before the picture was clear is resumed. A
  less sure suspect is not evidence of a switch: when the only bad paths run between two nodes (two daemons
  up, one dead NIC), Lens names both ends, each at a quarter's confidence, and a switch verdict from them would
  keep a node with a dead NIC in service.
* It is the **node's** fault when Lens suspects this node's link and fewer than ``switch_fault_nodes`` nodes on
  S: the node is drained, as before.
* A NIC that is down while Lens, which watches it (it probes the NIC and hears other nodes now), has not
  judged it yet is **deferred**: no drain now; the next health check decides (Lens raises a suspect within a
  few evaluations, the health check runs every HealthCheckInterval). So the first nodes to run their check
  while a switch dies are not drained before the others' evidence arrives. The wait is **bounded**: a NIC down
  for ``verdict_wait_s`` or longer with still no verdict drains the node, so that no node stays in service
  with a dead NIC for want of a verdict (Lens's probes of it lost, its daemon stalled).
* Without Lens's evidence (Lens off, its daemon unreadable, a NIC Lens does not probe, or a Lens that hears no
  other node at all) each node is judged alone, as before: a NIC down drains.

Pure: the health check (:mod:`slurm_hooks.healthcheck`) reads the NICs and the daemon's ``lens`` reply and
applies :func:`judge_links`; the tests run this same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SWITCH_EVIDENCE_CONFIDENCE", "LinkFault", "LinkJudgement", "judge_links"]

#: The least confidence of a Lens suspect that counts towards a switch fault. Lens halves a link's confidence
#: for every rival link that explains the same bad paths as well (two candidate ends: 1/2 each, before the
#: evidence factor); a switch's dead ports seen from three or more live nodes score about 2/3.
SWITCH_EVIDENCE_CONFIDENCE = 0.5


@dataclass(frozen=True)
class LinkFault:
    """One problem with one of this node's fabric NICs, as the health check words it."""

    nic: str  # the NIC's name on this node, e.g. "ib1"
    text: str  # what the drain reason would say, e.g. "ib1 down (down, carrier 0)"
    from_lens: bool = False  # Lens suspects the link (rather than the kernel saying it is down)


@dataclass(frozen=True)
class LinkJudgement:
    """What the health check does with this node's link faults."""

    drain: list[str] = field(default_factory=list)  # the drain reason's parts: the node's own faults
    switch_faults: list[str] = field(default_factory=list)  # not drained: one fault of a switch, with the evidence
    deferred: dict[str, str] = field(default_factory=dict)  # not drained yet, waiting for Lens's verdict: nic -> why


def _nic_suspects(suspects: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str, float]]:
    """(node, nic, switch, confidence) of every raised suspect that names a node's NIC."""
    out = []
    for s in suspects:
        nic = str(s.get("nic") or "")
        if "/" in nic:
            node, _, name = nic.partition("/")
            out.append((node, name, str(s.get("switch") or ""), float(s.get("confidence") or 0.0)))
    return out


def _watched(paths: Sequence[Mapping[str, Any]], nic_id: str) -> bool:
    """Lens probes ``nic_id`` and hears some peer now (on any NIC): it will judge the NIC. A Lens that hears no
    peer at all (the other daemons not running) gives no evidence."""
    hears = any(int(p.get("received") or 0) > 0 for p in paths)
    return hears and any(p.get("dst") == nic_id or p.get("src") == nic_id for p in paths)


def judge_links(
    node: str,
    faults: Sequence[LinkFault],
    lens: Mapping[str, Any] | None,
    switch_fault_nodes: int,
    down_for: Mapping[str, float] | None = None,
    verdict_wait_s: float = math.inf,
) -> LinkJudgement:
    """Judge this node's link ``faults`` with Lens's snapshot ``lens`` (the daemon's ``lens`` reply; None: no
    Lens evidence). ``switch_fault_nodes``: how many nodes' links on one switch failing together make it a switch
    fault (0: judge every node alone). ``down_for``: seconds each NIC has been seen down (by earlier health
    checks); a NIC down for ``verdict_wait_s`` or longer no longer waits for Lens. See the module docstring for
    the rule."""
    out = LinkJudgement()
    if lens is None or switch_fault_nodes <= 0:
        out.drain.extend(f.text for f in faults)
        return out
    suspects = _nic_suspects(lens.get("suspects") or [])
    paths = list(lens.get("paths") or [])
    for fault in faults:
        mine = [sw for n, name, sw, _ in suspects if n == node and name == fault.nic]
        if not mine:
            waited = (down_for or {}).get(fault.nic, 0.0)
            if not fault.from_lens and _watched(paths, f"{node}/{fault.nic}"):
                if waited < verdict_wait_s:
                    out.deferred[fault.nic] = f"{fault.text}: waiting for Fleet Lens's verdict on {node}/{fault.nic}"
                else:
                    out.drain.append(f"{fault.text}, no Fleet Lens verdict within {verdict_wait_s:g} s")
            else:
                out.drain.append(fault.text)  # Lens does not probe this NIC: no evidence either way
            continue
        switch = mine[0]
        together = sorted({n for n, _, sw, conf in suspects if sw == switch and conf >= SWITCH_EVIDENCE_CONFIDENCE})
        if switch and len(together) >= switch_fault_nodes:
            shown = ", ".join(together[:8]) + (f" and {len(together) - 8} more" if len(together) > 8 else "")
            out.switch_faults.append(
                f"{fault.text}: switch {switch} fault, {len(together)} nodes' links on it fail together ({shown})"
            )
        else:
            out.drain.append(fault.text)
    return out
