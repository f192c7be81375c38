"""Solve: pick one strategy per node so that predicted time is least, within a memory budget.

Input: a :class:`CostedGraph`. Output: a :class:`Solution` (chosen strategy index per node).
Solved exactly as a mixed-integer linear program with HiGHS (``scipy.optimize.milp``).

Formulation (one mesh axis of N ranks)::

    x[n, s] in {0, 1}     node n runs strategy s                      (_add_choice_rows)
    sum_s x[n, s] = 1                                                  (_add_choice_rows)

    For every edge e = (producer u -> slot i of consumer v), with Q the placements u may
    produce and P those v may require in slot i, a transport block
    y[e, q, p] >= 0:
    sum_p y[e, q, p] = sum_{s: out(s) = q} x[u, s]                      (_add_edge_rows)
    sum_q y[e, q, p] = sum_{t: in_i(t) = p} x[v, t]                     (_add_edge_rows)
    (with integral x, y[e, q, p] = 1 exactly for the placements chosen at both ends)
    y[e, q, p] = 0 for q != p where no collective may sit on e (tuple outputs; parameters,
    which may only be sliced locally, never gathered)

    One collective serves every consumer that needs the same placement of u, so the
    resharding cost is paid once per (producer, q, p):
    r[u, q, p] >= y[e, q, p] for every edge e leaving u                (_add_reshard_rows)

    Tied nodes (identical repeated blocks, ``passes/tying.py``) share x columns; edges whose
    ends are tied alike share one transport block; compute, resharding and memory terms are
    multiplied by the number of nodes they stand for.

    memory:  sum_{parameters n} sum_s bytes[n, s] x[n, s] <= budget     (_add_memory_row)

    minimise sum x[n, s] compute_s[n, s] + sum r[u, q, p] reshard_s[u, q, p] + z call_sync_s + w

    where z >= r[u, q, p] for every resharding that talks to other ranks: the call's wait for ranks
    out of step, paid once when it has any collective (``pricing.call_sync_s``), and
    w = per_compute sum u[n, s] compute_s[n, s] with u[n, s] >= x[n, s] + z - 1, its share per
    second of the call's compute (``Hardware.call_sync_wait_per_compute``: the product of z and the
    compute, exact at the optimum since every price is at least 0). Where the profile bounds the compute
    that wait grows with (``Hardware.call_sync_wait_compute_range_s``, L), a column c in [0, 1] priced
    per_compute L relaxes each row to u[n, s] >= x[n, s] + z - 1 - c: the objective is linear in c, so
    the optimum takes c at 0 or 1, and w = per_compute min(compute, L) when z = 1. Neither is built on
    profiles without those terms.

    Where the profile's core share holds only up to a range of compute (``Hardware.core_share_range_s``, T,
    with the share s and the fair share f; ``pricing.ChoicePrice.fair_share_saving_s``), the compute's wall
    time is min(compute, (s/f) compute + (1 - s/f) T): each x column is priced at s/f of its compute, and
    (1 - s/f) min(compute, T) is held as above with z = 1: v[n, s] >= x[n, s] - d, v priced (1 - s/f) times
    x's compute and one column d in [0, 1] priced (1 - s/f) T (_add_fair_share_rows).

    A training plan (``costed.training``) prices the backward too, as the runtime runs it
    (``passes/backward.py``): a forward resharding r[u, q, p] that a gradient goes back through
    has a twin b[u, q, p] >= y[e, q, p] (those edges e only) priced at its adjoint route; a
    consumer's strategies are grouped by (p, f) instead of p, f saying whether it reads u
    replicated for rank-divergent work, and one all-reduce of u's gradient (Megatron's f) is
    paid once per producer: f[u] >= y[e, q, (R, True)]. Activations kept for the backward join
    the memory row, once per producer and placement they are read in: m[u, p] >= y[e, q, (p, .)]
    for every saving edge e, with bytes(u, p) in the memory row (_add_reshard_rows).

The coefficients and the blocked transport variables come from ``passes/pricing.py``
(:func:`~autotp.passes.pricing.compute_s`, :func:`~autotp.passes.pricing.reshard_s`,
:func:`~autotp.passes.pricing.is_blocked`), the accounting :func:`evaluate_choice` and the
plan's predicted times use too (:func:`~autotp.passes.pricing.price_choice`).

The transport block keeps the model linear and small: its size grows with the number of
*placements* (a handful per tensor), not with products of strategy counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from autotp.base.errors import PlanError
from autotp.base.placements import Placement, Replicate, Shard
from autotp.base.shapes import concrete_shape
from autotp.cost_model.hardware import Hardware
from autotp.passes.backward import reads_through_f
from autotp.passes.costing import CostedGraph
from autotp.passes.pricing import call_sync_s, compute_s, is_blocked, is_collective_reshard, price_choice, reshard_s
from autotp.passes.quantized import Link
from autotp.passes.strategies import Edge
from autotp.passes.uneven import largest_shard_nbytes

__all__ = ["Solution", "evaluate_choice", "min_parameter_bytes", "solve"]


@dataclasses.dataclass(frozen=True)
class Solution:
    """The solver's answer: a strategy index per node, the objective, and solver facts."""

    choice: dict[str, int]
    objective_s: float
    solve_time_s: float
    status: str
    mip_gap: float


class _Model:
    """Sparse MILP builder: columns with cost and bounds, rows of (col, coef) with bounds."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.rows: list[list[tuple[int, float]]] = []
        self.row_lb: list[float] = []
        self.row_ub: list[float] = []

    def column(self, cost: float, lb: float, ub: float, integer: bool) -> int:
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lb: float, ub: float) -> None:
        self.rows.append(terms)
        self.row_lb.append(lb)
        self.row_ub.append(ub)


def _add_choice_rows(model: _Model, costed: CostedGraph, rep: dict[str, str]) -> dict[str, list[int]]:
    """One-hot x columns per representative node; compute cost summed over the nodes tied to it."""
    x: dict[str, list[int]] = {}
    cost: dict[str, np.ndarray] = {}
    for name in costed.graph.order:
        leader = rep[name]
        per_strategy = [compute_s(costed, name, s) for s in range(len(costed.graph.strategies[name]))]
        cost[leader] = cost.get(leader, 0.0) + np.asarray(per_strategy)
    for leader, per_strategy in cost.items():
        x[leader] = [model.column(float(c), 0.0, 1.0, True) for c in per_strategy]
        model.row([(col, 1.0) for col in x[leader]], 1.0, 1.0)
    return x


_EdgeKey = tuple[str, str, int, bool, bool]


def _canonical_edges(costed: CostedGraph, rep: dict[str, str]) -> tuple[list[_EdgeKey], dict[str, frozenset]]:
    """Edges with tied endpoints merged, and each node's set of canonical out-edges."""
    keys: dict[_EdgeKey, None] = {}
    out_edges: dict[str, set] = defaultdict(set)
    for edge in costed.graph.edges:
        key = (rep[edge.producer], rep[edge.consumer], edge.slot, edge.must_match, edge.local_only)
        keys[key] = None
        out_edges[edge.producer].add(key)
    return list(keys), {name: frozenset(e) for name, e in out_edges.items()}


_ConsumerKey = tuple[Placement, bool]
"""How a consumer's strategy reads an edge: its input placement, and (training plans, where a
gradient flows back along the edge) whether it reads it through Megatron's f."""


def _add_edge_rows(model: _Model, costed: CostedGraph, x: dict[str, list[int]],
                   edges: list[_EdgeKey]) -> dict[_EdgeKey, dict[tuple[Placement, _ConsumerKey], int]]:
    """Transport blocks, one per canonical edge; returns the y columns of every edge."""
    strategies = costed.graph.strategies
    training = costed.training
    saved = {(p, c, slot) for p, c, slot in training.saved} if training is not None else set()
    y_of: dict[_EdgeKey, dict[tuple[Placement, _ConsumerKey], int]] = {}
    for key in edges:
        producer, consumer, slot, _, _ = key
        edge = Edge(*key)
        grad = training is not None and training.grad_flows(producer, consumer)
        out_of: dict[Placement, list[int]] = defaultdict(list)
        for s, strategy in enumerate(strategies[producer]):
            out_of[strategy.output].append(x[producer][s])
        in_of: dict[_ConsumerKey, list[int]] = defaultdict(list)
        for t, strategy in enumerate(strategies[consumer]):
            in_of[strategy.inputs[slot], grad and reads_through_f(strategy, slot)].append(x[consumer][t])
        trivial = len(out_of) == 1 and len(in_of) == 1 and next(iter(out_of)) == next(iter(in_of))[0]
        if trivial and not next(iter(in_of))[1] and (producer, consumer, slot) not in saved:
            continue  # nothing to choose and nothing to pay on this edge
        y: dict[tuple[Placement, _ConsumerKey], int] = {}
        for q in out_of:
            for p in in_of:
                blocked = is_blocked(edge, q, p[0])
                y[q, p] = model.column(0.0, 0.0, 0.0 if blocked else 1.0, False)
        for q, cols in out_of.items():
            model.row([(y[q, p], 1.0) for p in in_of] + [(c, -1.0) for c in cols], 0.0, 0.0)
        for p, cols in in_of.items():
            model.row([(y[q, p], 1.0) for q in out_of] + [(c, -1.0) for c in cols], 0.0, 0.0)
        y_of[key] = y
    return y_of


def _add_reshard_rows(model: _Model, costed: CostedGraph, rep: dict[str, str], out_edges: dict[str, frozenset],
                      y_of: dict[_EdgeKey, dict[tuple[Placement, _ConsumerKey], int]],
                      ) -> tuple[list[tuple[int, float]], list[int]]:
    """r columns: one collective per (producer, q, p), shared by all its consumers; in a training
    plan b columns (the adjoint of a resharding a gradient goes back through), f columns (one
    all-reduce of the gradient per producer read replicated by rank-divergent work) and m columns
    (one saved activation per producer and placement read in). Returns the memory-row terms of
    the m columns and the r columns of the reshardings that talk to other ranks.

    Tied producers whose out-edges are the same canonical edges make the same choice and pay
    the same collectives, so they share one r column whose cost is multiplied by their count.
    """
    training = costed.training
    saved = set(training.saved) if training is not None else set()
    memory_terms: list[tuple[int, float]] = []
    groups: dict[tuple[str, frozenset], list[str]] = defaultdict(list)
    for name, keys in out_edges.items():
        groups[rep[name], keys].append(name)

    def at_least(cost: float, ys: list[int]) -> int:
        col = model.column(cost, 0.0, 1.0, False)
        for y in ys:
            model.row([(col, 1.0), (y, -1.0)], 0.0, np.inf)
        return col

    talking: list[int] = []  # r columns of reshardings that talk to other ranks
    for (_, keys), members in sorted(groups.items(), key=lambda item: (item[0][0], sorted(item[0][1]))):
        leader, count = members[0], len(members)
        pairs: dict[tuple[Placement, Placement], list[int]] = defaultdict(list)
        graded: dict[tuple[Placement, Placement], list[int]] = defaultdict(list)
        through_f: list[int] = []
        kept: dict[Placement, list[int]] = defaultdict(list)
        for key in sorted(keys):
            grad = training is not None and training.grad_flows(key[0], key[1])
            saving = (key[0], key[1], key[2]) in saved
            for (q, (p, f)), col in y_of.get(key, {}).items():
                if model.ub[col] <= 0:
                    continue
                if q != p:
                    pairs[q, p].append(col)
                    if grad:
                        graded[q, p].append(col)
                if f:
                    through_f.append(col)
                if saving:
                    kept[p].append(col)
        for (q, p), ys in sorted(pairs.items(), key=lambda item: (str(item[0][0]), str(item[0][1]))):
            col = at_least(reshard_s(costed, leader, q, p) * count, ys)
            if is_collective_reshard(costed, leader, q, p):
                talking.append(col)
        for (q, p), ys in sorted(graded.items(), key=lambda item: (str(item[0][0]), str(item[0][1]))):
            seconds = costed.backward_s(leader, q, p)
            if seconds:
                at_least(seconds * count, ys)
        if through_f:
            at_least(costed.replicated_input_s(leader) * count, through_f)
        for p, ys in sorted(kept.items(), key=lambda item: str(item[0])):
            memory_terms.append((at_least(0.0, ys), costed.activation_bytes(leader, p) * count))
    return memory_terms, talking


def _add_call_sync_rows(model: _Model, costed: CostedGraph, x: dict[str, list[int]], talking: list[int]) -> None:
    """The call's wait for ranks out of step, paid when it has any collective (``pricing.call_sync_s``):
    z >= r for every resharding r that talks, priced ``Hardware.call_sync_wait_s``; and its share per
    second of the call's compute, the product z x compute: per strategy column x, u >= x + z - 1 priced
    ``per_compute`` times x's compute (u = x z at the optimum, since every price is at least 0; the
    tightest linear form of the product, no big-M), up to the profile's compute range L: one column c in
    [0, 1] priced ``per_compute`` L, and each row u >= x + z - 1 - c (module docstring). Nothing is built on
    profiles without those terms."""
    sync_s = call_sync_s(costed)
    per_compute = costed.hardware.call_sync_wait_per_compute
    if not talking or not (sync_s or per_compute):
        return
    z = model.column(sync_s, 0.0, 1.0, False)
    for r in talking:
        model.row([(z, 1.0), (r, -1.0)], 0.0, np.inf)
    if not per_compute:
        return
    bound_s = costed.hardware.call_sync_wait_compute_range_s
    capped = [(model.column(per_compute * bound_s, 0.0, 1.0, False), 1.0)] if bound_s else []
    for cols in x.values():
        for col in cols:
            if model.cost[col] > 0:
                u = model.column(per_compute * model.cost[col], 0.0, 1.0, False)
                model.row([(u, 1.0), (col, -1.0), (z, -1.0), *capped], -1.0, np.inf)


def _add_fair_share_rows(model: _Model, x: dict[str, list[int]], hardware: Hardware) -> None:
    """The compute beyond the profile's core-share range at the fair share (module docstring): every x column's
    price scaled by s/f, and (1 - s/f) min(compute, T) held by one v column per x column with a compute and one
    d column. Reads the x columns' prices as the nodes' compute, so it runs after every row that does the same
    (_add_call_sync_rows). Nothing is built on profiles without a range."""
    range_s, saved = hardware.core_share_range_s, 1.0 - hardware.core_share / hardware.fair_core_share
    if not range_s or saved <= 0:
        return
    d = model.column(saved * range_s, 0.0, 1.0, False)
    for cols in x.values():
        for col in cols:
            if model.cost[col] > 0:
                v = model.column(saved * model.cost[col], 0.0, 1.0, False)
                model.row([(v, 1.0), (col, -1.0), (d, 1.0)], 0.0, np.inf)
                model.cost[col] *= 1.0 - saved


def _add_memory_row(model: _Model, costed: CostedGraph, x: dict[str, list[int]], rep: dict[str, str],
                    budget_bytes: float | None, activation_terms: list[tuple[int, float]]) -> None:
    if budget_bytes is None:
        return
    coef: dict[int, float] = defaultdict(float)
    for name, per in costed.memory_bytes.items():
        for s, b in enumerate(per):
            coef[x[rep[name]][s]] += float(b)
    for col, nbytes in activation_terms:
        coef[col] += nbytes
    if coef:
        model.row(sorted(coef.items()), -np.inf, float(budget_bytes))


_OBJECTIVE_SCALE = 1e6
"""The MILP's objective is in microseconds: HiGHS stops once its incumbent is within an absolute
gap of 1e-6 (``mip_abs_gap``, which scipy's ``milp`` does not expose) of the bound, and plan times
are ~1e-4 s, so an objective in seconds would stop at plans up to 1% dearer than the best."""


def evaluate_choice(costed: CostedGraph, choice: dict[str, int]) -> float | None:
    """Objective of a given choice, by the same accounting as the MILP; ``None`` if the choice is invalid.

    Used to check the solver against brute force and to price reference plans
    (:func:`~autotp.passes.pricing.price_choice` has the breakdown).
    """
    price = price_choice(costed, choice)
    return None if price.blocked else price.total_s


def _store_sliced_parameters_split(costed: CostedGraph, choice: dict[str, int],
                                   links: tuple[Link, ...] = ()) -> dict[str, int]:
    """A replicated parameter that every reader slices the same way is stored as that slice.

    Slicing is free in the cost model, so the MILP is indifferent between "hold R, slice on
    use" and "hold the slice"; the second holds 1/N of the bytes. Same time, less memory.
    A linked part (``links``) moves only with its leader, and the leader only when each of its
    parts then takes a placement its readers slice to (or keeps its own).
    """
    strategies = costed.graph.strategies
    needs: dict[str, set] = defaultdict(set)
    for edge in costed.graph.edges:
        if edge.producer in costed.memory_bytes:
            needs[edge.producer].add(strategies[edge.consumer][choice[edge.consumer]].inputs[edge.slot])
    improved = dict(choice)
    followers = {link.follower for link in links}
    for name, wanted in needs.items():
        if len(wanted) != 1 or not isinstance(strategies[name][choice[name]].output, Replicate) or name in followers:
            continue
        (placement,) = wanted
        for index, strategy in enumerate(strategies[name]):
            if strategy.output == placement and placement != strategies[name][choice[name]].output:
                moved = _moved_with_parts(costed, choice, needs, links, name, index)
                if moved is not None:
                    improved.update(moved)
    return improved


def _moved_with_parts(costed: CostedGraph, choice: dict[str, int], needs: dict[str, set], links: tuple[Link, ...],
                      name: str, index: int) -> dict[str, int] | None:
    """``name`` at strategy ``index`` and each part linked to it at the strategy the link gives; ``None``
    when some part could not go along (forbidden, or a placement its readers do not all slice to)."""
    moved = {name: index}
    for link in links:
        if link.leader != name:
            continue
        target = link.mapping[index]
        if target is None:
            return None
        placement = costed.graph.strategies[link.follower][target].output
        if target != choice[link.follower] and needs.get(link.follower, {placement}) != {placement}:
            return None
        moved[link.follower] = target
    return moved


def _add_link_rows(model: _Model, x: dict[str, list[int]], rep: dict[str, str], links: tuple[Link, ...]) -> None:
    """For each link, the follower's strategy j is taken exactly when the leader takes one mapped to j."""
    seen = set()
    for link in links:
        leader, follower = rep[link.leader], rep[link.follower]
        if (leader, follower) in seen or leader == follower:
            continue
        seen.add((leader, follower))
        for target, column in enumerate(x[follower]):
            terms = [(x[leader][i], 1.0) for i, mapped in enumerate(link.mapping) if mapped == target]
            model.row([*terms, (column, -1.0)], 0.0, 0.0)


def min_parameter_bytes(costed: CostedGraph) -> int:
    """The least per-rank parameter bytes any plan can reach (every parameter split its best way)."""
    return sum(min(per) for per in costed.memory_bytes.values())


def _smallest_fitting_world_size(costed: CostedGraph, budget_bytes: float) -> int | None:
    """The least world size at which every parameter, split its best way, fits ``budget_bytes``."""

    def floor_at(world_size: int) -> int:
        total = 0
        for name in costed.memory_bytes:
            val = costed.graph.nodes[name].meta["val"]
            placements = [Replicate(), *(Shard(d) for d, size in enumerate(concrete_shape(val)) if size > 1)]
            total += min(largest_shard_nbytes(val.shape, val.element_size(), p, world_size) for p in placements)
        return total

    candidates = [n for n in range(costed.graph.world_size + 1, 1025)] + [2**k for k in range(11, 17)]
    return next((n for n in candidates if floor_at(n) <= budget_bytes), None)


def solve(costed: CostedGraph, *, memory_budget_bytes: float | None, time_limit_s: float = 60.0,
          tie: dict[str, str] | None = None, count_activations: bool = True,
          links: tuple[Link, ...] = ()) -> Solution:
    """Solve the plan MILP exactly (HiGHS). Raises :class:`PlanError` when the budget cannot be met.

    ``count_activations`` (a training plan): the activations kept for the backward count
    against ``memory_budget_bytes`` (False: the budget holds parameters, gradients and optimizer
    state only, as ``memory_budget="auto"`` means).

    ``tie`` maps nodes to representatives (``passes/tying.py``): tied nodes share decision
    variables, so a stack of identical layers costs about one layer to solve. ``links``
    (``passes/quantized.py``) make one node's strategy follow another's: the parts of a
    quantized weight split as one.
    """
    start = time.perf_counter()
    floor = min_parameter_bytes(costed)
    if memory_budget_bytes is not None and floor > memory_budget_bytes:
        fits = _smallest_fitting_world_size(costed, memory_budget_bytes)
        more = f"world_size={fits} would fit this budget" if fits else "no world size up to 65536 fits this budget"
        raise PlanError(
            f"memory budget of {memory_budget_bytes / 2**20:.2f} MiB per rank cannot hold the parameters: even with "
            f"every parameter split, a rank needs {floor / 2**20:.2f} MiB at world_size={costed.graph.world_size}; "
            f"{more}. Raise memory_budget= to at least {floor} bytes or use more ranks."
        )
    rep = tie if tie is not None else {name: name for name in costed.graph.order}
    model = _Model()
    x = _add_choice_rows(model, costed, rep)
    edges, out_edges = _canonical_edges(costed, rep)
    y_of = _add_edge_rows(model, costed, x, edges)
    activation_terms, talking = _add_reshard_rows(model, costed, rep, out_edges, y_of)
    _add_call_sync_rows(model, costed, x, talking)
    _add_fair_share_rows(model, x, costed.hardware)
    _add_link_rows(model, x, rep, links)
    _add_memory_row(model, costed, x, rep, memory_budget_bytes, activation_terms if count_activations else [])

    data, rows, cols = [], [], []
    for i, terms in enumerate(model.rows):
        for col, coef in terms:
            rows.append(i)
            cols.append(col)
            data.append(coef)
    matrix = coo_matrix((data, (rows, cols)), shape=(len(model.rows), len(model.cost))).tocsr()
    result = milp(
        c=np.asarray(model.cost) * _OBJECTIVE_SCALE,
        constraints=LinearConstraint(matrix, np.asarray(model.row_lb), np.asarray(model.row_ub)),
        integrality=np.asarray(model.integer),
        bounds=Bounds(np.asarray(model.lb), np.asarray(model.ub)),
        options={"time_limit": time_limit_s, "disp": False, "presolve": True},
    )
    if result.x is None:
        if result.status == 1:  # time limit reached before any feasible plan
            raise PlanError(f"the plan solver found no plan within time_limit_s={time_limit_s}; raise time_limit_s=")
        raise PlanError(f"the plan solver found no feasible plan ({result.message}); raise memory_budget= or use more ranks")
    chosen = {leader: int(np.argmax([result.x[c] for c in cols_])) for leader, cols_ in x.items()}
    choice = _store_sliced_parameters_split(costed, {name: chosen[rep[name]] for name in costed.graph.order}, links)
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return Solution(choice, float(result.fun) / _OBJECTIVE_SCALE, time.perf_counter() - start, str(result.message), gap)
