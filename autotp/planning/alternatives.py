"""Per-node alternatives: what each other candidate strategy of a node would cost, priced when a plan is built.

:func:`node_alternatives` needs the costed strategy graph, which the plan does not keep, so it
runs inside the planner (``autotp/planning/planner.py``) and its result is stored on each
:class:`~autotp.planning.plan.NodeDecision`; the reports (``autotp/inspect/explanations.py``) only
read and format it. For every node it prices each other candidate strategy *with the
neighbours' choices held fixed*: the change in the node's own compute time plus the change in
resharding on its input edges (its producers now have to deliver other placements) and output
edges (its consumers now receive another placement), through the planner's one pricing
function (:func:`autotp.passes.pricing.price_outputs`): a delta is the change in the plan's
predicted time if only this node changed.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.utils._pytree as pytree

from autotp.base.placements import Placement, placement_to_str
from autotp.base.shapes import concrete_shape
from autotp.base.strategy import Strategy
from autotp.passes.costing import CostedGraph
from autotp.passes.pricing import compute_s, price_outputs, reshard_s
from autotp.passes.resharding import route_label
from autotp.passes.strategies import Edge
from autotp.planning.decisions import Alternative

__all__ = ["MAX_ALTERNATIVES", "node_alternatives", "strategy_text"]


def strategy_text(strategy: Strategy) -> str:
    """``(R, S(0)) -> S(2)``; a placeholder's strategy is just its placement, e.g. ``S(0)``."""
    out = placement_to_str(strategy.output)
    if not strategy.inputs:
        return out
    return f"({', '.join(placement_to_str(p) for p in strategy.inputs)}) -> {out}"


def _value_key(value: object) -> tuple:
    """What a resharding's price depends on besides the placements: the tensors' shapes and dtypes."""
    return tuple((concrete_shape(v), v.dtype) for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))


MAX_ALTERNATIVES = 8
"""Alternatives kept per node (cheapest first); a GEMM can have a dozen candidates."""


class _Pricer:
    """Resharding cost of one producer's output given what each of its readers needs."""

    def __init__(self, costed: CostedGraph, chosen: dict[str, Strategy]) -> None:
        self.costed = costed
        self.chosen = chosen
        self.readers: dict[str, list[Edge]] = defaultdict(list)
        self.edges_in: dict[str, list[Edge]] = defaultdict(list)
        for edge in costed.graph.edges:
            self.readers[edge.producer].append(edge)
            self.edges_in[edge.consumer].append(edge)
        self._cache: dict[tuple[tuple, Placement, Placement], float] = {}
        self._keys: dict[str, tuple] = {}
        self._base: dict[str, dict[str, float]] = {}
        self._labels: dict[tuple[tuple, Placement, Placement], str] = {}

    def _key(self, producer: str, src: Placement, dst: Placement) -> tuple[tuple, Placement, Placement]:
        if producer not in self._keys:
            self._keys[producer] = _value_key(self.costed.graph.nodes[producer].meta.get("val"))
        return (self._keys[producer], src, dst)  # the same tensor shape in every layer: priced once

    def reshard_s(self, producer: str, src: Placement, dst: Placement) -> float:
        key = self._key(producer, src, dst)
        if key not in self._cache:
            self._cache[key] = reshard_s(self.costed, producer, src, dst)
        return self._cache[key]

    def route_label(self, producer: str, src: Placement, dst: Placement) -> str:
        """The label of the route :meth:`reshard_s` prices (chosen by the same shapes: found once per key)."""
        key = self._key(producer, src, dst)
        if key not in self._labels:
            self._labels[key] = route_label(step.kind for step in self.costed.reshard_route(producer, src, dst))
        return self._labels[key]

    def base_cost(self, producer: str) -> dict[str, float]:
        """:meth:`producer_cost` of the plan as chosen (cached)."""
        if producer not in self._base:
            self._base[producer] = self.producer_cost(producer, {})[0]
        return self._base[producer]

    def producer_cost(self, producer: str, override: dict[str, Strategy]) -> tuple[dict[str, float], str]:
        """Seconds per resharding kind on ``producer``'s output edges, and why it is impossible ('' if not)."""
        reshardings, why = price_outputs(self.costed, self.readers[producer],
                                         lambda name: override.get(name, self.chosen[name]), self.reshard_s)
        by_kind: dict[str, float] = defaultdict(float)
        for r in reshardings:
            label = (route_label(step.kind for step in r.route) if r.backward
                     else self.route_label(r.producer, r.src, r.dst))
            by_kind[f"backward {label}" if r.backward else label] += r.time_s
        return dict(by_kind), why


def node_alternatives(costed: CostedGraph, choice: dict[str, int], *, memory_budget_bytes: float | None = None,
                      limit: int = MAX_ALTERNATIVES) -> dict[str, tuple[Alternative, ...]]:
    """Every node's other candidate strategies, priced with its neighbours held fixed (cheapest first).

    A weight moves with the one op that reads it: an op's alternative takes the weight to the
    placement the alternative reads it in (a memory change, no collective), and a weight's
    alternative lets its reader take its cheapest strategy that reads the weight that way.
    Without this, nearly every alternative of a GEMM would be impossible, as weights are
    never gathered.
    """
    graph = costed.graph
    chosen = {name: graph.strategies[name][index] for name, index in choice.items()}
    index_of = {name: {s: i for i, s in enumerate(graph.strategies[name])} for name in graph.order}
    pricer = _Pricer(costed, chosen)
    total_bytes = sum(per[choice[name]] for name, per in costed.memory_bytes.items())

    @functools.cache
    def own_weights(name: str) -> dict[int, str]:
        """Slot -> parameter read only by ``name``."""
        return {e.slot: e.producer for e in pricer.edges_in[name]
                if e.producer in graph.parameters and all(r.consumer == name for r in pricer.readers[e.producer])}

    def price(override: dict[str, Strategy]) -> tuple[float, dict[str, float], int, str]:
        affected = list(dict.fromkeys([*override, *(e.producer for n in override for e in pricer.edges_in[n])]))
        comm: dict[str, float] = defaultdict(float)
        for u in affected:
            before = pricer.base_cost(u)
            after, why = pricer.producer_cost(u, override)
            if why:
                return 0.0, {}, 0, why
            for kind in set(after) | set(before):
                comm[kind] += after.get(kind, 0.0) - before.get(kind, 0.0)
        compute = sum(compute_s(costed, n, index_of[n][s]) - compute_s(costed, n, choice[n]) for n, s in override.items())
        memory = sum(costed.memory_bytes[n][index_of[n][s]] - costed.memory_bytes[n][choice[n]]
                     for n, s in override.items() if n in costed.memory_bytes)
        return compute, {k: v for k, v in comm.items() if abs(v) > 1e-15}, int(memory), ""

    def with_weights(name: str, strategy: Strategy) -> tuple[dict[str, Strategy], list[str]]:
        override = {name: strategy}
        moved = []
        for slot, weight in own_weights(name).items():
            want = next((s for s in graph.strategies[weight] if s.output == strategy.inputs[slot]), None)
            if want is not None and want != chosen[weight]:
                override[weight] = want
                moved.append(f"{graph.parameters[weight]} {placement_to_str(chosen[weight].output)} -> "
                             f"{placement_to_str(want.output)}")
        return override, moved

    def candidates(name: str, strategy: Strategy) -> list[tuple[dict[str, Strategy], str]]:
        """Ways to take ``strategy`` at ``name``: (override, note) pairs."""
        readers = {e.consumer for e in pricer.readers[name]}
        if name in graph.parameters and len(readers) == 1:
            reader = next(iter(readers))
            slots = [e.slot for e in pricer.readers[name]]
            found = []
            for option in graph.strategies[reader]:
                if all(option.inputs[i] == strategy.output for i in slots):
                    override, _ = with_weights(reader, option)
                    override[name] = strategy
                    note = "" if option == chosen[reader] else f"with {reader} as {strategy_text(option)}"
                    found.append((override, note))
            return found or [({name: strategy}, "")]
        override, moved = with_weights(name, strategy)
        return [(override, f"weight follows: {'; '.join(moved)}" if moved else "")]

    result: dict[str, tuple[Alternative, ...]] = {}
    for name in graph.order:
        strategies = graph.strategies[name]
        if len(strategies) < 2:
            continue
        alternatives = []
        for index, strategy in enumerate(strategies):
            if index == choice[name]:
                continue
            best: Alternative | None = None
            for override, note in candidates(name, strategy):
                compute, comm, memory, blocked = price(override)
                comm_items = tuple(sorted(comm.items()))
                if blocked:
                    option = Alternative(strategy_text(strategy), None, note=blocked)
                else:
                    if memory > 0 and memory_budget_bytes is not None and total_bytes + memory > memory_budget_bytes:
                        note = f"{note}; " if note else ""
                        note += "exceeds the memory budget"
                    option = Alternative(strategy_text(strategy), compute + sum(v for _, v in comm_items), compute,
                                         comm_items, memory, note)
                if best is None or _rank(option) < _rank(best):
                    best = option
            if best is not None:
                alternatives.append(best)
        alternatives.sort(key=_rank)
        result[name] = tuple(alternatives[:limit])
    return result


def _rank(alt: Alternative) -> tuple[bool, float]:
    return alt.delta_s is None, alt.delta_s if alt.delta_s is not None else 0.0
