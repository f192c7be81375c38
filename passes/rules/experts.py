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

Experts with a bias and a gate that is not zero at zero (GPT-OSS: ``out + bias[expert_id]``, then ``clamp``,
``sigmoid(1.702 gate)``, ``up + 1``) need no sum before the gate either: a rank's rows of the gate/up GEMM are
whole there already. The bias table is placed with its experts (``S(0)``) and looked up by the rows' expert ids
on each rank, zeros for other ranks' experts (``P(experts)``; :func:`mark_expert_roles` marks such lookups). Past
the gate the other rows are not zeros, but the next placed GEMM reads only its own experts' rows:
``L(experts)`` (:class:`~autotp.base.placements.ExpertLocal`) is a value right on each row's own rank and
anything elsewhere, kept by elementwise ops and by ops that move values within rows, and read only by a placed
GEMM (``x L(experts)``, ``w S(0)`` -> ``P(experts)``).

Expert placement is offered where ``RuleContext.place_experts`` (not in training plans: the rank-local op
has no backward); :mod:`autotp.planning.experts` finds the blocks, forces a form and reports it.

Experts computed as one batched product over every token (Llama-4 text: ``bmm(x (E, T, K), w (E, K, N))``, each
token's input scaled by its router score, zero for the experts it did not pick) need no rule of their own: the
expert dim is the batch dim, ``S(0)`` of both operands is the ordinary GEMM rule's batch split, and the sum over
experts after them turns it into an ordinary Partial. Between the experts and that sum, transformers views the
output ``(E, T, N)`` as ``(E*T, N)`` and back; a split cannot cross that view where the token count is dynamic,
so a batched expert GEMM routed by a ``topk`` is also offered ``(x S(0), w S(0)) -> P``: the rank's experts'
products, padded with zeros to all E experts (``aten.constant_pad_nd`` on the expert dim), a Partial sum that
the views and the sum carry to the block's one all-reduce. :func:`batched_expert_weight` and :func:`router_of`
say which ``bmm`` is such an expert GEMM, so that the planner can force and report its form.

Where the block's tokens are split across the ranks instead (``S(0)`` of its rows: the token dim static), the same
whole experts are reached by all-to-all: each rank routes its own tokens (``S(local)`` values), the first grouped
GEMM sends every row to its expert's rank and the second sends the results back
(``autotp::dispatched_grouped_mm``; the section "Experts reached by all-to-all" below).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.fx as fx

from autotp.adapters.torch_internals import OpOverload
from autotp.base.placements import ExpertLocal, ExpertPartial, LocalRows, RoutedRows, Shard, is_rank_local, split_of
from autotp.base.shapes import concrete_size, first_tensor, is_static
from autotp.base.strategy import Strategy
from autotp.cost_model.routing import (
    busiest_rank_rows,
    busiest_rank_rows_of_shares,
    even_expert_counts,
    expected_experts_hit,
    experts_hit_of_shares,
    experts_hit_per_rank,
)
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

__all__ = ["BATCHED_EXPERT_OPS", "EP", "EXPERT_ROLE", "GROUPED_MM_OPS", "LOCAL", "ROUTED", "batched_expert_weight",
           "dispatched_grouped_mm", "expert_weight_input", "expert_weight_source", "inverse_permutation_of",
           "is_dispatched", "is_grouped_mm", "mark_expert_roles", "nearest_router", "placed_grouped_mm", "positions",
           "routed_row_counts", "router_of"]

EP = ExpertPartial()
EL = ExpertLocal()

EXPERT_ROLE = "autotp_expert_role"
"""``node.meta`` key that :func:`mark_expert_roles` writes: ``"batched"`` on a batched expert GEMM routed by a
``topk``, ``"table"`` on a per-expert table looked up by the rows' expert ids. What the rules here know of a node's
neighbours; part of the node's structural key (:mod:`autotp.passes.node_keys`), so a node without the role never
shares the strategies of one with it."""

GROUPED_MM_OPS = (aten._grouped_mm.default, "transformers::grouped_mm_fallback")
"""The grouped GEMMs whose weight may be placed by expert (the same ops as :mod:`.grouped_mm`)."""

BATCHED_EXPERT_OPS = (aten.bmm.default,)
"""Batched GEMMs that may run experts over every token, the expert dim as their batch dim (Llama-4 text)."""

_CONTRACTING = frozenset(str(op) for op in (
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.linear.default,
    aten.matmul.default, aten.einsum.default, aten._grouped_mm.default, aten.convolution.default,
    aten.scaled_dot_product_attention.default)) | {"transformers.grouped_mm_fallback.default"}
"""GEMM-like ops (as ``str(target)``) that the search for a batched expert GEMM's router does not cross."""

_PASS_THROUGH = (aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
                 aten.reshape.default, aten.alias.default, aten.t.default, aten.contiguous.default, aten._to_copy.default)
"""Ops between an expert weight parameter and the GEMM that reads it (they keep dim 0, the experts)."""

_ZERO_AT_ZERO = (aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.neg.default,
                 aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default)
"""Elementwise ops of one tensor with ``f(0) = 0``: a row that is zero on a rank stays zero."""

_ROW_WISE = (aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.neg.default,
             aten.sigmoid.default, aten.exp.default, aten.clamp.default, aten.clamp_min.default,
             aten.clamp_max.default, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar,
             aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.div.Tensor, aten.div.Scalar,
             aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default)
"""Elementwise ops: each output element is computed from the same element of its inputs, so a row that is right
on its expert's rank stays right there (``L(experts)``), whatever the op gives elsewhere."""


def expert_weight_input(node: fx.Node) -> fx.Node | None:
    """The weight ``w (E, K, N)`` of a grouped GEMM ``(x (S, K), w, offs (E,))`` with E >= 2, else None."""
    inputs = tensor_inputs(node)
    if len(inputs) != 3 or arg(node, 2, "offs") is not inputs[2]:
        return None
    x_shape, w_shape = shape(inputs[0]), shape(inputs[1])
    if len(x_shape) != 2 or len(w_shape) != 3 or not isinstance(w_shape[0], int) or w_shape[0] < 2:
        return None
    return inputs[1]


def batched_expert_weight(node: fx.Node) -> fx.Node | None:
    """The weight ``w (E, K, N)`` of a ``bmm(x (E, T, K), w)`` whose batch dim could be experts (E >= 2), else None."""
    if node.op != "call_function" or node.target not in BATCHED_EXPERT_OPS:
        return None
    inputs = tensor_inputs(node)
    if len(inputs) != 2:
        return None
    x_shape, w_shape = shape(inputs[0]), shape(inputs[1])
    if len(x_shape) != 3 or len(w_shape) != 3 or not isinstance(w_shape[0], int) or w_shape[0] < 2:
        return None
    return inputs[1] if x_shape[0] == w_shape[0] else None


def expert_weight_source(weight: fx.Node) -> fx.Node | None:
    """The placeholder that ``weight`` (an expert GEMM's weight input) is a view of, or None."""
    while weight.op == "call_function" and weight.target in _PASS_THROUGH:
        weight = tensor_inputs(weight)[0]
    return weight if weight.op == "placeholder" else None


def _routed_batched_experts(node: fx.Node) -> bool:
    """Whether ``node`` is a batched expert GEMM over a weight placeholder, routed by a ``topk``."""
    weight = batched_expert_weight(node)
    return weight is not None and expert_weight_source(weight) is not None and router_of(node) is not None


def mark_expert_roles(gm: fx.GraphModule) -> bool:
    """Write :data:`EXPERT_ROLE` on the nodes of ``gm`` that have one (and clear it elsewhere); whether ``gm`` has
    experts to place: a grouped GEMM over a 3-D expert weight, or a routed batched expert GEMM (else no node is
    offered the strategies of experts placed)."""
    placeable = False
    for node in gm.graph.nodes:
        node.meta.pop(EXPERT_ROLE, None)
        if node.op != "call_function":
            continue
        if is_grouped_mm(node.target) and expert_weight_input(node) is not None:
            placeable = True
        elif _routed_batched_experts(node):
            node.meta[EXPERT_ROLE] = "batched"
            placeable = True
        elif _expert_table_lookup(node) is not None:
            node.meta[EXPERT_ROLE] = "table"
    return placeable


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


_PADDED = Strategy((Shard(0), Shard(0)), P)
"""A batched expert GEMM's placed form whose output is padded to all experts with zeros (module docstring)."""


@register_rule_extension(*BATCHED_EXPERT_OPS)
def _placed_batched_experts(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x S(0)``, ``w S(0)``: this rank's experts over every token, zeros for the other experts -> ``P``."""
    return [_PADDED] if ctx.place_experts and node.meta.get(EXPERT_ROLE) == "batched" else []


@register_local_form(*BATCHED_EXPERT_OPS)
def _local_padded_bmm(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict,
                      strategy: Strategy) -> fx.Node | None:
    """``(S(0), S(0)) -> P``: this rank's experts' products, padded with zeros on the expert dim to all E."""
    if strategy != _PADDED:
        return None
    weight = tensor_inputs(node)[1]
    first, count = builder.parts.local(weight.name, 0, builder.rank)
    experts = concrete_size(shape(weight)[0])
    local = builder.graph.call_function(node.target, tuple(args), kwargs)  # (count, T, N)
    pad = [0, 0, 0, 0, first, experts - first - count]  # last dim first: (N, T, E) before and after
    return builder.call(aten.constant_pad_nd.default, local, pad, meta_from=node)


@register_local_form_kernels(*BATCHED_EXPERT_OPS)
def _padded_kernels(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[object, int], ...]:
    """The padded form reads its experts' products and writes the whole ``(E, T, N)`` output: one pad."""
    if strategy != _PADDED:
        return ()
    out_bytes = math.prod(concrete_size(d) for d in shape(node)) * node.meta["val"].element_size()
    return ((aten.constant_pad_nd.default, round((1 + _expert_share(node, world_size)) * out_bytes)),)


def _expert_share(node: fx.Node, world_size: int) -> float:
    """Share of a batched expert GEMM's E experts the busiest rank holds under the expert split."""
    experts = concrete_size(shape(node)[0])
    return math.ceil(experts / world_size) / experts


@register_local_work(*BATCHED_EXPERT_OPS)
def _padded_work(node: fx.Node, strategy: Strategy, world_size: int, generic: tuple[float, float],
                 shares: tuple[float, ...] | None = None) -> LocalWork | None:
    """The padded form's GEMM writes only its own experts' products (the pad, priced on its own, writes the rest):
    its split share of the FLOPs and of the operands' bytes, not the whole output the Partial stands for."""
    if strategy != _PADDED:
        return None
    flops, _ = generic
    x, w = tensor_inputs(node)
    nbytes = sum(math.prod(concrete_size(d) for d in shape(t)) * t.meta["val"].element_size() for t in (x, w, node))
    return LocalWork(flops, _expert_share(node, world_size) * nbytes)


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


@register_rule_extension(*GROUPED_MM_OPS)
def _placed_experts_local_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x L(experts)``, ``w S(0)``: the expert-placed GEMM reads only its own experts' rows -> ``P(experts)``."""
    if not ctx.place_experts or expert_weight_input(node) is None:
        return []
    return [Strategy((EL, Shard(0), R), EP)]


@register_rule_extension(*_ROW_WISE)
def _row_wise(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """An elementwise op of values right on their experts' rows (and whole values) -> ``L(experts)``: the expert
    MLP between two placed GEMMs, gates that are not zero at zero (``sigmoid``, ``x + 1``) and biases included.
    A value that is not whole must have the output's shape (its rows are the output's rows)."""
    inputs = tensor_inputs(node)
    if not ctx.place_experts or not 1 <= len(inputs) <= 2:
        return []
    rows = [shape(t) == shape(node) for t in inputs]
    if len(inputs) == 1:
        return [Strategy((EL,), EL)] if rows[0] else []
    found = [Strategy((EL, R), EL)] if rows[0] else []
    found += [Strategy((R, EL), EL)] if rows[1] else []
    found += [Strategy((EL, EL), EL)] if all(rows) else []
    return found


@register_rule_extension(aten.add.Tensor)
def _add_placed(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A sum of two values whose rows lie on the same ranks keeps the zeros (a placed GEMM plus its expert bias)."""
    inputs = tensor_inputs(node)
    ok = ctx.place_experts and len(inputs) == 2 and all(shape(t) == shape(node) for t in inputs)
    return [Strategy((EP, EP), EP)] if ok else []


@register_rule_extension(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, operator.getitem,
                         aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
                         aten.unsqueeze.default)
def _keeps_rows(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that move values within each row (pieces of the gate/up projection: ``gate_up[:, ::2]``) keep the rows
    right on their experts' ranks."""
    inputs = tensor_inputs(node)
    if not ctx.place_experts or len(inputs) != 1:
        return []
    if node.target is operator.getitem:
        return [Strategy((EL,), EL)]
    in_shape = shape(inputs[0])
    if not in_shape:
        return []
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        keeps = bool(shape(node)) and shape(node)[0] == in_shape[0]
    elif node.target is aten.unsqueeze.default:
        keeps = norm_dim(int(arg(node, 1, "dim", 0)), len(in_shape) + 1) > 0  # type: ignore[call-overload]
    else:  # split, chunk (dim: argument 2), slice (argument 1): along a dim other than the rows
        dim = arg(node, 1 if node.target is aten.slice.Tensor else 2, "dim", 0)
        keeps = norm_dim(int(dim), len(in_shape)) > 0  # type: ignore[call-overload]
    return [Strategy((EL,), EL)] if keeps else []


def _routed_gemm_of_ids(ids: fx.Node, depth: int = 6) -> fx.Node | None:
    """The grouped GEMM whose offsets are counted from ``ids`` (the sorted expert id of each row: ``histc`` and
    ``cumsum`` of them), searched forward at most ``depth`` ops; None when ``ids`` route no grouped GEMM."""
    frontier = [ids]
    for _ in range(depth):
        following = []
        for node in frontier:
            for user in node.users:
                if user.op != "call_function":
                    continue
                if is_grouped_mm(user.target):
                    inputs = tensor_inputs(user)
                    if len(inputs) == 3 and inputs[2] is node and expert_weight_input(user) is not None:
                        return user
                    continue
                if str(user.target) not in _CONTRACTING:
                    following.append(user)
        frontier = following
    return None


def _expert_table_lookup(node: fx.Node) -> fx.Node | None:
    """For ``table[ids]`` with ``table (E, N)`` and ``ids`` the sorted expert ids that route a grouped GEMM over E
    experts (an expert bias gathered per row: GPT-OSS), that GEMM; else None."""
    if node.target is not aten.index.Tensor:
        return None
    inputs = tensor_inputs(node)
    indices = node.args[1] if len(node.args) > 1 else ()
    if len(inputs) != 2 or len(indices) != 1 or indices[0] is not inputs[1] or len(shape(inputs[0])) != 2:
        return None
    if len(shape(inputs[1])) != 1:
        return None
    gemm = _routed_gemm_of_ids(inputs[1])
    if gemm is None:
        return None
    weight = expert_weight_input(gemm)
    rows = shape(tensor_inputs(gemm)[0])[0]
    return gemm if weight is not None and shape(weight)[0] == shape(inputs[0])[0] and rows == shape(node)[0] else None


@register_rule_extension(aten.index.Tensor)
def _placed_expert_table(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``table S(0)`` (whole experts' rows of a per-expert table, as the GEMM's weight) looked up by the rows'
    expert ids -> ``P(experts)``: each rank gives its own experts' rows, zeros elsewhere."""
    return [Strategy((Shard(0), R), EP)] if ctx.place_experts and node.meta.get(EXPERT_ROLE) == "table" else []


@register_local_form(aten.index.Tensor)
def _local_expert_table(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict,
                        strategy: Strategy) -> fx.Node | None:
    """``table S(0) -> P(experts)``: the local table padded with a zero row on either side, and each id moved to its
    row there (``ids - first + 1``) and clamped into the padding, so ids of other ranks' experts read zeros. Where
    the GEMM's weight is placed by experts too, the table's experts are cut where the weight's are (checked: the
    same experts on every rank); where the GEMM is split, the lookup's ``P(experts)`` is a partial sum of the
    table's own rows, read as a plain Partial after it."""
    if strategy.inputs[0] != Shard(0) or strategy.output != EP:
        return None
    table = tensor_inputs(node)[0]
    gemm = _expert_table_lookup(node)
    weight = tensor_inputs(gemm)[1] if gemm is not None else None
    first, count = builder.parts.local(table.name, 0, builder.rank)
    if weight is not None and not builder.parts.splits(weight.name, 0):
        weight_cut = (first, count)  # the GEMM's experts are not placed in this plan: the table stands on its own cut
    else:
        weight_cut = builder.parts.local(weight.name, 0, builder.rank) if weight is not None else None
    if weight_cut != (first, count):
        raise ValueError(f"rank {builder.rank}: the expert table {table.name} is cut at other experts than the "
                         f"weight of {gemm.name if gemm is not None else 'its grouped GEMM'}: {node.format_node()}")
    local_table, ids = args[0], args[1][0]
    padded = builder.call(aten.constant_pad_nd.default, local_table, [0, 0, 1, 1], 0.0, meta_from=node)
    moved = builder.call(aten.sub.Tensor, ids, first - 1, meta_from=node)  # row 1 + (id - first) of `padded`
    rows = builder.call(aten.clamp.default, moved, 0, count + 1, meta_from=node)  # others: a zero row
    return builder.call(node.target, padded, [rows], meta_from=node)


@register_local_form_kernels(aten.index.Tensor)
def _expert_table_kernels(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[object, int], ...]:
    """The ops :func:`_local_expert_table` runs besides the lookup: the table's padding, two passes over the ids."""
    if strategy.inputs[0] != Shard(0) or strategy.output != EP:
        return ()
    table, ids = tensor_inputs(node)
    n = math.prod(concrete_size(d) for d in shape(ids))
    id_bytes = ids.meta["val"].element_size()
    experts, width = (concrete_size(d) for d in shape(table))
    table_bytes = (math.ceil(experts / world_size) + 2) * width * table.meta["val"].element_size()
    return ((aten.constant_pad_nd.default, 2 * table_bytes), (aten.sub.Tensor, 2 * n * id_bytes),
            (aten.clamp.default, 2 * n * id_bytes))


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


Node = TypeVar("Node")


def nearest_router(start: Node, inputs_of: Callable[[Node], Sequence[Node]], op_of: Callable[[Node], str],
                   is_batched_expert: Callable[[Node], bool]) -> Node | None:
    """The ``topk`` nearest to ``start`` (the input rows of a batched expert GEMM), searched back breadth-first.

    The search crosses no GEMM-like op but a batched expert GEMM, through its input rows: the experts' first
    GEMM reads the router's scores without a GEMM between them (Llama-4 text: ``repeat(x) * scores``), their
    second reads the first's output. Nearest first, so a block finds its own router before the routers of the
    blocks before it (reached along the residual stream). Generic over the node type (``op_of`` gives
    ``str(target)``), so that a plan's records are read with the graph's rule."""
    seen: set[str] = set()
    queue = deque([start])
    while queue:
        node = queue.popleft()
        name = str(getattr(node, "name", id(node)))
        if name in seen:
            continue
        seen.add(name)
        op = op_of(node)
        if op == str(aten.topk.default):
            return node
        inputs = list(inputs_of(node))
        if op in _CONTRACTING:
            if not is_batched_expert(node) or not inputs:
                continue
            inputs = inputs[:1]  # a batched expert GEMM's input rows, never its weight
        queue.extend(inputs)
    return None


def _fx_op(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def router_of(node: fx.Node) -> fx.Node | None:
    """The ``topk`` whose indices route the rows of expert GEMM ``node``: searched back from a grouped GEMM's
    offsets, or from a batched expert GEMM's input rows (:func:`nearest_router`)."""
    if batched_expert_weight(node) is not None:
        return nearest_router(tensor_inputs(node)[0], tensor_inputs, _fx_op,
                              lambda n: batched_expert_weight(n) is not None)
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
