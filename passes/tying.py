"""Tying: find structurally identical repeated blocks so the solver decides each one once.

Input: a :class:`StrategyGraph`. Output: ``node name -> representative node name`` (nodes not in
a repeated block map to themselves). Nothing is modified.

A *block instance* is the set of nodes whose module path (or, for parameters, FQN) lies in one
block (:func:`autotp.base.module_paths.block_of`: ``<prefix>.<index>...``) — the children of any
``nn.ModuleList``/``Sequential``, whatever the model calls them. Two instances of the same prefix are *identical* when, node by node in graph
order, they have the same op, the same shapes, the same candidate strategies and the same wiring
inside the block. Every identical instance is tied to the first one: node j of instance k uses
the decision variables of node j of the representative.

Optimality: tying is exact whenever some optimal plan treats identical blocks alike. Blocks at
the ends of the stack see different neighbours (the first reads the embedding, the last feeds
the final norm), so an optimum that treats one end block differently can be lost; the
difference is bounded by the resharding cost on the block's boundary edges. The benchmark
``benchmarks/plan_time.py --untied`` measures it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from autotp.base.module_paths import block_of
from autotp.base.shapes import concrete_shape
from autotp.passes.rules import tensor_inputs
from autotp.passes.strategies import StrategyGraph

__all__ = ["tie_identical_blocks"]


def _path(graph: StrategyGraph, name: str) -> str:
    if name in graph.parameters:
        return graph.parameters[name]
    stack = graph.nodes[name].meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return str(list(stack.values())[-1][0]).replace("L['self'].", "")


def _shape_of(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return concrete_shape(value), str(value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(v) for v in value)
    return type(value).__name__


def _signature(graph: StrategyGraph, members: list[str]) -> tuple:
    position = {name: i for i, name in enumerate(members)}
    items = []
    for name in members:
        node = graph.nodes[name]
        wiring = tuple(position.get(p.name, "ext") for p in tensor_inputs(node))
        target = str(node.target) if node.op == "call_function" else node.op
        items.append((node.op, target, _shape_of(node.meta.get("val")), wiring,
                      tuple(graph.strategies[name]), name in graph.parameters))
    return tuple(items)


def tie_identical_blocks(graph: StrategyGraph) -> dict[str, str]:
    """Map every node to the representative of its identical block (itself when untied)."""
    instances: dict[tuple[str, int], list[str]] = defaultdict(list)
    for name in graph.order:
        if graph.nodes[name].op == "output":
            continue
        block = block_of(_path(graph, name))
        if block is not None:
            instances[block].append(name)
    by_prefix: dict[str, list[tuple[int, list[str]]]] = defaultdict(list)
    for (prefix, index), members in instances.items():
        by_prefix[prefix].append((index, members))
    rep = {name: name for name in graph.order}
    for blocks in by_prefix.values():
        first_of: dict[tuple, list[str]] = {}
        for _, members in sorted(blocks):
            signature = _signature(graph, members)
            if signature in first_of:
                for name, leader in zip(members, first_of[signature]):
                    rep[name] = leader
            else:
                first_of[signature] = members
    return rep
