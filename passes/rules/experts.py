"""Experts placed whole on ranks: the grouped GEMM over a 3-D expert weight split by expert, and what follows it.

``grouped_mm(x (S, K), w (E, K, N), offs (E,))`` multiplies rows ``offs[e-1]:offs[e]`` of ``x`` (sorted by
expert) by ``w[e]``. With ``w`` split on its expert dim (``S(0)``: rank r holds experts ``first .. first+n-1``,
uneven where the world size does not divide E), rank r computes only the rows routed to its own experts and
leaves zeros in every other row: the output is an :class:`~autotp.base.placements.ExpertPartial`, a Partial
sum whose ranks hold disjoint rows. Every rank holds the whole token activations in a tensor-parallel plan, so
no token moves before the experts; one all-reduce (or reduce-scatter) of the combined output brings the
experts' contributions together after them. No token is dropped: there is no capacity, each rank computes
every row its experts were given.

Because each row lives on one rank, ``P(experts)`` passes through an elementwise ``f`` with ``f(0) = 0`` (the
gate's ``silu``, ``gelu``, ``relu``, ``tanh``) and through a product of two such values of the same rows
(``silu(gate) * up``), which a plain Partial does not: the expert MLP runs between its two grouped GEMMs on
each rank's own rows, and the second GEMM (``x P(experts)``, ``w S(0)``) gives ``P(experts)`` again. After
it, ``P(experts)`` is read as a plain Partial for nothing (the router's weighting, the un-sort and the sum
over the top-k are linear) and reduced as one.

Rank-local form: ``autotp::placed_grouped_mm(x, w_local, offs, first)``, one matrix product per local expert
over its rows (``aten._grouped_mm`` over the local block of rows where the captured op was that kernel).

Expert placement is offered where ``RuleContext.place_experts`` (not in training plans: the rank-local op
has no backward); :mod:`autotp.planning.experts` finds the blocks, forces a form and reports it.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autotp.adapters.torch_internals import OpOverload
from autotp.base.placements import ExpertPartial, Shard, split_of
from autotp.base.shapes import concrete_size
from autotp.base.strategy import Strategy
from autotp.cost_model.routing import (
    busiest_rank_rows,
    busiest_rank_rows_of_shares,
    even_expert_counts,
    expected_experts_hit,
    experts_hit_of_shares,
    experts_hit_per_rank,
)
from autotp.passes.rules.args import arg, shape, tensor_inputs
from autotp.passes.rules.builders import R
from autotp.passes.rules.registry import (
    LocalGraph,
    LocalWork,
    RuleContext,
    register_local_form,
    register_local_form_kernels,
    register_local_work,
    register_rule_extension,
)

aten = torch.ops.aten

__all__ = ["EP", "GROUPED_MM_OPS", "expert_weight_input", "has_placeable_experts", "is_grouped_mm",
           "placed_grouped_mm", "router_of"]

EP = ExpertPartial()

GROUPED_MM_OPS = (aten._grouped_mm.default, "transformers::grouped_mm_fallback")
"""The grouped GEMMs whose weight may be placed by expert (the same ops as :mod:`.grouped_mm`)."""

_ZERO_AT_ZERO = (aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.neg.default,
                 aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default)
"""Elementwise ops of one tensor with ``f(0) = 0``: a row that is zero on a rank stays zero."""


def expert_weight_input(node: fx.Node) -> fx.Node | None:
    """The weight ``w (E, K, N)`` of a grouped GEMM ``(x (S, K), w, offs (E,))`` with E >= 2, else None."""
    inputs = tensor_inputs(node)
    if len(inputs) != 3 or arg(node, 2, "offs") is not inputs[2]:
        return None
    x_shape, w_shape = shape(inputs[0]), shape(inputs[1])
    if len(x_shape) != 2 or len(w_shape) != 3 or not isinstance(w_shape[0], int) or w_shape[0] < 2:
        return None
    return inputs[1]


def has_placeable_experts(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` has a grouped GEMM over a 3-D expert weight (else no node is offered ``P(experts)``)."""
    return any(node.op == "call_function" and is_grouped_mm(node.target) and expert_weight_input(node) is not None
               for node in gm.graph.nodes)


def is_grouped_mm(target: object) -> bool:
    """Whether ``target`` is one of :data:`GROUPED_MM_OPS`."""
    name = target.name() if isinstance(target, OpOverload) else ""
    return target is aten._grouped_mm.default or name == "transformers::grouped_mm_fallback"


@register_rule_extension(*GROUPED_MM_OPS)
def _placed_experts(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``w S(0)`` (whole experts per rank): ``x`` whole or already on its experts' ranks -> ``P(experts)``."""
    if not ctx.place_experts or expert_weight_input(node) is None:
        return []
    return [Strategy((R, Shard(0), R), EP), Strategy((EP, Shard(0), R), EP)]


@register_rule_extension(*_ZERO_AT_ZERO)
def _zero_at_zero(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    inputs = tensor_inputs(node)
    return [Strategy((EP,), EP)] if ctx.place_experts and len(inputs) == 1 else []


@register_rule_extension(aten.mul.Tensor, aten.mul.Scalar)
def _mul(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A product with a whole value, or of two values whose rows lie on the same ranks, keeps the zeros."""
    inputs = tensor_inputs(node)
    if not ctx.place_experts or not inputs:
        return []
    if len(inputs) == 1:
        return [Strategy((EP,), EP)]
    return [Strategy((EP, R), EP), Strategy((R, EP), EP), Strategy((EP, EP), EP)]


@register_rule_extension(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, operator.getitem,
                         aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor)
def _moves_values(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that only move values (pieces of the gate/up projection) keep them on their ranks."""
    inputs = tensor_inputs(node)
    return [Strategy((EP,), EP)] if ctx.place_experts and len(inputs) == 1 else []


def _placed_grouped_mm_impl(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int,
                            fused: bool) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], w.shape[2])  # (S, N): rows of other ranks' experts stay zero
    count = w.shape[0]
    if count == 0:
        return out
    ends = offs.tolist()  # one read of the offsets to the host, as transformers' loop does
    start = int(ends[first - 1]) if first > 0 else 0
    stop = int(ends[first + count - 1])
    if fused and stop > start:  # one grouped kernel over this rank's block of rows
        local_offs = (offs[first:first + count] - start).to(torch.int32)
        out[start:stop] = torch.ops.aten._grouped_mm(x[start:stop], w, offs=local_offs)
        return out
    for i in range(count):
        end = int(ends[first + i])
        if end > start:
            torch.mm(x[start:end], w[i], out=out[start:end])
        start = end
    return out


def _placed_grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int,
                            fused: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


placed_grouped_mm = torch.library.custom_op("autotp::placed_grouped_mm", mutates_args=())(_placed_grouped_mm_impl)
"""``(x (S, K), w_local (n, K, N), offs (E,), first, fused) -> (S, N)``: the rows of experts ``first ..
first+n-1`` multiplied by their weights, zeros elsewhere (module docstring)."""
placed_grouped_mm.register_fake(_placed_grouped_mm_fake)


@register_local_form(*GROUPED_MM_OPS)
def _local_placed_grouped_mm(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict,
                             strategy: Strategy) -> fx.Node | None:
    """``w S(0)``: this rank's experts over their rows (``autotp::placed_grouped_mm``)."""
    if len(strategy.inputs) != 3 or strategy.inputs[1] != Shard(0):
        return None
    weight = tensor_inputs(node)[1]
    first, _ = builder.parts.local(weight.name, 0, builder.rank)
    x, local_w = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs["offs"]
    fused = node.target is aten._grouped_mm.default
    return builder.call(torch.ops.autotp.placed_grouped_mm.default, x, local_w, offs, first, fused, meta_from=node)


@register_local_form_kernels(*GROUPED_MM_OPS)
def _placed_zero_fill(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[object, int], ...]:
    """The expert-placed form writes zeros into the rows of other ranks' experts: one fill of its output."""
    if len(strategy.inputs) != 3 or strategy.inputs[1] != Shard(0):
        return ()
    return ((aten.zeros.default, math.prod(shape(node)) * node.meta["val"].element_size()),)


def router_of(node: fx.Node) -> fx.Node | None:
    """The ``topk`` whose indices route the rows of grouped GEMM ``node``: searched back from its offsets."""
    inputs = tensor_inputs(node)
    if len(inputs) != 3:
        return None
    seen: set[str] = set()
    stack = [inputs[2]]
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.op == "call_function" and current.target is aten.topk.default:
            return current
        if current.op == "call_function":
            stack.extend(tensor_inputs(current))
    return None


def _local_fraction(size: int, placement: object, dim: int, world_size: int) -> float:
    """Share of a dim of ``size`` the largest rank holds when ``placement`` splits tensor dim ``dim``."""
    split = split_of(placement)
    if split is None or split[0] % 3 != dim:
        return 1.0
    blocks = split[1]
    return blocks * math.ceil(size // blocks / world_size) / size


@register_local_work(*GROUPED_MM_OPS)
def _routed_work(node: fx.Node, strategy: Strategy, world_size: int, generic: tuple[float, float],
                 shares: tuple[float, ...] | None = None) -> LocalWork | None:
    """A grouped GEMM reads only the experts that were sent rows, and with experts placed the busiest rank does
    the rows of its own experts (:mod:`autotp.cost_model.routing`: a uniform router, or the measured ``shares`` of
    the rows per expert): under ``w S(0)`` its FLOPs, the rows it reads and writes and the weights of its experts
    hit; under any other strategy the split share, less the weights of the experts no row reaches. Its GEMMs are
    the global op's (rows per expert, whole width) when experts are placed."""
    weight = expert_weight_input(node)
    router = router_of(node) if weight is not None else None
    if weight is None or router is None:
        return None
    rows, width_in = (concrete_size(size) for size in shape(tensor_inputs(node)[0]))
    experts, _, width_out = (concrete_size(size) for size in shape(weight))
    top_k = int(arg(router, 1, "k", 1))
    tokens = rows / max(1, top_k)
    if shares is not None and len(shares) != experts:
        raise ValueError(f"a measured load of {len(shares)} experts was given for {node.name}, whose weight has "
                         f"{experts}: measure the load on this model (autotp.measure_expert_load)")
    itemsize = node.meta["val"].element_size()
    expert_bytes = width_in * width_out * itemsize
    if strategy.inputs[1] == Shard(0):
        if shares is None:
            held = math.ceil(experts / world_size)
            busy = busiest_rank_rows(tokens, top_k, experts, held, world_size)
            hit = min(float(held), busy)
        else:
            busy, hit = _placed_load(tokens, top_k, shares, world_size)
        nbytes = busy * (width_in + width_out) * itemsize + hit * expert_bytes
        return LocalWork(2.0 * busy * width_in * width_out, nbytes, (max(1, rows // experts), width_out, width_in))
    flops, nbytes = generic
    local_weight = experts * expert_bytes * _local_fraction(width_in, strategy.inputs[1], 1, world_size) * \
        _local_fraction(width_out, strategy.inputs[1], 2, world_size)
    hit_all = (expected_experts_hit(tokens, top_k, experts) if shares is None
               else experts_hit_of_shares(tokens, top_k, shares))
    unread = local_weight * (1.0 - hit_all / experts)
    return LocalWork(flops, max(0.0, nbytes - unread))


def _placed_load(tokens: float, top_k: int, shares: tuple[float, ...], world_size: int) -> tuple[float, float]:
    """Under a measured router, the busiest rank's expected rows and the most experts hit on one rank, when rank r
    holds the contiguous experts of :func:`~autotp.cost_model.routing.even_expert_counts` (as the plan cuts them)."""
    counts = even_expert_counts(len(shares), world_size)
    busy = busiest_rank_rows_of_shares(tokens, top_k, shares, counts)
    return busy, min(max(experts_hit_per_rank(tokens, top_k, shares, counts)), busy)
