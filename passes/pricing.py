"""Pricing: what a choice of strategies costs, by the one accounting the whole planner uses.

The price of a choice (one strategy per node) is the sum of two kinds of terms:

- **compute**: ``CostedGraph.compute_s[node][strategy]`` for every node (:func:`compute_s`);
- **resharding**: for every producer, one collective per *distinct* placement its readers need
  that differs from the placement it produces (:func:`reshard_s`); one collective serves every
  reader that needs the same placement.
- **backward resharding** (a training plan only, ``costed.training``), as the training runtime
  runs it (:mod:`autotp.passes.backward`): each forward resharding above that a gradient goes
  back through costs its adjoint route (:meth:`CostedGraph.backward_s`), and each producer
  whose value some rank-divergent reader takes replicated costs one all-reduce of its gradient
  (Megatron's f, :meth:`CostedGraph.replicated_input_s`), however many such readers it has.

- **compute at the fair share** (:attr:`ChoicePrice.fair_share_saving_s`): on a profile whose core share holds
  only up to a range of compute (``Hardware.core_share_range_s``), what the nodes' compute beyond it saves at
  the fair share (:meth:`autotp.cost_model.hardware.Hardware.shared_core_compute_s`; the MILP holds it with
  one column per strategy, ``passes/solver.py``).

- **call sync** (:func:`call_sync_s`): a choice with at least one forward resharding that talks to
  other ranks pays ``Hardware.call_sync_wait_s`` once, the wait of the call's first collective for
  ranks that entered the call out of step, plus ``call_sync_wait_per_compute`` times the choice's
  compute, for ranks that drift apart while they compute
  (:func:`autotp.cost_model.collectives.call_sync_wait_s`; the MILP holds the product with one
  column per strategy, ``passes/solver.py``).

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

from autotp.base.placements import ExpertLocal, Partial, Placement, Replicate, placement_to_str
from autotp.base.reshard import ReshardStep, reshard_possible
from autotp.base.strategy import Strategy
from autotp.cost_model.collectives import call_sync_wait_s
from autotp.passes.backward import REPLICATED_INPUT_BACKWARD, reads_through_f
from autotp.passes.costing import CostedGraph
from autotp.passes.resharding import is_collective_step, is_local_reshard
from autotp.passes.strategies import Edge

__all__ = [
    "ChoicePrice", "Resharding", "blocked_reason", "call_sync_s", "compute_s", "is_blocked", "is_collective_reshard",
    "price_choice",
    "price_outputs", "reshard_s", "saved_activation_bytes",
]


@dataclasses.dataclass(frozen=True)
class Resharding:
    """One collective (or local reshard) on ``producer``'s output: ``src`` -> ``dst`` for ``consumers``.

    ``backward``: it is on the gradient of ``producer``'s output, in the backward pass: the
    adjoint ``route`` of the forward ``src -> dst`` resharding, or (``route`` an all-reduce,
    ``src`` P, ``dst`` R) Megatron's f for the rank-divergent ``consumers`` reading it replicated.
    """

    producer: str
    src: Placement
    dst: Placement
    time_s: float
    consumers: tuple[str, ...]
    backward: bool = False
    route: tuple[ReshardStep, ...] = ()


@dataclasses.dataclass(frozen=True)
class ChoicePrice:
    """Predicted seconds of a choice: compute, and the reshardings in graph order.

    ``blocked`` says why the choice is impossible (``""`` when it is possible); a blocked
    price has no meaningful times. ``compute_s``: the nodes' compute; ``local_s``: the reshardings
    that talk to no other rank (a local slice, zeros on the ranks other than 0), which run on the
    rank like any op and so count as compute (:attr:`predicted_compute_s`), not communication: the
    communication is what the collectives add, as the accuracy benchmark measures it (the graph
    with its collectives replaced by local stand-ins still runs those ops). ``fair_share_saving_s``: what the
    nodes' compute beyond the profile's core-share range saves at the fair share (module docstring), taken off
    :attr:`predicted_compute_s`.
    """

    compute_s: float
    reshardings: tuple[Resharding, ...]
    blocked: str = ""
    sync_s: float = 0.0  # the call's wait for ranks out of step when it has a collective (call_sync_s)
    local_s: float = 0.0
    fair_share_saving_s: float = 0.0

    @property
    def predicted_compute_s(self) -> float:
        """The nodes' compute and the local reshardings', less what the compute beyond the core-share range saves."""
        return self.compute_s + self.local_s - self.fair_share_saving_s

    @property
    def comm_s(self) -> float:
        """The reshardings with a collective and the call's wait for ranks out of step."""
        return sum(r.time_s for r in self.reshardings) - self.local_s + self.sync_s

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
        return self.predicted_compute_s + self.comm_s


def compute_s(costed: CostedGraph, name: str, index: int) -> float:
    """Seconds per rank of node ``name`` running its strategy number ``index``."""
    return costed.compute_s[name][index]


def reshard_s(costed: CostedGraph, producer: str, src: Placement, dst: Placement) -> float:
    """Seconds to turn ``producer``'s output from ``src`` into ``dst`` (paid once per producer and ``dst``)."""
    return costed.reshard_s(producer, src, dst)


def is_collective_reshard(costed: CostedGraph, producer: str, src: Placement, dst: Placement) -> bool:
    """True when turning ``producer``'s output from ``src`` into ``dst`` talks to other ranks (its route has a
    collective step), False for local slices alone."""
    return any(is_collective_step(step.kind) for step in costed.reshard_route(producer, src, dst))


def call_sync_s(costed: CostedGraph, compute_s: float = 0.0) -> float:
    """Seconds a call whose forward has a collective and ``compute_s`` of compute waits for ranks out of step
    (module docstring)."""
    return call_sync_wait_s(costed.hardware, 1, compute_s)


def is_blocked(edge: Edge, src: Placement, dst: Placement) -> bool:
    """True when nothing may turn ``src`` into ``dst`` on ``edge`` (see :func:`blocked_reason`)."""
    return src != dst and (edge.must_match or not reshard_possible(src, dst)
                           or (edge.local_only and not is_local_reshard(src, dst)))


def blocked_reason(costed: CostedGraph, edge: Edge, src: Placement, dst: Placement) -> str:
    """Why nothing may turn ``src`` into ``dst`` on ``edge`` (``""`` when something may)."""
    if not is_blocked(edge, src, dst):
        return ""
    if edge.must_match:
        return f"{edge.producer} returns several tensors: nothing can reshard them between it and {edge.consumer}"
    if not reshard_possible(src, dst):
        if isinstance(src, ExpertLocal):
            return f"only an expert-placed op reads {placement_to_str(src)}, not {edge.consumer}"
        return f"only an expert-placed op makes {placement_to_str(dst)}, not {edge.producer} ({placement_to_str(src)})"
    return (f"parameter {edge.producer} would have to be gathered for {edge.consumer} "
            f"({placement_to_str(src)} -> {placement_to_str(dst)}); parameters are only sliced locally")


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
    graded: set[tuple[str, Placement]] = set()  # (producer, dst) whose resharding a gradient goes back through
    through_f: dict[str, list[str]] = {}
    training = costed.training
    for edge in edges:
        src = strategy_of(edge.producer).output
        consumer = strategy_of(edge.consumer)
        dst = consumer.inputs[edge.slot]
        grad = training is not None and training.grad_flows(edge.producer, edge.consumer)
        if grad and reads_through_f(consumer, edge.slot):
            through_f.setdefault(edge.producer, []).append(edge.consumer)
        if dst == src:
            continue
        why = blocked_reason(costed, edge, src, dst)
        if why:
            return (), why
        needed.setdefault((edge.producer, dst), []).append(edge.consumer)
        if grad:
            graded.add((edge.producer, dst))
    price = reshard if reshard is not None else (lambda producer, src, dst: reshard_s(costed, producer, src, dst))
    forward = tuple(Resharding(producer, strategy_of(producer).output, dst,
                               price(producer, strategy_of(producer).output, dst), tuple(users))
                    for (producer, dst), users in needed.items())
    backward = []
    for r in forward:
        if (r.producer, r.dst) in graded:
            route = costed.backward_route(r.producer, r.src, r.dst)
            if route:
                backward.append(Resharding(r.producer, r.src, r.dst, costed.backward_s(r.producer, r.src, r.dst),
                                           r.consumers, True, route))
    for producer, users in through_f.items():
        backward.append(Resharding(producer, Partial(), Replicate(), costed.replicated_input_s(producer), tuple(users),
                                   True, REPLICATED_INPUT_BACKWARD))
    return forward + tuple(backward), ""


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
    collective = [bool(r.route) and any(is_collective_step(step.kind) for step in r.route) if r.backward
                  else is_collective_reshard(costed, r.producer, r.src, r.dst) for r in reshardings]
    synced = any(is_collective and not r.backward for r, is_collective in zip(reshardings, collective))
    local = sum(r.time_s for r, is_collective in zip(reshardings, collective) if not is_collective)
    return ChoicePrice(compute, reshardings, why, call_sync_s(costed, compute) if synced else 0.0, local,
                       compute - costed.hardware.shared_core_compute_s(compute))
