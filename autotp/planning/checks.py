"""Checks a saved or hand-edited plan must pass before ``autotp.compile(model, plan=...)`` applies it.

:meth:`Plan.check_matches` compares the plan with the traced graph (node names, world size,
ops and shapes). :func:`check_plan_applies` adds what a hand edit can get wrong:

- ``parameters`` (FQN -> placement, used to slice the weights) must agree with the parameter
  placeholders' decisions (used by the rewrite): edit both, or the weights would be sliced one
  way and used another;
- every node's decision must be one of the strategies the sharding rules offer for that node
  (e.g. ``aten.linear`` with weight ``S(0)`` gives an output split on its last dim, never
  ``S(0)``), so an edited plan cannot compute something else.

Every problem is reported at once, each with the node and what would be valid.
"""

from __future__ import annotations

from autotp.base.errors import PlanMismatchError
from autotp.capture.tracing import CapturedGraph
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.plan import Plan

__all__ = ["check_plan_applies"]

_MAX_LISTED = 12


def _strategy_text(inputs: tuple[str, ...], output: str) -> str:
    return f"({', '.join(inputs)}) -> {output}" if inputs else output


def _splits_dynamic_dim(node: object, placement: str) -> bool:
    """True when ``placement`` splits a dim that is dynamic (symbolic) in ``node``'s traced value."""
    from autotp.base.placements import placement_from_str, split_of
    from autotp.base.shapes import first_tensor, is_static

    split = split_of(placement_from_str(placement))
    value = first_tensor(getattr(node, "meta", {}).get("val"))
    return split is not None and value is not None and split[0] < value.dim() and not is_static(value.shape[split[0]])


def check_plan_applies(plan: Plan, captured: CapturedGraph, world_size: int) -> None:
    """Raise :class:`PlanMismatchError` naming every reason ``plan`` cannot be applied to ``captured``."""
    from autotp.base.placements import placement_to_str
    from autotp.planning.outputs import is_local_output

    plan.check_matches(captured.graph_module, world_size)
    fqns = {**captured.parameter_fqns(), **captured.state_fqns()}
    decisions = {n.name: n for n in plan.nodes}
    problems = []
    for name, fqn in fqns.items():
        node = decisions[name]
        if plan.parameters.get(fqn) != node.output:
            problems.append(f"parameter {fqn}: 'parameters' says {plan.parameters.get(fqn)!r} but its node {name} "
                            f"says {node.output!r}; edit both to the same placement")
    # a sampling op on a split activation is valid: the rank-local graph draws it from a per-rank stream
    graph = build_strategy_graph(captured.graph_module, world_size, fqns, frozenset(captured.state), split_random=True)
    bad = []
    splits_dynamic = False
    for name in graph.order:
        offered = {(tuple(placement_to_str(p) for p in s.inputs), placement_to_str(s.output)): s
                   for s in graph.strategies[name]}
        node = decisions[name]
        if (tuple(node.inputs), node.output) not in offered and not is_local_output(plan, name):
            choices = ", ".join(_strategy_text(i, o) for i, o in list(offered)[:6])
            more = " ..." if len(offered) > 6 else ""
            bad.append(f"node {name} ({node.op}): {_strategy_text(node.inputs, node.output)} is not a strategy of this "
                       f"op here; valid: {choices}{more}")
            splits_dynamic = splits_dynamic or _splits_dynamic_dim(graph.nodes[name], node.output)
    problems += bad[:_MAX_LISTED]
    if len(bad) > _MAX_LISTED:
        problems.append(f"... and {len(bad) - _MAX_LISTED} more nodes with invalid strategies")
    if splits_dynamic:
        problems.append("batch and sequence dims are traced dynamic and never split (autotp.capture.tracing); a plan made "
                        "with dynamic=False may split them: apply it with autotp.compile(..., dynamic=False)")
    if problems:
        raise PlanMismatchError("the plan cannot be applied to this model:\n  - " + "\n  - ".join(problems))
