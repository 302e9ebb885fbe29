"""The peer-copy ring the members of a generation agree on, through the generation's rendezvous store.

Why through the store: every member already publishes there where its copies are to be sent (its listener), so
each also says where it runs (:class:`torchpass.failure_domains.Place`: its node and failure domain) at no extra
round trip. The ring is decided once per job and then kept (a ring that changed with the placement would leave
stale copies in host memory, and a rank would have to keep copies of more shards than the budget counts):

* a member that knows the ring publishes it before the group forms (:func:`publish`);
* once every member's place is read (:func:`exchange`, which only returns when all have published theirs), a
  member that does not know the ring yet (a newcomer, or everyone in the first generation) takes the published
  one, or, when nobody published one (the first generation), computes it from the places read, as every other
  member does from the same places (:func:`decide`).

This module imports no torch: the store is anything with ``set``, ``get`` and ``check`` (c10d's stores).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from torchpass.failure_domains import Place, ring_order, ring_successors

__all__ = ["RINGS_KEY", "KeyStore", "decide", "exchange", "publish", "separated"]

RINGS_KEY = "peercopy/rings"


class KeyStore(Protocol):
    """The part of a c10d store used here."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def publish(store: KeyStore, rings: Sequence[tuple[int, ...]]) -> None:
    """Before the group forms: the ring this member knows, for the newcomers of this generation."""
    if rings:
        store.set(RINGS_KEY, json.dumps([list(ring) for ring in rings]))


def exchange(
    store: KeyStore, rank: int, world_size: int, address: tuple[str, int], place: Place
) -> tuple[dict[int, tuple[str, int]], dict[int, Place]]:
    """Publish this member's listener and place, and read every member's: (listeners, places) by slot."""
    host, port = address
    store.set(f"peercopy/{rank}", f"{host} {port} {place.wire()}".strip())
    listeners: dict[int, tuple[str, int]] = {}
    places: dict[int, Place] = {}
    for slot in range(world_size):
        peer_host, peer_port, *where = store.get(f"peercopy/{slot}").decode().split(maxsplit=2)
        listeners[slot] = (peer_host, int(peer_port))
        places[slot] = Place.from_wire(where[0] if where else "")
    return listeners, places


def decide(
    store: KeyStore, known: Sequence[tuple[int, ...]], places: dict[int, Place], replicas: int, shards: int
) -> tuple[list[tuple[int, ...]], bool]:
    """Every replica row's ring over its shards, and whether it was decided here and now (False: known already, or
    taken from a member that knew it)."""
    if len(known) == replicas:
        return list(known), False
    if store.check([RINGS_KEY]):
        return [tuple(int(v) for v in ring) for ring in json.loads(store.get(RINGS_KEY).decode())], False
    rings = [ring_order([places[r * shards + s] for s in range(shards)]) for r in range(replicas)]
    return rings, True


def separated(ring: Sequence[int], row_places: Sequence[Place], copies: int) -> bool:
    """Whether no shard of a row shares its failure domain (its node when no domain is known) with a rank that
    keeps one of its copies."""

    def where(p: Place) -> str:
        return p.domain or p.node

    return all(
        where(row_places[holder]) != where(row_places[shard])
        for shard in ring
        for holder in ring_successors(ring, shard, copies)
    )
