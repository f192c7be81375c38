"""User constraints: pin the placement of chosen parameters or nodes before the solver runs.

``constraints`` maps an fnmatch pattern to a placement::

    autotp.plan(model, ..., options=autotp.PlanOptions(constraints={"model.layers.*.mlp.down_proj.weight": Replicate()}))

A pattern is matched against every parameter FQN (``model.layers.0.mlp.down_proj.weight``)
and every graph node name (``linear_6``); ``*`` matches any text, dots included. The value is
the *output* placement the matching nodes must take: a ``Replicate()``, ``Shard(d)``,
``Partial()`` value or its text form (``"R"``, ``"S(0)"``, ``"P"``). Constraining happens on
the strategy graph: the candidate strategies of each matching node are narrowed to those with
that output placement, so the solver still chooses everything else (and pays the resharding
the constraint causes). A pattern that matches nothing, or a placement that is not a candidate
of a matching node, is an error that lists what was possible.

Keeping a matrix whole costs memory: the default ``memory_budget="auto"`` leaves room for
every matrix split, so pinning one to ``Replicate()`` usually needs ``memory_budget=None``
or a number of bytes per rank.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from autotp.base.errors import PlanError, PlanMismatchError
from autotp.base.placements import Placement, placement_from_str, placement_to_str
from autotp.passes.strategies import StrategyGraph

__all__ = ["Constraints", "apply_constraints", "check_plan_constraints", "normalize_constraints"]

Constraints = Mapping[str, "Placement | str"]


def normalize_constraints(constraints: Constraints | None) -> dict[str, str]:
    """Pattern -> placement text (``R``, ``S(0)``...), validating both."""
    if constraints is None:
        return {}
    if not isinstance(constraints, Mapping):
        raise TypeError(
            f"constraints must be a dict of pattern -> placement, got {type(constraints).__name__}; "
            'e.g. constraints={"model.layers.*.mlp.down_proj.weight": Replicate()}'
        )
    result = {}
    for pattern, placement in constraints.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"constraint keys are fnmatch patterns over parameter FQNs and node names, got {pattern!r}")
        try:
            text = placement_to_str(placement_from_str(placement) if isinstance(placement, str) else placement)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"constraint {pattern!r}: {placement!r} is not a placement ({exc}); use Replicate(), Shard(dim), "
                "Partial() or their text 'R', 'S(0)', 'P'"
            ) from exc
        result[pattern] = text
    return result


def _targets(names: list[str], parameters: Mapping[str, str], pattern: str) -> list[str]:
    """Node names whose name, or whose parameter FQN, matches ``pattern``."""
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)
            or (n in parameters and fnmatch.fnmatchcase(parameters[n], pattern))]


def apply_constraints(graph: StrategyGraph, constraints: Constraints | None) -> StrategyGraph:
    """A copy of ``graph`` whose constrained nodes keep only strategies with the required output placement."""
    wanted = normalize_constraints(constraints)
    if not wanted:
        return graph
    strategies = dict(graph.strategies)
    unmatched = []
    problems = []
    pinned: dict[str, str] = {}
    for pattern, text in wanted.items():
        names = _targets(graph.order, graph.parameters, pattern)
        if not names:
            unmatched.append(pattern)
            continue
        for name in names:
            if name in pinned and pinned[name] != text:
                problems.append(f"{_label(graph, name)} is pinned to both {pinned[name]} and {text} (pattern {pattern!r})")
                continue
            pinned[name] = text
            kept = [s for s in strategies[name] if placement_to_str(s.output) == text]
            if not kept:
                offered = sorted({placement_to_str(s.output) for s in graph.strategies[name]})
                problems.append(f"{_label(graph, name)} (pattern {pattern!r}) cannot be {text}; its candidates are "
                                f"{', '.join(offered)}")
                continue
            strategies[name] = kept
    if unmatched:
        examples = ", ".join(list(graph.parameters.values())[:3])
        problems.insert(0, f"pattern(s) matching no parameter FQN or node name: {', '.join(map(repr, unmatched))} "
                           f"(parameters look like: {examples})")
    if problems:
        raise PlanError("constraints cannot be applied:\n  - " + "\n  - ".join(problems))
    return dataclasses.replace(graph, strategies=strategies)


def _label(graph: StrategyGraph, name: str) -> str:
    fqn = graph.parameters.get(name)
    return f"parameter {fqn}" if fqn else f"node {name} ({graph.nodes[name].target})"


def check_plan_constraints(plan: object, constraints: Constraints | None) -> None:
    """Raise :class:`PlanMismatchError` if a given plan breaks ``constraints`` (for ``compile(plan=...)``)."""
    wanted = normalize_constraints(constraints)
    nodes = plan.nodes  # type: ignore[attr-defined]
    parameters = {n.name: n.target for n in nodes if n.target}
    outputs = {n.name: n.output for n in nodes}
    problems = []
    for pattern, text in wanted.items():
        names = _targets(list(outputs), parameters, pattern)
        if not names:
            problems.append(f"pattern {pattern!r} matches no parameter FQN or node name of the plan")
        problems += [f"{parameters.get(n) or n} is {outputs[n]} in the plan, constraint {pattern!r} asks {text}"
                     for n in names if outputs[n] != text]
    if problems:
        raise PlanMismatchError("the plan breaks the constraints:\n  - " + "\n  - ".join(problems))
