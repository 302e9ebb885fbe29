"""Clock sync over the whole probe graph: one offset per node from all the pairwise estimates.

Why: each node pair's fit (:func:`clockworkd.lens.clockpair.estimate_pair`) has an error of its own, so
offsets chained along different paths of the probe graph disagree. :func:`solve_graph` reconciles them by
weighted least squares, so that offsets agree around every loop, and names the edges that do not fit (an
asymmetric or faulty path biases its pair's offset in a way no pairwise fit can see, but the loops it is
part of can); :class:`SuspectTracker` keeps only the edges that stay out of line solve after solve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["Edge", "EdgeMeasurement", "GraphSolution", "SuspectTracker", "solve_graph"]

IntArray = npt.NDArray[np.int64]
_Node = TypeVar("_Node", str, int)


@runtime_checkable
class EdgeMeasurement(Protocol):
    """What :func:`solve_graph` needs of an edge: ``clock_b - clock_a`` and its one-sigma uncertainty."""

    @property
    def offset_ns(self) -> float: ...

    @property
    def uncertainty_ns(self) -> float: ...


Edge = tuple[str, str]


@dataclass(frozen=True)
class GraphSolution:
    """Every node's clock offset to the reference (``clock_node - clock_ref``), reconciled.

    ``uncertainty_ns`` comes from the covariance of the weighted least squares solution, scaled up by
    the reduced chi-square when the edges disagree more than their own uncertainties say (so a graph
    whose loops do not close reports it in every node's uncertainty). ``edge_residuals_ns`` is
    ``solved (x_b - x_a) - measured`` per edge used; ``edge_scores`` the same divided by its own
    expected standard deviation (a bridge edge, which no loop checks, scores 0). ``loop_rms_ns`` is
    the residuals' root-mean-square per redundant edge (None without loops). ``suspect_edges`` were
    left out of the solution because they disagreed with the rest by more than the threshold;
    ``suspect_residuals_ns`` says by how much (their measurement minus what the rest implies).
    Nodes without a path of edges to the reference are in ``unreachable`` and nowhere else.
    """

    reference: str
    at_ns: int | None
    offsets_ns: Mapping[str, float]
    uncertainty_ns: Mapping[str, float]
    edge_residuals_ns: Mapping[Edge, float]
    edge_scores: Mapping[Edge, float]
    loop_rms_ns: float | None
    reduced_chi2: float | None
    unreachable: tuple[str, ...]
    suspect_edges: tuple[Edge, ...] = ()
    suspect_residuals_ns: Mapping[Edge, float] = field(default_factory=dict)

    def relative(self, a: str, b: str) -> float:
        """``clock_b - clock_a`` from the solution (KeyError for an unreachable node)."""
        return self.offsets_ns[b] - self.offsets_ns[a]


def _edge_value(m: Any, at_ns: int | None) -> tuple[float, float]:
    if at_ns is not None and hasattr(m, "offset_at"):
        off = float(m.offset_at(at_ns))
        unc = float(m.uncertainty_at(at_ns)) if hasattr(m, "uncertainty_at") else float(m.uncertainty_ns)
    else:
        off = float(m.offset_ns)
        unc = float(m.uncertainty_ns)
    return off, unc


def _component(reference: _Node, adjacency: Mapping[_Node, set[_Node]]) -> set[_Node]:
    """Nodes reachable from ``reference``."""
    seen = {reference}
    todo = [reference]
    while todo:
        node = todo.pop()
        for nxt in adjacency.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _wls(
    n: int, ia: IntArray, ib: IntArray, obs: npt.NDArray[np.float64], sig: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Solve ``x_b - x_a = obs`` (index 0 is the reference, fixed at 0) by weighted least squares.

    Returns the solution (with x_0 = 0), the covariance of x_1.., the residuals and their standard
    deviations. Normal equations are dense: n^2 floats and an n^3/3 Cholesky, ~0.1 s at 1,000 nodes.
    """
    w = 1.0 / (sig * sig)
    # normal matrix of the incidence matrix (row e: -1 at a, +1 at b), reference row/column dropped
    nmat = np.zeros((n, n))
    np.add.at(nmat, (ia, ia), w)
    np.add.at(nmat, (ib, ib), w)
    np.add.at(nmat, (ia, ib), -w)
    np.add.at(nmat, (ib, ia), -w)
    rhs = np.zeros(n)
    np.add.at(rhs, ib, w * obs)
    np.add.at(rhs, ia, -w * obs)
    sub = nmat[1:, 1:]
    try:
        chol = np.linalg.cholesky(sub)
        inv_l = np.linalg.inv(chol)
        cov = inv_l.T @ inv_l
    except np.linalg.LinAlgError:
        cov = np.linalg.pinv(sub)
    x = np.zeros(n)
    x[1:] = cov @ rhs[1:]
    resid = (x[ib] - x[ia]) - obs
    full = np.zeros((n, n))
    full[1:, 1:] = cov
    # var(fitted x_b - x_a) = c_bb + c_aa - 2 c_ab; residual variance = sigma^2 - that (leverage)
    fitted_var = full[ib, ib] + full[ia, ia] - 2.0 * full[ia, ib]
    resid_sd = np.sqrt(np.maximum(sig * sig - fitted_var, 0.0))
    return x, cov, resid, resid_sd


def _pick_outliers(
    score: npt.NDArray[np.float64], ia: IntArray, ib: IntArray, n: int, threshold: float, budget: int
) -> list[int]:
    """Edges to set aside this round: the worst above ``threshold``, plus others far from it.

    A bad edge drags the residuals of its loop-mates up with it, so an edge is only taken when neither
    end is within one hop of a worse edge above the threshold (taken or not); the rest wait for the
    next solve, where the bad edges no longer pull on them. Taking several at once keeps a graph with many
    bad edges to a few solves instead of one per edge. Should the round's edges together cut the
    graph (each alone cannot: bridges score 0), only the worst is taken.
    """
    order = np.argsort(-np.abs(score))
    over = [int(i) for i in order if abs(score[i]) > threshold]
    if not over or budget <= 0:
        return []
    neighbours: list[set[int]] = [set() for _ in range(n)]
    for a, b in zip(ia.tolist(), ib.tolist(), strict=True):
        neighbours[a].add(b)
        neighbours[b].add(a)
    picked: list[int] = []
    blocked: set[int] = set()
    for i in over:
        a, b = int(ia[i]), int(ib[i])
        free = a not in blocked and b not in blocked
        blocked |= {a, b} | neighbours[a] | neighbours[b]  # a deferred edge still shadows its neighbours
        if free:
            picked.append(i)
            if len(picked) >= budget:
                break
    if len(picked) > 1:
        keep = np.ones(score.size, dtype=bool)
        keep[picked] = False
        adjacency: dict[int, set[int]] = {}
        for a, b in zip(ia[keep].tolist(), ib[keep].tolist(), strict=True):
            adjacency.setdefault(a, set()).add(b)
            adjacency.setdefault(b, set()).add(a)
        if len(_component(0, adjacency)) < n:
            picked = picked[:1]
    return picked


def solve_graph(
    edges: Mapping[Edge, EdgeMeasurement | Any],
    reference: str,
    at_ns: int | None = None,
    *,
    nodes: Iterable[str] = (),
    suspect_sigma: float = 4.0,
    max_suspects: int | None = None,
    min_uncertainty_ns: float = 1.0,
) -> GraphSolution:
    """Reconcile pairwise offsets into one offset per node by weighted least squares.

    Each edge ``(a, b)`` says ``x_b - x_a = offset`` with sigma ``uncertainty``; ``x_reference = 0``.
    When an edge has ``offset_at`` (a :class:`clockworkd.lens.clockpair.PairEstimate`) and ``at_ns`` is given
    (on the reference's clock), it is evaluated at the same moment on its own ``a``'s clock, ``at_ns + x_a``,
    from a first solve: with offsets of milliseconds and drifts of ~100 ppm, evaluating every edge at ``at_ns`` as
    is would be off by up to ~10 us. ``nodes`` names nodes that should be there even without edges, so a node
    whose probes all fail shows up as unreachable instead of vanishing.

    Outliers are taken out by Baarda-style data snooping: the edge whose standardized residual is
    largest and above ``suspect_sigma`` is set aside and the rest solved again, until none is left
    above. One bad edge shares its error with every edge of its loops, so flagging all edges above the
    threshold at once would blame good ones (edges far apart from each other are taken in the same
    round, see :func:`_pick_outliers`). An edge whose removal would cut a node off from the reference
    is never set aside: nothing else checks it. ``max_suspects`` caps how many are set aside (default:
    a tenth of the edges).

    With Gaussian errors a single solve flags a good edge with probability ~6e-5 per edge at 4 sigma
    (one every few solves on a graph of 8,000 edges): :class:`SuspectTracker` keeps only the edges
    flagged solve after solve.
    """
    # collect the edges, evaluated at at_ns
    meas: dict[Edge, tuple[float, float]] = {}
    for key, m in edges.items():
        a, b = key
        if a == b:
            raise ValueError(f"edge {a}->{b} joins a node to itself")
        off, unc = _edge_value(m, at_ns)
        if not (math.isfinite(off) and math.isfinite(unc)):
            raise ValueError(f"edge {a}->{b} has a non-finite offset or uncertainty ({off}, {unc})")
        meas[(a, b)] = (off, max(unc, min_uncertainty_ns))

    all_nodes = set(nodes) | {n for e in meas for n in e} | {reference}
    adjacency: dict[str, set[str]] = {}
    for a, b in meas:
        adjacency.setdefault(a, set()).add(b)
        adjacency.setdefault(b, set()).add(a)
    reach = _component(reference, adjacency)
    unreachable = tuple(sorted(all_nodes - reach))
    order = [reference, *sorted(reach - {reference})]
    index = {name: i for i, name in enumerate(order)}
    used = [e for e in meas if e[0] in reach]
    if len(order) == 1:
        return GraphSolution(reference, at_ns, {reference: 0.0}, {reference: 0.0}, {}, {}, None, None, unreachable)

    ia_all = np.array([index[a] for a, _ in used], dtype=np.int64)
    ib_all = np.array([index[b] for _, b in used], dtype=np.int64)
    obs_all = np.array([meas[e][0] for e in used])
    sig_all = np.array([meas[e][1] for e in used])
    timed = [i for i, e in enumerate(used) if hasattr(edges[e], "offset_at")]
    if at_ns is not None and timed:
        # The moment at_ns on the reference's clock reads at_ns + x_a on a's clock, and an edge's
        # estimate runs on a's clock: 50 ms of offset at 200 ppm of drift is 10 us. A first solve
        # gives x_a to microseconds, which is nanoseconds after the drift.
        x0 = _wls(len(order), ia_all, ib_all, obs_all, sig_all)[0]
        for i in timed:
            m = edges[used[i]]
            off, unc = _edge_value(m, at_ns + round(float(x0[ia_all[i]])))
            obs_all[i], sig_all[i] = off, max(unc, min_uncertainty_ns)
    active = np.ones(len(used), dtype=bool)
    cap = max(1, len(used) // 10) if max_suspects is None else max_suspects
    suspects: list[int] = []
    n = len(order)

    while True:
        ia, ib, obs, sig = ia_all[active], ib_all[active], obs_all[active], sig_all[active]
        x, cov, resid, resid_sd = _wls(n, ia, ib, obs, sig)
        dof = int(active.sum()) - (n - 1)
        checked = resid_sd > 1e-6 * sig  # bridges have no redundancy: nothing to test them against
        score = np.zeros_like(resid)
        score[checked] = resid[checked] / resid_sd[checked]
        if len(suspects) >= cap or dof <= 0:
            break
        picked = _pick_outliers(score, ia, ib, n, suspect_sigma, cap - len(suspects))
        if not picked:
            break
        idx = np.flatnonzero(active)[picked]
        active[idx] = False
        suspects.extend(int(i) for i in idx)

    chi2 = float(np.sum((resid / sig) ** 2))
    reduced = chi2 / dof if dof > 0 else None
    inflate = max(1.0, reduced) if reduced is not None else 1.0
    var = np.zeros(n)
    var[1:] = np.diag(cov) * inflate
    offsets = {name: float(x[i]) for name, i in index.items()}
    uncert = {name: math.sqrt(max(float(var[i]), 0.0)) for name, i in index.items()}
    active_edges = [e for e, on in zip(used, active, strict=True) if on]
    residuals = {e: float(r) for e, r in zip(active_edges, resid, strict=True)}
    scores = {e: float(s) for e, s in zip(active_edges, score, strict=True)}
    loop_rms = math.sqrt(float(np.sum(resid * resid)) / dof) if dof > 0 else None
    suspect_edges = tuple(used[i] for i in suspects)
    suspect_resid = {used[i]: float(obs_all[i] - (x[ib_all[i]] - x[ia_all[i]])) for i in suspects}
    return GraphSolution(
        reference=reference,
        at_ns=at_ns,
        offsets_ns=offsets,
        uncertainty_ns=uncert,
        edge_residuals_ns=residuals,
        edge_scores=scores,
        loop_rms_ns=loop_rms,
        reduced_chi2=reduced,
        unreachable=unreachable,
        suspect_edges=suspect_edges,
        suspect_residuals_ns=suspect_resid,
    )


class SuspectTracker:
    """Turns per-solve suspects into *persistent* ones: flagged in ``need`` of the last ``of`` solves.

    Why: one solve can set aside a good edge when a burst of queueing spoils a window; an asymmetric
    or faulty path stays out of line solve after solve. Memory is ``of`` bits per edge ever seen.
    """

    def __init__(self, need: int = 3, of: int = 5) -> None:
        if not 1 <= need <= of:
            raise ValueError(f"need 1 <= need <= of, got need={need}, of={of}")
        self.need = need
        self.of = of
        self._history: dict[Edge, list[bool]] = {}

    def update(self, solution: GraphSolution) -> tuple[Edge, ...]:
        """Record one solve; return the edges persistently suspect now, sorted."""
        flagged = set(solution.suspect_edges)
        seen = flagged | set(solution.edge_residuals_ns)
        for edge in list(self._history):
            if edge not in seen:
                del self._history[edge]  # the edge was not measured: its history no longer applies
        for edge in seen:
            hist = self._history.setdefault(edge, [])
            hist.append(edge in flagged)
            del hist[: -self.of]
        return tuple(sorted(e for e, h in self._history.items() if sum(h) >= self.need))
