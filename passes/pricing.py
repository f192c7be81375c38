"""Pricing: what a choice of strategies costs, by the one accounting the whole planner uses.

The price of a choice (one strategy per node) is the sum of two kinds of terms:

- **compute**: ``CostedGraph.compute_s[node][strategy]`` for every node (:func:`compute_s`);
- **resharding**: for every producer, one collective per *distinct* placement its readers need
  that differs from the placement it produces (:func:`reshard_s`); one collective serves every
  reader that needs the same placement.
- **backward resharding** (a training plan only, ``costed.training``): for every producer whose
  output carries a gradient, one resharding per distinct placement the readers' gradients
  arrive in that differs from the one it needs (:func:`backward_edge`, the rules of
  :mod:`autotp.passes.backward`), priced by the same routes; gradients arriving alike are
  summed first, so one collective serves them.

A training plan's memory adds the activations kept for the backward
(:func:`saved_activation_bytes`): each saved tensor once per placement it is read in.

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
from autotp.passes.backward import arriving_grad_placement, input_grad_placement, output_grad_placement
from autotp.passes.costing import CostedGraph
from autotp.passes.resharding import is_local_reshard
from autotp.passes.strategies import Edge

__all__ = [
    "ChoicePrice", "Resharding", "backward_edge", "blocked_reason", "compute_s", "is_blocked", "price_choice",
    "price_outputs", "reshard_s", "saved_activation_bytes",
]


@dataclasses.dataclass(frozen=True)
class Resharding:
    """One collective (or local reshard) on ``producer``'s output: ``src`` -> ``dst`` for ``consumers``.

    ``backward``: it is on the gradient of ``producer``'s output, in the backward pass, from the
    placement the ``consumers``' gradients arrive in to the one ``producer`` needs.
    """

    producer: str
    src: Placement
    dst: Placement
    time_s: float
    consumers: tuple[str, ...]
    backward: bool = False


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
    def forward(self) -> tuple[Resharding, ...]:
        """The reshardings of the forward pass (what the rewrite inserts)."""
        return tuple(r for r in self.reshardings if not r.backward)

    @property
    def backward(self) -> tuple[Resharding, ...]:
        """The reshardings of the backward pass (a training plan's; autograd issues them)."""
        return tuple(r for r in self.reshardings if r.backward)

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


def backward_edge(costed: CostedGraph, edge: Edge, producer: Strategy, consumer: Strategy) -> tuple[Placement, Placement] | None:
    """``(arriving, needed)`` placements of the gradient going back along ``edge``, or ``None``
    when no gradient goes back (an inference plan, or a value without one)."""
    training = costed.training
    if training is None or not training.grad_flows(edge.producer, edge.consumer):
        return None
    dst = consumer.inputs[edge.slot]
    arriving = arriving_grad_placement(producer.output, dst, input_grad_placement(consumer, edge.slot))
    return arriving, output_grad_placement(producer.output)


def price_outputs(costed: CostedGraph, edges: Iterable[Edge], strategy_of: Callable[[str], Strategy],
                  reshard: Callable[[str, Placement, Placement], float] | None = None) -> tuple[tuple[Resharding, ...], str]:
    """The reshardings on ``edges`` under ``strategy_of`` (node -> its strategy), or why they are impossible.

    One :class:`Resharding` per producer and distinct placement its readers need that differs
    from the one it produces, in the order of first need along ``edges``; in a training plan
    then one per producer and distinct placement its readers' gradients arrive in that differs
    from the one it needs (``backward=True``). ``reshard`` prices one resharding (default
    :func:`reshard_s`; a caller pricing many choices passes a cached one).
    """
    needed: dict[tuple[str, Placement], list[str]] = {}
    gradients: dict[tuple[str, Placement, Placement], list[str]] = {}
    for edge in edges:
        src = strategy_of(edge.producer).output
        dst = strategy_of(edge.consumer).inputs[edge.slot]
        grad = backward_edge(costed, edge, strategy_of(edge.producer), strategy_of(edge.consumer))
        if grad is not None and grad[0] != grad[1]:
            gradients.setdefault((edge.producer, *grad), []).append(edge.consumer)
        if dst == src:
            continue
        why = blocked_reason(costed, edge, src, dst)
        if why:
            return (), why
        needed.setdefault((edge.producer, dst), []).append(edge.consumer)
    price = reshard if reshard is not None else (lambda producer, src, dst: reshard_s(costed, producer, src, dst))
    forward = tuple(Resharding(producer, strategy_of(producer).output, dst,
                               price(producer, strategy_of(producer).output, dst), tuple(users))
                    for (producer, dst), users in needed.items())
    backward = tuple(Resharding(producer, arriving, wanted, price(producer, arriving, wanted), tuple(users), True)
                     for (producer, arriving, wanted), users in gradients.items())
    return forward + backward, ""


def saved_activation_bytes(costed: CostedGraph, strategy_of: Callable[[str], Strategy]) -> float:
    """Bytes per rank of the activations a training plan keeps for the backward (0 for inference).

    Each saved tensor (``costed.training.saved``) once per distinct placement its saving
    readers read it in, at its local size there (the largest rank's).
    """
    if costed.training is None:
        return 0.0
    kept = {(producer, strategy_of(consumer).inputs[slot]) for producer, consumer, slot in costed.training.saved}
    return sum(costed.activation_bytes(producer, placement) for producer, placement in kept)


def price_choice(costed: CostedGraph, choice: Mapping[str, int]) -> ChoicePrice:
    """The price of ``choice`` (node -> strategy index, every node of the graph), by the MILP's accounting
    (a training plan's: forward and backward)."""
    strategies = costed.graph.strategies
    compute = sum(compute_s(costed, name, index) for name, index in choice.items())
    reshardings, why = price_outputs(costed, costed.graph.edges, lambda name: strategies[name][choice[name]])
    return ChoicePrice(compute, reshardings, why)
