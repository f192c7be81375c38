"""Reference plans: Megatron-style tensor parallelism as a :class:`Plan`, priced by the same model.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", sec. 3) splits each transformer block's first GEMM of a pair
by columns (output features) and the second by rows (input features), so each attention and
MLP block ends in one all-reduce; attention is split by heads as a consequence.

This module expresses that recipe on autotp's graph, by op structure only (no module names):
a GEMM whose output reaches a *residual add* (an ``add`` whose other operand does not depend on
the GEMM) without passing another GEMM is *row-parallel*; every other GEMM with a weight
parameter is *column-parallel*. Only GEMM weights are pinned; everything else (activations,
biases, norms, embeddings) is left to the same solver, so the comparison isolates the GEMM
splitting choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from autotp.base.placements import split_of
from autotp.capture.tracing import capture, inputs_on_model_device
from autotp.cost_model import Hardware
from autotp.passes.rules import tensor_inputs
from autotp.passes.strategies import StrategyGraph
from autotp.planning.options import DEFAULT_HARDWARE, PlanOptions
from autotp.planning.plan import Plan
from autotp.planning.planner import plan_graph

aten = torch.ops.aten

__all__ = ["megatron_plan", "megatron_roles", "pin_gemm_weights"]

# GEMM op -> (index of the weight among tensor inputs, weight dim holding the output features)
_GEMMS = {aten.linear.default: (1, 0), aten.addmm.default: (2, 1), aten.mm.default: (1, 1)}


def _weight_of(node: fx.Node, parameters: dict[str, str]) -> tuple[fx.Node, int] | None:
    if node.op != "call_function" or node.target not in _GEMMS:
        return None
    index, out_dim = _GEMMS[node.target]
    inputs = tensor_inputs(node)
    if len(inputs) > index and inputs[index].name in parameters:
        return inputs[index], out_dim
    return None


def _reaches_residual_add(gemm: fx.Node, parameters: dict[str, str]) -> bool:
    """True when the GEMM's output flows, without another GEMM, into an add with an independent operand."""
    closure = {gemm}
    frontier = [gemm]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in closure or _weight_of(user, parameters) is not None:
                continue
            closure.add(user)
            frontier.append(user)
    for node in closure:
        if node.op == "call_function" and node.target is aten.add.Tensor:
            operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
            if len(operands) == 2 and sum(a in closure for a in operands) == 1:
                return True
    return False


def megatron_roles(graph: StrategyGraph) -> dict[str, tuple[str, str, int]]:
    """Weight placeholder -> (``"column"``/``"row"``, GEMM node, output-feature dim of the weight)."""
    roles = {}
    for name in graph.order:
        node = graph.nodes[name]
        found = _weight_of(node, graph.parameters)
        if found is None:
            continue
        weight, out_dim = found
        if len(weight.users) > 1:
            continue  # a tied weight (e.g. embedding = output projection) is left to the solver
        role = "row" if _reaches_residual_add(node, graph.parameters) else "column"
        roles[weight.name] = (role, name, out_dim)
    return roles


def pin_gemm_weights(graph: StrategyGraph) -> StrategyGraph:
    """A copy of ``graph`` whose GEMM weights keep only their Megatron split (a ``strategy_filter``).

    Column-parallel weights are split over output features, row-parallel ones over input
    features (see :func:`megatron_roles`); a weight that offers no such split is left as is.
    """
    strategies = dict(graph.strategies)
    for weight, (role, _, out_dim) in megatron_roles(graph).items():
        ndim = graph.nodes[weight].meta["val"].dim()
        dim = out_dim if role == "column" else (ndim - 1 - out_dim if ndim == 2 else out_dim)
        keep = [s for s in strategies[weight] if split_of(s.output) and split_of(s.output)[0] == dim]
        if keep:
            strategies[weight] = keep
    return dataclasses.replace(graph, strategies=strategies)


def megatron_plan(model: torch.nn.Module, example_inputs: tuple[Any, ...] = (),
                  example_kwargs: dict[str, Any] | None = None, *, world_size: int,
                  hardware: str | Hardware = DEFAULT_HARDWARE,
                  memory_budget: float | int | str | None = "auto") -> Plan:
    """The Megatron-style plan of ``model`` (see module docstring), costed like :func:`autotp.plan`.

    The same planner as :func:`autotp.plan`, with :func:`pin_gemm_weights` as the strategy filter.
    """
    options = PlanOptions(world_size=world_size, hardware=hardware, memory_budget=memory_budget,
                          strategy_filter=pin_gemm_weights)
    captured = capture(model, inputs_on_model_device(model, example_inputs),
                       inputs_on_model_device(model, example_kwargs))
    return plan_graph(captured, options)
