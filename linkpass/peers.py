"""Which peers a node heartbeats: a bounded set, the same on both ends of every pair, never the whole fabric.

Heartbeating every node on every rail costs each node ``nodes x rails / interval`` packets a second each way
(50,000 at 64 nodes x 8 rails x 10 ms), which no daemon sustains at 1,024 nodes. Two sets instead:

* **path peers**, heartbeated on every shared rail every ``heartbeat_ms`` and judged per (peer, rail) path:
  the ``ring_neighbours`` nodes on each side of this one in the fabric map's order (its rail neighbours: the
  map lists nodes in rack order, so these usually share its leaf switches), and ``random_peers`` more at
  pseudo-random ring offsets drawn from the map's fingerprint. Offsets are circulant (i talks to i +/- d), so
  if A picks B then B picks A: both ends judge the path from both directions, and the count is bounded
  (``2 x (ring_neighbours + ceil(random_peers / 2))``, or everyone on a smaller fabric). A fabric with no more
  nodes than that is heartbeated all to all, as before;
* **watch peers**, the other nodes of the jobs running here (the node watch's evidence: silence on every rail),
  heartbeated on one rail per interval, the rails taking turns, so a job peer costs one packet per interval
  each way instead of one per rail. Both ends run the job, so both heartbeat each other.

Every node still learns of every peer's dead NIC at once: down and up notices go to the whole fabric
(:mod:`linkpass.engine`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["offsets", "path_peers"]


def offsets(n: int, ring_neighbours: int, random_peers: int, seed: int) -> list[int]:
    """Ring offsets d in [1, n // 2]: node i heartbeats i + d and i - d (mod n) for each."""
    if n < 2:
        return []
    top = n // 2
    near = list(range(1, min(ring_neighbours, top) + 1))
    pool = list(range(len(near) + 1, top + 1))
    far = random.Random(seed).sample(pool, min(len(pool), (random_peers + 1) // 2))
    return sorted(near + far)


def path_peers(nodes: Sequence[str], me: str, ring_neighbours: int, random_peers: int, seed: int) -> list[str]:
    """The path peers of ``me`` among ``nodes`` (in the fabric map's order): see the module's docstring."""
    n = len(nodes)
    i = list(nodes).index(me)
    out = set()
    for d in offsets(n, ring_neighbours, random_peers, seed):
        out.add(nodes[(i + d) % n])
        out.add(nodes[(i - d) % n])
    out.discard(me)
    return sorted(out)


def bound(ring_neighbours: int, random_peers: int) -> int:
    """The most path peers a node has, whatever the fabric's size."""
    return 2 * (ring_neighbours + (random_peers + 1) // 2)
