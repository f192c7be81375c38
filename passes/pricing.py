"""Pricing: what a choice of strategies costs, by the one accounting the whole planner uses.

The price of a choice (one strategy per node) is the sum of two kinds of terms:

- **compute**: ``CostedGraph.compute_s[node][strategy]`` for every node (:func:`compute_s`);
- **resharding**: for every producer, one collective per *distinct* placement its readers need
  that differs from the placement it produces (:func:`reshard_s`); one collective serves every
  reader that needs the same placement.

Some reshardings are not allowed at all (:func:`is_blocked`, :func:`blocked_reason`): nothing may sit on an edge
from an op that returns several tensors, and a parameter may only be sliced locally, never
gathered. The MILP (``passes/solver.py``) builds its objective coefficients and its blocked
transport variables from these same functions; :func:`price_choice` adds them up for
a given choice (``solver.evaluate_choice``, the plan's predicted times and collectives, and the
per-node alternatives of ``autotp/planning/alternatives.py`` all call it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from autotp.base.placements import Placement, placement_to_str
from autotp.base.strategy import Strategy
from autotp.passes.costing import CostedGraph
from autotp.passes.resharding import is_local_reshard
from autotp.passes.strategies import Edge

__all__ = ["ChoicePrice", "Resharding", "blocked_reason", "compute_s", "is_blocked", "price_choice", "price_outputs", "reshard_s"]


@dataclasses.dataclass(frozen=True)
class Resharding:
    """One collective (or local reshard) on ``producer``'s output: ``src`` -> ``dst`` for ``consumers``."""

    producer: str
    src: Placement
    dst: Placement
    time_s: float
    consumers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChoicePrice:
    """Predicted seconds of a choice: compute, and the reshardings in graph order.

    ``blocked`` says why the choice is impossible (``""`` when it is possible); a blocked
    price has no meaningful times.
    """

    compute_s: float
    reshardings: tuple[Resharding, ...]
    blocked: str = ""

    @property
    def comm_s(self) -> float:
        return sum(r.time_s for r in self.reshardings)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def compute_s(costed: CostedGraph, name: str, index: int) -> float:
    """Seconds per rank of node ``name`` running its strategy number ``index``."""
    return costed.compute_s[name][index]


def reshard_s(costed: CostedGraph, producer: str, src: Placement, dst: Placement) -> float:
    """Seconds to turn ``producer``'s output from ``src`` into ``dst`` (paid once per producer and ``dst``)."""
    return costed.reshard_s(producer, src, dst)


def is_blocked(edge: Edge, src: Placement, dst: Placement) -> bool:
    """True when nothing may turn ``src`` into ``dst`` on ``edge`` (see :func:`blocked_reason`)."""
    return src != dst and (edge.must_match or (edge.local_only and not is_local_reshard(src, dst)))


def blocked_reason(costed: CostedGraph, edge: Edge, src: Placement, dst: Placement) -> str:
    """Why nothing may turn ``src`` into ``dst`` on ``edge`` (``""`` when something may)."""
    if not is_blocked(edge, src, dst):
        return ""
    if edge.must_match:
        return f"{edge.producer} returns several tensors: nothing can reshard them between it and {edge.consumer}"
    return (f"parameter {edge.producer} would have to be gathered for {edge.consumer} "
            f"({placement_to_str(src)} -> {placement_to_str(dst)}); parameters are only sliced locally")


def price_outputs(costed: CostedGraph, edges: Iterable[Edge], strategy_of: Callable[[str], Strategy],
                  reshard: Callable[[str, Placement, Placement], float] | None = None) -> tuple[tuple[Resharding, ...], str]:
    """The reshardings on ``edges`` under ``strategy_of`` (node -> its strategy), or why they are impossible.

    One :class:`Resharding` per producer and distinct placement its readers need that differs
    from the one it produces, in the order of first need along ``edges``. ``reshard`` prices
    one resharding (default :func:`reshard_s`; a caller pricing many choices passes a cached one).
    """
    needed: dict[tuple[str, Placement], list[str]] = {}
    for edge in edges:
        src = strategy_of(edge.producer).output
        dst = strategy_of(edge.consumer).inputs[edge.slot]
        if dst == src:
            continue
        why = blocked_reason(costed, edge, src, dst)
        if why:
            return (), why
        needed.setdefault((edge.producer, dst), []).append(edge.consumer)
    price = reshard if reshard is not None else (lambda producer, src, dst: reshard_s(costed, producer, src, dst))
    return tuple(Resharding(producer, strategy_of(producer).output, dst,
                            price(producer, strategy_of(producer).output, dst), tuple(users))
                 for (producer, dst), users in needed.items()), ""


def price_choice(costed: CostedGraph, choice: Mapping[str, int]) -> ChoicePrice:
    """The price of ``choice`` (node -> strategy index, every node of the graph), by the MILP's accounting."""
    strategies = costed.graph.strategies
    compute = sum(compute_s(costed, name, index) for name, index in choice.items())
    reshardings, why = price_outputs(costed, costed.graph.edges, lambda name: strategies[name][choice[name]])
    return ChoicePrice(compute, reshardings, why)
