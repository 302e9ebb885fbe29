"""Which ready spares fill which vacant slots: a node's ranks stay together where they can.

A spare is a (node, local index) slot: a standby node of G GPUs offers G of them, and a node whose single
process died offers that one GPU again once its agent started a spare there. The coordinator fills every
vacancy of a membership change at once, and this module chooses the spares:

* **Best fit per change.** The V slots vacated together (a node crash: its G ranks) go to spares of one node
  when a node has V ready: the one with the fewest ready spares that still has V, so whole standby nodes stay
  whole for the next node crash, and a single rank's crash takes a lone spare slot first (one standby node
  absorbs up to G single-GPU failures from different nodes). When no node has V, the nodes with the most ready
  spares give theirs first, so the replacements are spread over as few nodes as possible.
* **torchrun's order.** A node gives its spares lower local index first, and among the chosen spares the lower
  local index takes the lower slot, so a node crash rebuilt on one spare node keeps its ranks contiguous and in
  local order (slot K*G+J on local index J, when the spare node's local indices are all free), and the choice
  does not depend on which of a node's spares happened to register first.
* **Nothing else moves.** Ready order decides between equals (the spare that registered first goes first), as
  it did when every node ran one rank; a spare named by a planned migration goes to its slot.

A borrowed node's guest (``gH.N.J``: holder job H) is a node of its own, like an agent's; local mode's ``wN``
workers all count as one node: ready order alone, as before. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchpass.coordinator.records import local_of, node_key

__all__ = ["choose_move_target", "choose_spares", "place_name", "slot_moves"]


def choose_move_target(spares: Sequence[str], group: int = 1, near: str = "") -> str:
    """The spare a planned move of one rank takes (``spares`` in ready order, not empty). A single rank's move
    is a single vacancy (best fit: a lone spare slot first). A whole node's move is one rank at a time: the first
    (``group`` ranks to move in all) goes to a node with room for the whole group where there is one, and the
    others follow it to the node of ``near``, the spare the previous one took, while that node has room."""
    if node_key(near):
        same = [wid for wid in spares if node_key(wid) == node_key(near)]
        if same:
            return min(same, key=lambda wid: (local_of(wid), spares.index(wid)))
    size = max(1, min(group, len(spares)))
    chosen = choose_spares(list(range(size)), spares)
    return chosen[0]


def choose_spares(vacant: Sequence[int], spares: Sequence[str], fixed: dict[int, str] | None = None) -> dict[int, str]:
    """Slot -> spare for every slot of ``vacant`` (``spares`` in ready order, at least as many as slots;
    ``fixed``: slots whose spare is already decided, e.g. a planned migration's target)."""
    fixed = dict(fixed or {})
    open_slots = sorted(slot for slot in vacant if slot not in fixed)
    pool = [wid for wid in spares if wid not in fixed.values()]
    if len(pool) < len(open_slots):
        raise ValueError(f"{len(open_slots)} slot(s) to fill from {len(pool)} spare(s)")
    by_node: dict[str, list[str]] = {}
    for wid in pool:  # the nodes in the order their first spare was ready
        by_node.setdefault(node_key(wid), []).append(wid)
    for ready in by_node.values():  # within a node, lower local index first (ready order between equals)
        ready.sort(key=local_of)
    need, chosen = len(open_slots), []
    fitting = [node for node, ready in by_node.items() if len(ready) >= need]
    if fitting:
        best = min(fitting, key=lambda node: len(by_node[node]))  # min keeps the first of equals: ready order
        chosen = by_node[best][:need]
    else:
        for node in sorted(by_node, key=lambda n: -len(by_node[n])):  # stable: ready order between equals
            chosen += by_node[node][: need - len(chosen)]
            if len(chosen) == need:
                break
    order = {wid: k for k, wid in enumerate(pool)}
    first: dict[str, int] = {}
    for wid in pool:
        first.setdefault(node_key(wid), order[wid])
    chosen.sort(key=lambda wid: (first[node_key(wid)], local_of(wid), order[wid]))
    return {**fixed, **dict(zip(open_slots, chosen, strict=True))}


def place_name(wid: str, nodes: Sequence[str]) -> str:
    """Where worker ``wid`` runs, short enough for an AdminComment: ``NODE/J`` (agent K's node ``nodes[K]``, local
    index J), ``holderH/J`` on the node borrowed through holder job H (the ``clockwork-borrowed:`` note names
    that node), or the worker id itself where its id says no node (local mode)."""
    key = node_key(wid)
    if key[:1] == "a" and int(key[1:]) < len(nodes):
        return f"{nodes[int(key[1:])]}/{local_of(wid)}"
    if key[:1] == "g":
        return f"holder{key[1:]}/{local_of(wid)}"
    return wid


def slot_moves(
    initial: Mapping[int, str], members: Mapping[int, str], nodes: Sequence[str]
) -> dict[int, tuple[str, str]]:
    """Slot -> (where its first rank ran, where its rank runs now), for every slot whose rank was replaced or
    moved (a different process holds it now: in place, on the same GPU, too). The job's story of where its
    ranks went, from the coordinator's replicated state alone, which every agent holds."""
    return {
        slot: (place_name(initial[slot], nodes), place_name(wid, nodes))
        for slot, wid in sorted(members.items())
        if slot in initial and initial[slot] != wid
    }
