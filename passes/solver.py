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

    memory:  sum_{parameters n} sum_s bytes[n, s] x[n, s] <= budget     (_add_memory_row)

    minimise sum x[n, s] compute_s[n, s] + sum r[u, q, p] reshard_s[u, q, p]

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

from autotp.errors import PlanError
from autotp.passes.costing import CostedGraph, is_local_reshard
from autotp.placements import Placement

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


def _add_choice_rows(model: _Model, costed: CostedGraph) -> dict[str, list[int]]:
    x: dict[str, list[int]] = {}
    for name in costed.graph.order:
        count = len(costed.graph.strategies[name])
        x[name] = [model.column(costed.compute_s[name][s], 0.0, 1.0, True) for s in range(count)]
        model.row([(col, 1.0) for col in x[name]], 1.0, 1.0)
    return x


def _add_edge_rows(model: _Model, costed: CostedGraph, x: dict[str, list[int]]) -> dict[tuple[str, Placement, Placement], list[int]]:
    """Transport blocks; returns, per (producer, q, p) with q != p, the y columns that need it."""
    needs: dict[tuple[str, Placement, Placement], list[int]] = defaultdict(list)
    strategies = costed.graph.strategies
    for edge in costed.graph.edges:
        out_of: dict[Placement, list[int]] = defaultdict(list)
        for s, strategy in enumerate(strategies[edge.producer]):
            out_of[strategy.output].append(x[edge.producer][s])
        in_of: dict[Placement, list[int]] = defaultdict(list)
        for t, strategy in enumerate(strategies[edge.consumer]):
            in_of[strategy.inputs[edge.slot]].append(x[edge.consumer][t])
        if len(out_of) == 1 and len(in_of) == 1 and next(iter(out_of)) == next(iter(in_of)):
            continue  # nothing to choose and nothing to pay on this edge
        y: dict[tuple[Placement, Placement], int] = {}
        for q in out_of:
            for p in in_of:
                blocked = q != p and (edge.must_match or (edge.local_only and not is_local_reshard(q, p)))
                y[q, p] = model.column(0.0, 0.0, 0.0 if blocked else 1.0, False)
                if q != p and not blocked:
                    needs[edge.producer, q, p].append(y[q, p])
        for q, cols in out_of.items():
            model.row([(y[q, p], 1.0) for p in in_of] + [(c, -1.0) for c in cols], 0.0, 0.0)
        for p, cols in in_of.items():
            model.row([(y[q, p], 1.0) for q in out_of] + [(c, -1.0) for c in cols], 0.0, 0.0)
    return needs


def _add_reshard_rows(model: _Model, costed: CostedGraph, needs: dict[tuple[str, Placement, Placement], list[int]]) -> dict[tuple[str, Placement, Placement], int]:
    r = {}
    for (producer, q, p), ys in sorted(needs.items(), key=lambda item: (item[0][0], str(item[0][1]), str(item[0][2]))):
        cost = costed.reshard_s(producer, q, p)
        r[producer, q, p] = model.column(cost, 0.0, 1.0, False)
        for y in ys:
            model.row([(r[producer, q, p], 1.0), (y, -1.0)], 0.0, np.inf)
    return r


def _add_memory_row(model: _Model, costed: CostedGraph, x: dict[str, list[int]], budget_bytes: float | None) -> None:
    if budget_bytes is None:
        return
    terms = [(x[name][s], float(b)) for name, per in costed.memory_bytes.items() for s, b in enumerate(per)]
    if terms:
        model.row(terms, -np.inf, float(budget_bytes))


def evaluate_choice(costed: CostedGraph, choice: dict[str, int]) -> float | None:
    """Objective of a given choice, by the same accounting as the MILP; ``None`` if the choice is invalid.

    Used to check the solver against brute force and to price reference plans.
    """
    strategies = costed.graph.strategies
    total = sum(costed.compute_s[name][index] for name, index in choice.items())
    paid: set[tuple[str, Placement, Placement]] = set()
    for edge in costed.graph.edges:
        q = strategies[edge.producer][choice[edge.producer]].output
        p = strategies[edge.consumer][choice[edge.consumer]].inputs[edge.slot]
        if q == p:
            continue
        if edge.must_match or (edge.local_only and not is_local_reshard(q, p)):
            return None
        if (edge.producer, q, p) not in paid:
            paid.add((edge.producer, q, p))
            total += costed.reshard_s(edge.producer, q, p)
    return total


def min_parameter_bytes(costed: CostedGraph) -> int:
    """The least per-rank parameter bytes any plan can reach (every parameter split its best way)."""
    return sum(min(per) for per in costed.memory_bytes.values())


def solve(costed: CostedGraph, *, memory_budget_bytes: float | None, time_limit_s: float = 60.0) -> Solution:
    """Solve the plan MILP exactly (HiGHS). Raises :class:`PlanError` when the budget cannot be met."""
    start = time.perf_counter()
    floor = min_parameter_bytes(costed)
    if memory_budget_bytes is not None and floor > memory_budget_bytes:
        raise PlanError(
            f"memory budget of {memory_budget_bytes / 2**20:.2f} MiB per rank cannot hold the parameters: even with "
            f"every parameter split, a rank needs {floor / 2**20:.2f} MiB at world_size={costed.graph.world_size}. "
            "Raise memory_budget= or use more ranks."
        )
    model = _Model()
    x = _add_choice_rows(model, costed)
    needs = _add_edge_rows(model, costed, x)
    _add_reshard_rows(model, costed, needs)
    _add_memory_row(model, costed, x, memory_budget_bytes)

    data, rows, cols = [], [], []
    for i, terms in enumerate(model.rows):
        for col, coef in terms:
            rows.append(i)
            cols.append(col)
            data.append(coef)
    matrix = coo_matrix((data, (rows, cols)), shape=(len(model.rows), len(model.cost))).tocsr()
    result = milp(
        c=np.asarray(model.cost),
        constraints=LinearConstraint(matrix, np.asarray(model.row_lb), np.asarray(model.row_ub)),
        integrality=np.asarray(model.integer),
        bounds=Bounds(np.asarray(model.lb), np.asarray(model.ub)),
        options={"time_limit": time_limit_s, "disp": False, "presolve": True},
    )
    if result.x is None:
        raise PlanError(f"the plan solver found no feasible plan ({result.message}); raise memory_budget= or use more ranks")
    choice = {name: int(np.argmax([result.x[c] for c in cols_])) for name, cols_ in x.items()}
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return Solution(choice, float(result.fun), time.perf_counter() - start, str(result.message), gap)
