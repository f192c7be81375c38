"""The records a :class:`~autotp.planning.plan.Plan` is made of: the decision taken for each graph node
(:class:`NodeDecision`, with the :class:`Alternative` strategies it was priced against) and each resharding the
rewrite inserts (:class:`CollectiveDecision`). Frozen values; the plan, its text and the reports read them.
"""

from __future__ import annotations

import dataclasses

from autotp.base.placements import placement_from_str
from autotp.base.reshard import ReshardKind
from autotp.base.strategy import Strategy

__all__ = ["Alternative", "CollectiveDecision", "NodeDecision"]


@dataclasses.dataclass(frozen=True)
class Alternative:
    """Another strategy a node could have taken, priced with its neighbours' choices held fixed.

    ``delta_s`` = ``compute_delta_s`` + the sum of ``comm_delta_s``: predicted seconds per forward
    pass relative to the chosen strategy (positive: slower). ``comm_delta_s`` is split by
    resharding kind (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_gather+slice``...)
    on the node's input and output edges. ``delta_s`` is ``None`` when the strategy is not
    possible while the neighbours keep their choices (``note`` says why, e.g. a parameter would
    have to be gathered); ``memory_delta_bytes`` is the change in parameter bytes per rank (in a
    training plan: with their gradients and optimizer state). In a training plan the deltas are
    per training step, backward reshardings included (kinds prefixed ``backward``).
    """

    strategy: str
    delta_s: float | None
    compute_delta_s: float = 0.0
    comm_delta_s: tuple[tuple[str, float], ...] = ()
    memory_delta_bytes: int = 0
    note: str = ""


@dataclasses.dataclass(frozen=True)
class NodeDecision:
    """The chosen strategy of one node, with its predicted compute time on one rank.

    ``input_nodes`` names the producer of each input slot (the graph's edges); ``target`` is the
    FQN of a parameter/buffer/constant placeholder (``""`` otherwise); ``shape``/``dtype``
    describe the node's (first) output tensor; ``alternatives`` are the other candidate
    strategies, cheapest first (at most a handful; see :class:`Alternative`).
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    output: str
    compute_s: float
    module: str = ""
    fallback: bool = False
    input_nodes: tuple[str, ...] = ()
    target: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    alternatives: tuple[Alternative, ...] = ()

    def strategy(self) -> Strategy:
        return Strategy(tuple(placement_from_str(p) for p in self.inputs), placement_from_str(self.output))


@dataclasses.dataclass(frozen=True)
class CollectiveDecision:
    """One resharding the rewrite inserts: ``producer``'s output from ``src`` to ``dst``.

    ``steps``: the kinds of the route's steps (saved by name: ``"all_gather"``, ``"slice"``...).
    """

    producer: str
    src: str
    dst: str
    steps: tuple[ReshardKind, ...]
    nbytes: int
    time_s: float
    consumers: tuple[str, ...]
    module: str = ""
