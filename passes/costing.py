"""Cost pass: per-rank time and memory of every strategy, and the price of every resharding.

Input: a :class:`StrategyGraph` and a hardware profile. Output: a :class:`CostedGraph`
(plain data; nothing in the FX graph changes). All formulas live in ``autotp.cost_model``;
this pass only decides *what* each strategy asks of the hardware:

- compute: the op's FLOPs (``aten_flops``) and the bytes it reads and writes on one rank. The
  FLOPs are the largest rank's share of the work when the strategy splits a tensor (the
  output, or a contracted input whose output is a Partial sum); with only Replicate and
  Partial placements every rank does the whole op. The bytes are counted tensor by tensor at
  their local size: a split tensor is read (or written) in part, a replicated or Partial one
  whole (a row-parallel GEMM writes a full-size Partial output; a token-split GEMM still
  reads the whole weight). View-like ops move no data and launch no kernel: they cost only
  ``Hardware.view_op_s``, the host's dispatch (0 on GPU profiles, measured on a CPU).
- resharding between the producer's and the consumer's placement of one tensor: one
  collective from :func:`collective_time_s` (see :func:`reshard_plan`).
- memory: the bytes of each parameter's local shard (the largest one, for uneven splits).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import Partial, Placement, Replicate, split_of
from autotp.base.shapes import concrete_shape, nbytes, numel
from autotp.cost_model import Hardware, aten_flops, collective_time_s, compute_time_s
from autotp.passes.rules import Strategy, holds_tensor, tensor_inputs
from autotp.passes.strategies import StrategyGraph

aten = torch.ops.aten

__all__ = ["CostedGraph", "cost_strategy_graph", "is_local_reshard", "reshard_plan", "reshard_time_s", "tensor_nbytes"]

# Ops that only change tensor metadata (a view of the same storage): no kernel, no bytes moved.
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.alias.default, aten.detach.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, operator.getitem,
    aten.lift_fresh.default, aten.dropout.default,
})


def tensor_nbytes(value: object) -> int:
    """Bytes of a tensor (or of all tensors in a tuple/list of them)."""
    return nbytes(value)


def _dtype(value: object) -> torch.dtype:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return leaves[0].dtype if leaves else torch.float32


def reshard_plan(src: Placement, dst: Placement) -> list[str]:
    """The steps that turn placement ``src`` into ``dst`` on one mesh axis.

    ``P->R`` all-reduce, ``P->S`` reduce-scatter, ``S->R`` all-gather, ``R->S`` local slice,
    ``R->P`` keep on rank 0 and zero elsewhere, ``S(i)->S(j)`` all-gather then slice (costed
    as the all-gather it is implemented with). Block-sharded tensors (``S(d)xk``) take the same
    routes, except that a Partial sum is all-reduced before it is sliced into blocks.
    """
    if src == dst:
        return []
    dst_split, src_split = split_of(dst), split_of(src)
    if isinstance(src, Replicate):
        return ["slice"] if dst_split else ["zero"]
    if isinstance(src, Partial):
        if dst_split and dst_split[1] == 1:
            return ["reduce_scatter"]
        return ["all_reduce", "slice"] if dst_split else ["all_reduce"]
    if src_split is None:
        raise ValueError(f"cannot reshard from {src}")
    if isinstance(dst, Replicate):
        return ["all_gather"]
    if dst_split:
        return ["all_gather", "slice"]
    return ["all_gather", "zero"]


def is_local_reshard(src: Placement, dst: Placement) -> bool:
    """True when ``src -> dst`` needs no communication (a local slice or zero-fill)."""
    return all(step in ("slice", "zero") for step in reshard_plan(src, dst))


def reshard_time_s(src: Placement, dst: Placement, value: object, world_size: int, hardware: Hardware) -> float:
    """Predicted seconds to reshard ``value`` (a FakeTensor) from ``src`` to ``dst``.

    Each collective step costs :func:`collective_time_s`; a gather or scatter along a dim other
    than 0 also pays the two copies the rewrite makes around it (the dim is moved to the front
    and made contiguous, then moved back and made contiguous again): each reads and writes its
    tensor once, a roofline memory term. A local slice is a view (``Hardware.view_op_s``).
    """
    nbytes = tensor_nbytes(value)
    dtype = _dtype(value)
    total = 0.0
    for step in reshard_plan(src, dst):
        if step == "slice":
            total += hardware.view_op_s  # a narrow: no data moves
            continue
        if step == "zero":
            total += compute_time_s(0, nbytes, dtype, hardware)  # writing zeros on ranks != 0
            continue
        total += collective_time_s(step, nbytes, world_size, hardware)
        if step not in ("all_gather", "reduce_scatter") or world_size == 1:
            continue
        sharded = src if step == "all_gather" else dst  # the placement whose split dim moves
        split = split_of(sharded)
        if split is not None and split[0] != 0:
            local = _local_nbytes(value, sharded, world_size)
            for copied in (local, nbytes):  # the shard and the whole tensor, each read and written once
                total += compute_time_s(0, 2 * copied, dtype, hardware)
    return total


@dataclasses.dataclass
class CostedGraph:
    """The strategy graph with per-strategy compute time and parameter memory."""

    graph: StrategyGraph
    hardware: Hardware
    compute_s: dict[str, list[float]]  # node -> per-strategy predicted seconds per rank
    memory_bytes: dict[str, list[int]]  # parameter node -> per-strategy bytes of the largest local shard

    def reshard_s(self, producer: str, src: Placement, dst: Placement) -> float:
        node = self.graph.nodes[producer]
        return reshard_time_s(src, dst, node.meta.get("val"), self.graph.world_size, self.hardware)


def _meta_args(node: fx.Node) -> tuple[tuple, dict]:
    def to_val(a: object) -> object:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    return pytree.tree_map(to_val, node.args), pytree.tree_map(to_val, node.kwargs)


def _local_fraction(value: object, placement: Placement, world_size: int) -> float:
    """Share of ``value`` the largest rank holds under ``placement`` (1.0 unless it is split)."""
    if not isinstance(value, torch.Tensor) or numel(value) == 0:
        return 1.0
    return _shard_bytes(value, placement, world_size) / (numel(value) * value.element_size())


def _local_nbytes(value: object, placement: Placement, world_size: int) -> float:
    """Bytes of ``value`` (a tensor, or a tuple of them sharing one placement) on the largest rank."""
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return sum(_local_fraction(v, placement, world_size) * numel(v) * v.element_size() for v in leaves)


def _work_fraction(strategy: Strategy, out: object, inputs: list[object], world_size: int) -> float:
    """Share of the op's FLOPs the largest rank does under ``strategy``.

    All split tensors of one strategy are cut at the same fractions (``passes/uneven.py``),
    so the largest rank's share is at least the coarsest of their splits: e.g. 8 query heads
    with 4 kv heads over 8 ranks leave half the ranks without a kv head, and the busiest rank
    does 1/4 of the attention, not 1/8. A Partial output computed from split inputs is a split
    contraction. With only Replicate and Partial placements every rank does it all.
    """
    out_leaf = next((v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)), None)
    shares = [_local_fraction(out_leaf, strategy.output, world_size)] if split_of(strategy.output) else []
    shares += [_local_fraction(value, placement, world_size)
               for placement, value in zip(strategy.inputs, inputs) if split_of(placement) is not None]
    return max(shares, default=1.0)


def _node_compute_s(node: fx.Node, strategies: list[Strategy], world_size: int, hardware: Hardware) -> list[float]:
    if node.op != "call_function" or not holds_tensor(node):  # size arithmetic runs on the host: free
        return [0.0] * len(strategies)
    if node.target in VIEW_OPS:  # no kernel, no bytes: only the host's dispatch (0 on GPU profiles)
        return [hardware.view_op_s] * len(strategies)
    args, kwargs = _meta_args(node)
    out = node.meta.get("val")
    try:
        flops = aten_flops(node.target, args, kwargs, out)
    except Exception:  # noqa: BLE001 - an op the FLOP counter cannot size costs by bytes only
        flops = 0
    inputs = [producer.meta.get("val") for producer in tensor_inputs(node)]  # one per input slot
    dtype = _dtype(out)
    costs = []
    for strategy in strategies:
        moved = _local_nbytes(out, strategy.output, world_size) + sum(
            _local_nbytes(value, placement, world_size) for placement, value in zip(strategy.inputs, inputs)
        )
        share = _work_fraction(strategy, out, inputs, world_size)
        costs.append(compute_time_s(flops * share, moved, dtype, hardware))
    return costs


def _shard_bytes(value: torch.Tensor, placement: Placement, world_size: int) -> int:
    split = split_of(placement)
    if split is not None:
        dim, blocks = split
        size = concrete_shape(value)[dim]
        return value.element_size() * (numel(value) // max(size, 1)) * blocks * math.ceil(size // blocks / world_size)
    return numel(value) * value.element_size()


def cost_strategy_graph(graph: StrategyGraph, hardware: Hardware) -> CostedGraph:
    """Attach predicted compute seconds to every strategy and bytes to every parameter strategy."""
    compute_s = {}
    memory = {}
    for name in graph.order:
        node = graph.nodes[name]
        compute_s[name] = _node_compute_s(node, graph.strategies[name], graph.world_size, hardware)
        if name in graph.parameters:
            val = node.meta["val"]
            # a parameter nothing reads (e.g. the second name of a tied weight) is not kept
            unread = not node.users
            memory[name] = [0 if unread else _shard_bytes(val, s.output, graph.world_size) for s in graph.strategies[name]]
    return CostedGraph(graph, hardware, compute_s, memory)
