"""Strategy graph: every node of the captured graph with its candidate strategies.

Input: the captured ATen graph (``node.meta["val"]`` set). Output: a :class:`StrategyGraph`,
plain data the cost pass and the solver read; the FX graph itself is not modified.

Placeholders: a parameter may be replicated or split along any dim of size > 1; user inputs,
buffers and constants arrive whole on every rank (``Replicate``). The graph output must be
replicated, so that every rank returns the same values as the original model. A *state* buffer
(a KV cache the graph updates, see :mod:`autotp.capture.tracing`) is placed like a parameter, and its
update reads it as is (``must_match``): the runtime writes the update into the rank's own block.

Only static dims are split. A dynamic dim (batch, sequence: a ``torch.SymInt`` size, see
:mod:`autotp.base.shapes`) takes a new size at every call, while the cuts of a split are fixed
when the rank-local graph is built (``passes/uneven.py``); so every strategy that splits a
dynamic dim of an input or output is dropped here, once, for every rule. (Splitting batch or
sequence needs ``dynamic=False`` at capture: then those dims are static.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import BlockShard, Placement, Replicate, Shard, split_of
from autotp.base.shapes import concrete_shape, is_static
from autotp.base.strategy import Strategy
from autotp.passes.node_keys import node_keys, once_per_key
from autotp.passes.rules import RuleContext, block_counts, has_rule, strategies_for, tensor_inputs
from autotp.passes.rules.builders import fitting_blocks
from autotp.passes.rules.experts import mark_expert_roles, routed_row_counts

__all__ = ["Edge", "StrategyGraph", "build_strategy_graph"]


@dataclasses.dataclass(frozen=True)
class Edge:
    """Input slot ``slot`` of node ``consumer`` reads the output of node ``producer``.

    ``must_match``: nothing may sit on the edge (the producer returns a tuple).
    ``local_only``: only local resharding (slice, zero) may sit on the edge: the producer is a
    parameter, and gathering a parameter every forward would hold the whole weight on every
    rank after all (that is ZeRO-3 / FSDP, not tensor parallelism).
    """

    producer: str
    consumer: str
    slot: int
    must_match: bool
    local_only: bool = False


@dataclasses.dataclass
class StrategyGraph:
    """Nodes in topological order with their candidate strategies and the data edges."""

    graph_module: fx.GraphModule
    world_size: int
    order: list[str]
    nodes: dict[str, fx.Node]
    strategies: dict[str, list[Strategy]]
    edges: list[Edge]
    parameters: dict[str, str]  # placeholder name -> parameter FQN
    fallback: list[str]  # call_function nodes with no sharding rule (run replicated)
    structural_keys: dict[str, Hashable | None]  # node name -> node_keys.node_key (costing prices once per key too)
    expert_shares: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    """Grouped GEMM node name -> the measured fraction of its rows each expert receives (a router's load from
    calibration data, :mod:`autotp.planning.expert_load`); a GEMM not named here is priced for a uniform router."""

    def with_own_containers(self) -> StrategyGraph:
        """The same graph with every list and dict of its own (each node's strategy list too), so that narrowing
        it (filters, constraints, expert forms) leaves this one as it was; the nodes and strategies are shared."""
        copied = {field.name: type(value)(value) for field in dataclasses.fields(self)
                  if isinstance(value := getattr(self, field.name), (list, dict))}
        copied["strategies"] = {name: list(options) for name, options in self.strategies.items()}
        return dataclasses.replace(self, **copied)


def _parameter_strategies(node: fx.Node, blocks: frozenset[int]) -> list[Strategy]:
    val = node.meta.get("val")
    strategies = [Strategy((), Replicate())]
    if isinstance(val, torch.Tensor):
        for d, size in enumerate(concrete_shape(val)):
            if size > 1:
                strategies.append(Strategy((), Shard(d)))
            strategies += [Strategy((), BlockShard(d, k)) for k in fitting_blocks(size, blocks)]
    return strategies


def _splits_static_dims(placement: Placement, value: object) -> bool:
    """False when ``placement`` splits a dynamic (symbolic) dim of a tensor in ``value``."""
    split = split_of(placement)
    if split is None:
        return True
    dim = split[0]
    return all(is_static(leaf.shape[dim]) for leaf in pytree.tree_leaves(value)
               if isinstance(leaf, torch.Tensor) and -leaf.dim() <= dim < leaf.dim())


def _static_splits_only(node: fx.Node, strategies: list[Strategy]) -> list[Strategy]:
    """The strategies of ``node`` that split only static dims of its inputs and output."""
    inputs = [producer.meta.get("val") for producer in tensor_inputs(node)]
    out = node.meta.get("val")
    return [s for s in strategies
            if _splits_static_dims(s.output, out) and all(_splits_static_dims(p, v) for p, v in zip(s.inputs, inputs))]


def build_strategy_graph(gm: fx.GraphModule, world_size: int, parameters: dict[str, str],
                         state: frozenset[str] = frozenset(), *, split_random: bool = False,
                         place_experts: bool = True) -> StrategyGraph:
    """Enumerate the strategies of every node of ``gm`` for a mesh axis of ``world_size`` ranks.

    ``parameters``: placeholder name -> FQN of everything placed like a parameter (state buffers
    included); ``state``: the placeholders among them that the graph updates. ``split_random``:
    sampling ops may be split (per-rank streams, :mod:`autotp.passes.random_streams`); ``place_experts``:
    grouped GEMMs may place whole experts on ranks (:mod:`autotp.passes.rules.experts`).
    A call's strategies are enumerated once per :func:`~autotp.passes.node_keys.node_key` (every layer of
    a decoder: once), as rules read only the node, its arguments' values and the graph-wide context.
    """
    order: list[str] = []
    nodes: dict[str, fx.Node] = {}
    strategies: dict[str, list[Strategy]] = {}
    edges: list[Edge] = []
    fallback: list[str] = []
    placeable = mark_expert_roles(gm)  # before the node keys, which include the roles
    placing = place_experts and placeable
    ctx = RuleContext(world_size, block_counts(gm), split_random, placing,
                      routed_row_counts(gm) if placing else frozenset())
    keys = node_keys(gm.graph.nodes)
    enumerated: dict[Hashable, list[Strategy]] = {}  # node key -> the strategies of the first node with it
    for node in gm.graph.nodes:
        order.append(node.name)
        nodes[node.name] = node
        if node.op == "placeholder":
            strategies[node.name] = _parameter_strategies(node, ctx.block_counts) if node.name in parameters else [Strategy((), Replicate())]
        elif node.op == "output":
            strategies[node.name] = [Strategy(tuple(Replicate() for _ in tensor_inputs(node)), Replicate())]
        elif node.op == "call_function":
            if not has_rule(node):
                fallback.append(node.name)
            strategies[node.name] = once_per_key(enumerated, keys[node],
                                                 lambda node=node: _static_splits_only(node, strategies_for(node, ctx)))
        else:
            raise NotImplementedError(f"autotp does not handle FX node kind {node.op!r}: {node.format_node()}")
        if world_size == 1:
            # One rank: a split is the whole tensor, so every strategy costs the same, and any but the
            # all-Replicate one (always first) would only add no-op collectives and copies to the graph.
            strategies[node.name] = strategies[node.name][:1]
        for slot, producer in enumerate(tensor_inputs(node)):
            producer_val = producer.meta.get("val")
            must_match = isinstance(producer_val, (tuple, list)) or producer.name in state
            edges.append(Edge(producer.name, node.name, slot, must_match, local_only=producer.name in parameters))
    return StrategyGraph(gm, world_size, order, nodes, strategies, edges, dict(parameters), fallback,
                         {node.name: key for node, key in keys.items()})
