"""How the graph's outputs come back: whole on every rank (``outputs="replicated"``) or as they are computed (``"local"``).

By default every output is made whole (``Replicate``) before it is returned, so each rank
returns the single-device model's outputs: the planner prices the gather of a split output
(e.g. vocabulary-split logits) like any other resharding. With ``outputs="local"``
(``autotp.compile(..., outputs="local")``, ``PlanOptions(outputs="local")``) each output is
returned in the placement the plan computes it in, as DTensor's ``parallelize_module`` returns a
``Shard(-1)`` ``lm_head`` output under ``loss_parallel``: no output is gathered, so a training
step that returns logits beside its loss keeps only ``1/world_size`` of them per rank, and the
loss (the vocabulary-parallel cross-entropy, :mod:`autotp.passes.rules.losses`) reads the split
logits.

- **Planning** (:func:`free_outputs`): the edges into the graph's output node are dropped, so no
  output's placement is priced or forced; after solving, :func:`with_local_outputs` records the
  output node reading each output in its producer's placement. The plan (and its JSON) carries
  that, so applying a saved plan returns the same local outputs.
- **Running**: the rewrite reads each output as its producer left it (no resharding node: the
  output node's input placement equals the producer's), and
  :attr:`TensorParallelModule.output_placements` says, per flattened output, what the rank holds:
  ``"R"`` (whole, the same on every rank), ``"S(d)"`` (this rank's block along dim ``d``: the
  blocks concatenate along ``d`` in rank order to the whole output) or ``"P"`` (a partial sum:
  the ranks' tensors add up to it).
"""

from __future__ import annotations

import dataclasses

from autotp.base.placements import Replicate, placement_from_str, placement_to_str
from autotp.passes.strategies import StrategyGraph
from autotp.planning.plan import Plan

__all__ = ["OUTPUTS", "check_outputs", "free_outputs", "output_placements", "with_local_outputs"]

OUTPUTS = ("replicated", "local")
"""Values of the ``outputs=`` option: every output whole on every rank, or as computed."""


def check_outputs(value: object) -> str:
    """``value`` when it is one of :data:`OUTPUTS`; else a :class:`ValueError` naming them."""
    if value not in OUTPUTS:
        raise ValueError(f"outputs={value!r}: expected 'replicated' (every output whole on every rank, the default) "
                         "or 'local' (each output as this rank computes it; see tp.output_placements)")
    return str(value)


def free_outputs(graph: StrategyGraph) -> StrategyGraph:
    """``graph`` without the edges into its output node: no output is priced or forced whole."""
    outputs = {name for name in graph.order if graph.nodes[name].op == "output"}
    return dataclasses.replace(graph, edges=[edge for edge in graph.edges if edge.consumer not in outputs])


def with_local_outputs(plan: Plan) -> Plan:
    """``plan`` with its output node reading every output in the placement its producer computes it in."""
    decisions = {node.name: node for node in plan.nodes}
    nodes = tuple(
        dataclasses.replace(node, inputs=tuple(decisions[name].output for name in node.input_nodes))
        if node.op == "output" else node
        for node in plan.nodes)
    return dataclasses.replace(plan, nodes=nodes)


def output_placements(plan: Plan) -> tuple[str, ...]:
    """Per flattened tensor output, the placement a rank returns it in (``"R"`` unless ``outputs="local"``)."""
    node = next(node for node in plan.nodes if node.op == "output")
    return tuple(placement_to_str(placement_from_str(text)) for text in node.inputs)


def is_local_output(plan: Plan, name: str) -> bool:
    """True when node ``name`` is the output node of a plan made with ``outputs="local"`` (or one
    returning everything whole): it reads each output in its producer's placement."""
    decisions = {node.name: node for node in plan.nodes}
    node = decisions[name]
    return node.op == "output" and all(
        placement == decisions[producer].output or placement_from_str(placement) == Replicate()
        for placement, producer in zip(node.inputs, node.input_nodes, strict=True))
