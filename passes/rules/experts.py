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

Where the block's tokens are split across the ranks instead (``S(0)`` of its rows: the token dim static), the same
whole experts are reached by all-to-all: each rank routes its own tokens (``S(local)`` values), the first grouped
GEMM sends every row to its expert's rank and the second sends the results back
(``autotp::dispatched_grouped_mm``; the section "Experts reached by all-to-all" below).

Expert placement is offered where ``RuleContext.place_experts`` (not in training plans: the rank-local ops
have no backward); :mod:`autotp.planning.experts` finds the blocks, forces a form and reports it.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autotp.adapters.torch_internals import OpOverload
from autotp.base.placements import ExpertPartial, LocalRows, RoutedRows, Shard, is_rank_local, split_of
from autotp.base.shapes import concrete_size, first_tensor, is_static
from autotp.base.strategy import Strategy
from autotp.cost_model.routing import busiest_rank_rows, expected_experts_hit
from autotp.passes.rules.args import arg, norm_dim, shape, tensor_inputs
from autotp.passes.rules.builders import P, R
from autotp.passes.rules.registry import (
    LocalGraph,
    LocalWork,
    RuleContext,
    register_local_form,
    register_local_form_kernels,
    register_local_work,
    register_op_collectives,
    register_rule_extension,
)

aten = torch.ops.aten

__all__ = ["EP", "GROUPED_MM_OPS", "LOCAL", "ROUTED", "dispatched_grouped_mm", "expert_weight_input",
           "has_placeable_experts", "inverse_permutation_of", "is_dispatched", "is_grouped_mm", "placed_grouped_mm",
           "positions", "routed_row_counts", "router_of"]

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
    """``w S(0)``: this rank's experts over their rows (``autotp::placed_grouped_mm``), or, with the rows of the
    ranks' own tokens, over the rows sent to them (``autotp::dispatched_grouped_mm``)."""
    if len(strategy.inputs) != 3 or strategy.inputs[1] != Shard(0):
        return None
    weight = tensor_inputs(node)[1]
    x, local_w = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs["offs"]
    fused = node.target is aten._grouped_mm.default
    if is_dispatched(strategy):
        counts = [builder.parts.local(weight.name, 0, rank)[1] for rank in range(builder.world_size)]
        dispatch, combine = _dispatch_and_combine(strategy)
        return builder.call(torch.ops.autotp.dispatched_grouped_mm.default, x, local_w, offs, counts, builder.rank,
                            builder.group_name, dispatch, combine, fused, meta_from=node)
    first, _ = builder.parts.local(weight.name, 0, builder.rank)
    return builder.call(torch.ops.autotp.placed_grouped_mm.default, x, local_w, offs, first, fused, meta_from=node)


@register_local_form_kernels(*GROUPED_MM_OPS)
def _placed_zero_fill(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[object, int], ...]:
    """The expert-placed form writes zeros into the rows of other ranks' experts: one fill of its output."""
    if len(strategy.inputs) != 3 or strategy.inputs[1] != Shard(0) or strategy.output != EP:
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
def _routed_work(node: fx.Node, strategy: Strategy, world_size: int,
                 generic: tuple[float, float]) -> LocalWork | None:
    """A grouped GEMM reads only the experts that were sent rows, and with experts placed the busiest rank does
    the rows of its own experts (:mod:`autotp.cost_model.routing`, a uniform router): under ``w S(0)`` its FLOPs,
    the rows it reads and writes and the weights of its experts hit; under any other strategy the split share,
    less the weights of the experts no row reaches. Its GEMMs are the global op's (rows per expert, whole
    width) when experts are placed."""
    weight = expert_weight_input(node)
    router = router_of(node) if weight is not None else None
    if weight is None or router is None:
        return None
    rows, width_in = (concrete_size(size) for size in shape(tensor_inputs(node)[0]))
    experts, _, width_out = (concrete_size(size) for size in shape(weight))
    top_k = int(arg(router, 1, "k", 1))
    tokens = rows / max(1, top_k)
    itemsize = node.meta["val"].element_size()
    expert_bytes = width_in * width_out * itemsize
    if strategy.inputs[1] == Shard(0):
        held = math.ceil(experts / world_size)
        busy = busiest_rank_rows(tokens, top_k, experts, held, world_size)
        hit = min(float(held), busy)
        nbytes = busy * (width_in + width_out) * itemsize + hit * expert_bytes
        return LocalWork(2.0 * busy * width_in * width_out, nbytes, (max(1, rows // experts), width_out, width_in))
    flops, nbytes = generic
    local_weight = experts * expert_bytes * _local_fraction(width_in, strategy.inputs[1], 1, world_size) * \
        _local_fraction(width_out, strategy.inputs[1], 2, world_size)
    unread = local_weight * (1.0 - expected_experts_hit(tokens, top_k, experts) / experts)
    return LocalWork(flops, max(0.0, nbytes - unread))


# --- Experts reached by all-to-all: the routed block on the tokens each rank holds ---------------------------------
#
# Where a block's tokens are split across the ranks (``S(0)`` of its ``(T, H)`` rows: sequence parallelism, which
# needs the token dim static), every op of the block but the grouped GEMMs works token by token, so a rank runs
# them on its own tokens as if it held every expert: the sort by expert, the gathers, the histogram and offsets, the
# router's weighting and the un-sort give ``S(local)`` values (its own rows, in its own order; integer values are
# positions among its own rows), the offsets a ``P`` (the sum of the ranks' histograms is the whole histogram). A
# grouped GEMM sends each expert's rows to the rank that holds it (``all_to_all_single``; rows are sorted by
# expert, so the rows of one rank's experts are one block), multiplies them there, and sends the results back into
# the sender's order (:func:`dispatched_grouped_mm`). Between the two grouped GEMMs of one expert MLP the rows may
# stay where they were sent (``S(routed)``: the middle is row by row), so the block dispatches once and combines
# once. The un-sort through the inverse permutation brings the rows back in token order: ``S(0)`` again, with no
# all-reduce. No token is dropped: each expert's owner computes every row sent to it.

LOCAL = LocalRows()
ROUTED = RoutedRows()

_ROW_BY_ROW = (*_ZERO_AT_ZERO, aten.sigmoid.default, aten.exp.default, aten.abs.default, aten.gelu.default)
"""Ops of one tensor that work row by row (any row order, any row count: no shape argument)."""


def routed_row_counts(gm: fx.GraphModule) -> frozenset[int]:
    """The static row counts of ``gm``'s grouped GEMMs over 3-D expert weights (a dynamic token dim is never split,
    so its blocks give none): ``RuleContext.routed_rows``."""
    counts = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_grouped_mm(node.target) and expert_weight_input(node) is not None:
            value = tensor_inputs(node)[0].meta.get("val")
            if isinstance(value, torch.Tensor) and is_static(value.shape[0]):
                counts.add(int(value.shape[0]))
    return frozenset(counts)


def _routed(node: fx.Node | None, ctx: RuleContext) -> bool:
    """Whether ``node``'s value has as many rows as a routed block (``RuleContext.routed_rows``): only such values
    are offered the rank-local placements."""
    if node is None or not ctx.place_experts or not ctx.routed_rows:
        return False
    value = first_tensor(node.meta.get("val"))
    return value is not None and value.dim() > 0 and is_static(value.shape[0]) and int(value.shape[0]) in ctx.routed_rows


@register_rule_extension(*GROUPED_MM_OPS)
def _dispatched_experts(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``w S(0)`` with rows of the ranks' own tokens: ``x S(local)`` (dispatch) or ``S(routed)`` (already sent), the
    offsets of each rank's own rows (``P``) -> ``S(local)`` (combined back) or ``S(routed)`` (kept for the next
    grouped GEMM of the expert MLP)."""
    if expert_weight_input(node) is None or not _routed(tensor_inputs(node)[0], ctx):
        return []
    w = Shard(0)
    return [Strategy((LOCAL, w, P), LOCAL), Strategy((LOCAL, w, P), ROUTED), Strategy((ROUTED, w, P), LOCAL)]


@register_rule_extension(aten.sort.default, aten.sort.stable)
def _sort_own_tokens(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A 1-D sort of split rows on each rank alone: its own values sorted, the positions among its own rows."""
    if not _routed(node.args[0], ctx) or len(shape(node.args[0])) != 1:  # type: ignore[arg-type]
        return []
    return [Strategy((Shard(0),), LOCAL)]


@register_rule_extension(*_ROW_BY_ROW, aten.floor_divide.default, aten.unsqueeze.default)
def _row_by_row(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """An op of one value that works row by row keeps its rows where they are (a position's multiple, an unsqueeze
    after the rows: on a rank's own rows only)."""
    inputs = tensor_inputs(node)
    if len(inputs) != 1 or not _routed(inputs[0], ctx):
        return []
    if node.target is aten.unsqueeze.default:
        return [Strategy((LOCAL,), LOCAL)] if norm_dim(node.args[1], len(shape(node))) != 0 else []  # type: ignore[arg-type]
    routed = [Strategy((ROUTED,), ROUTED)] if node.target in _ROW_BY_ROW else []
    return [Strategy((LOCAL,), LOCAL), *routed]


@register_rule_extension(aten.mul.Tensor, aten.mul.Scalar)
def _mul_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Two values of the same rows (or one and a scalar) keep them where they are: both with their rows on dim 0
    (as many dims each; a value of fewer dims would broadcast along another dim than its rows)."""
    inputs = tensor_inputs(node)
    if not inputs or not all(_routed(i, ctx) for i in inputs) or len({len(shape(i)) for i in inputs}) != 1:
        return []
    return [Strategy(tuple(form for _ in inputs), form) for form in (LOCAL, ROUTED)]


@register_rule_extension(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, operator.getitem)
def _pieces_of_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Pieces of each row (the gate and up halves) stay with the rows; a sort's outputs are picked as they are."""
    inputs = tensor_inputs(node)
    if len(inputs) != 1 or not _routed(inputs[0], ctx):
        return []
    if node.target is not operator.getitem:
        dim = norm_dim(arg(node, 2, "dim", 0), len(shape(inputs[0])))  # type: ignore[arg-type]
        if dim == 0:
            return []
    return [Strategy((LOCAL,), LOCAL), Strategy((ROUTED,), ROUTED)]


@register_rule_extension(aten._to_copy.default, aten.empty_like.default)
def _same_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A copy (another dtype) or an empty tensor like a rank's own rows: its own rows."""
    inputs = tensor_inputs(node)
    return [Strategy((LOCAL,), LOCAL)] if len(inputs) == 1 and _routed(inputs[0], ctx) else []


@register_rule_extension(aten.histc.default)
def _histogram_of_own_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """The histogram (fixed range) of a rank's own sorted values: the ranks' histograms sum to the whole one.
    Positions (a sort's indices) mean nothing summed across ranks and are not taken."""
    inputs = tensor_inputs(node)
    if len(inputs) != 1 or not _routed(inputs[0], ctx) or _holds_positions(inputs[0]):
        return []
    low, high = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    return [Strategy((LOCAL,), P)] if low < high else []  # type: ignore[operator]


def _holds_positions(node: fx.Node) -> bool:
    """Whether ``node``'s values are positions among rows (a sort's indices, their inverse, their multiples)."""
    while node.op == "call_function" and node.target in (aten._to_copy.default, aten.floor_divide.default,
                                                          aten.clone.default):
        node = tensor_inputs(node)[0]
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return (isinstance(source, fx.Node) and source.op == "call_function"
                and source.target in (aten.sort.default, aten.sort.stable) and node.args[1] == 1)
    return node.op == "call_function" and node.target in (aten.index_put.default, aten.arange.default)


def _single_index(node: fx.Node) -> fx.Node | None:
    """The one index tensor of ``x[idx]`` (``aten.index.Tensor`` with one 1-D index on dim 0), else None."""
    indices = arg(node, 1, "indices", ())
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    return indices[0] if len(shape(indices[0])) == 1 else None


def inverse_permutation_of(node: fx.Node) -> fx.Node | None:
    """The sort positions ``perm`` that ``node`` inverts, where ``node`` is ``index_put(empty_like(perm), [perm],
    arange(len(perm)))`` (``inv[perm] = arange``: transformers' un-sort), else None."""
    if node.op != "call_function" or node.target is not aten.index_put.default:
        return None
    base, indices, values = node.args[0], node.args[1], node.args[2]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return None
    perm = indices[0]
    counts = shape(perm)
    return perm if (_holds_positions(perm) and isinstance(base, fx.Node) and base.target is aten.empty_like.default
                    and base.args[0] is perm and isinstance(values, fx.Node) and values.target is aten.arange.default
                    and len(values.args) == 1 and values.args[0] == (counts[0] if counts else None)) else None


@register_rule_extension(aten.index.Tensor)
def _index_own_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x[positions]`` on a rank's own rows: ``x`` split by rows (``S(0)``), positions among this rank's rows ->
    rank-local rows; rank-local rows through the inverse of the rank's own sort come back in token order
    (``S(0)``)."""
    index = _single_index(node)
    inputs = tensor_inputs(node)
    if index is None or not _routed(index, ctx) or len(inputs) != 2 or not _holds_positions(index):
        return []
    strategies = [Strategy((Shard(0), LOCAL), LOCAL)]
    if inverse_permutation_of(index) is not None:
        strategies.append(Strategy((LOCAL, LOCAL), Shard(0)))
    return strategies


@register_rule_extension(aten.index_put.default)
def _inverse_of_own_sort(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """The inverse of a rank's own sort (``inv[perm] = arange``): rank-local; its ``arange`` runs over the rank's
    own rows (:func:`_local_inverse_permutation`)."""
    if not _routed(node, ctx) or inverse_permutation_of(node) is None:
        return []
    return [Strategy((LOCAL, LOCAL, R), LOCAL)]


@register_local_form(aten.index_put.default)
def _local_inverse_permutation(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict,
                               strategy: Strategy) -> fx.Node | None:
    """The inverse of this rank's own sort: ``inv[perm] = arange(len(perm))`` over its own positions."""
    if strategy.output != LOCAL:
        return None
    base, (perm,) = args[0], args[1]
    own = builder.call(torch.ops.autotp.positions.default, perm, meta_from=node)
    return builder.call(aten.index_put.default, base, [perm], own, meta_from=node)


def _positions_impl(like: torch.Tensor) -> torch.Tensor:
    return torch.arange(like.shape[0], device=like.device, dtype=like.dtype)


def _positions_fake(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(like.shape[0])


positions = torch.library.custom_op("autotp::positions", mutates_args=())(_positions_impl)
"""``like (n, ...) -> arange(n)`` in ``like``'s dtype and device: the positions of this rank's own rows."""
positions.register_fake(_positions_fake)


def _exchange_counts(offs: torch.Tensor, world_size: int, group_name: str) -> list[list[int]]:
    """Rows per expert of every rank's own tokens, from this rank's offsets (one all-gather of ``E`` counts)."""
    ends = offs.to(torch.int64)
    own = torch.diff(ends, prepend=ends.new_zeros(1))
    if world_size == 1:
        return [own.tolist()]
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(own.contiguous(), world_size, group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    return gathered.view(world_size, -1).tolist()


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """``all_to_all_single``: rows ``in_splits[r]`` of ``x`` to rank r, ``out_splits[r]`` rows from rank r."""
    sent = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(sent)


def _dispatched_grouped_mm_impl(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, expert_counts: list[int],
                                rank: int, group_name: str, dispatch: bool, combine: bool,
                                fused: bool) -> torch.Tensor:
    world_size = len(expert_counts)
    firsts = [sum(expert_counts[:r]) for r in range(world_size)]
    mine = range(firsts[rank], firsts[rank] + expert_counts[rank])
    counts = _exchange_counts(offs, world_size, group_name)  # (ranks, E): rows each rank's tokens sent each expert
    sent = [sum(counts[rank][firsts[r]:firsts[r] + expert_counts[r]]) for r in range(world_size)]
    received = [sum(counts[s][e] for e in mine) for s in range(world_size)]
    # rows arrive by sender (each sender's block by expert); the GEMM wants them by expert: this order
    starts, start = {}, 0
    for s in range(world_size):
        for e in mine:
            starts[s, e] = start
            start += counts[s][e]
    order = [i for e in mine for s in range(world_size) for i in range(starts[s, e], starts[s, e] + counts[s][e])]
    by_expert = torch.tensor(order, dtype=torch.int64, device=x.device)
    own_rows, routed_rows = sum(sent), sum(received)
    if x.shape[0] != (own_rows if dispatch else routed_rows):
        raise RuntimeError(f"autotp::dispatched_grouped_mm: {x.shape[0]} rows, but the offsets count "
                           f"{own_rows if dispatch else routed_rows}: the offsets must be this rank's own histogram "
                           "of its rows (a plan that feeds others is not one autotp makes)")
    if dispatch:
        x = _exchange(x, received, sent, group_name)[by_expert]  # (rows of my experts, K) by expert
    groups = [sum(counts[s][e] for s in range(world_size)) for e in mine]
    out = x.new_zeros(x.shape[0], w.shape[2])
    if fused and out.shape[0] > 0:
        local_offs = torch.tensor(groups, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)
        out = torch.ops.aten._grouped_mm(x, w, offs=local_offs)
    else:
        start = 0
        for i, rows in enumerate(groups):
            if rows:
                torch.mm(x[start:start + rows], w[i], out=out[start:start + rows])
            start += rows
    if not combine:
        return out
    by_sender = torch.empty_like(out)
    by_sender[by_expert] = out
    return _exchange(by_sender, sent, received, group_name)  # (this rank's own rows, N), in its sorted order


def _dispatched_grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, expert_counts: list[int],
                                rank: int, group_name: str, dispatch: bool, combine: bool,
                                fused: bool) -> torch.Tensor:
    rows = x.shape[0] if dispatch == combine else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, w.shape[2])


dispatched_grouped_mm = torch.library.custom_op("autotp::dispatched_grouped_mm", mutates_args=())(
    _dispatched_grouped_mm_impl)
"""``(x, w_local (n, K, N), offs (E,), expert_counts, rank, group_name, dispatch, combine, fused) -> rows``: this
rank's own rows sorted by expert (``dispatch``) or the rows already sent to it, multiplied by the experts that
hold them, and sent back to their ranks (``combine``) or kept where they are (module section above)."""
dispatched_grouped_mm.register_fake(_dispatched_grouped_mm_fake)


def is_dispatched(strategy: Strategy) -> bool:
    """Whether a grouped GEMM's strategy reaches its experts by all-to-all (rows ``S(local)`` or ``S(routed)``)."""
    return len(strategy.inputs) == 3 and strategy.inputs[1] == Shard(0) and is_rank_local(strategy.inputs[0])


def _dispatch_and_combine(strategy: Strategy) -> tuple[bool, bool]:
    return strategy.inputs[0] == LOCAL, strategy.output == LOCAL


@register_op_collectives(*GROUPED_MM_OPS)
def _dispatch_collectives(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[str, int], ...]:
    """Experts reached by all-to-all: one all-gather of the ranks' rows per expert (``E`` int64 each), the
    dispatch of the busiest rank's rows (``K`` wide) and the combine of its results (``N`` wide), each an
    all-to-all of the rows the busiest rank holds (:func:`autotp.cost_model.routing.busiest_rank_rows`, uniform
    router; the collectives' ``n`` is the data each rank holds)."""
    if not is_dispatched(strategy):
        return ()
    weight = expert_weight_input(node)
    router = router_of(node)
    if weight is None or router is None:
        return ()
    rows, width_in = (concrete_size(size) for size in shape(tensor_inputs(node)[0]))
    experts, _, width_out = (concrete_size(size) for size in shape(weight))
    top_k = int(arg(router, 1, "k", 1))  # type: ignore[arg-type]
    held = math.ceil(experts / world_size)
    busy = max(rows / world_size, busiest_rank_rows(rows / max(1, top_k), top_k, experts, held, world_size))
    itemsize = node.meta["val"].element_size()
    dispatch, combine = _dispatch_and_combine(strategy)
    found: list[tuple[str, int]] = [("all_gather", experts * 8 * world_size)]
    if dispatch:
        found.append(("all_to_all", int(busy * width_in * itemsize)))
    if combine:
        found.append(("all_to_all", int(busy * width_out * itemsize)))
    return tuple(found)
