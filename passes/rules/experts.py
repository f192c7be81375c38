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
from autotp.base.placements import ExpertLocal, ExpertPartial, Shard, split_of
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
from autotp.passes.rules.args import arg, norm_dim, shape, tensor_inputs
from autotp.passes.rules.builders import P, R
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

__all__ = ["BATCHED_EXPERT_OPS", "EP", "EXPERT_ROLE", "GROUPED_MM_OPS", "batched_expert_weight",
           "expert_weight_input", "expert_weight_source", "is_grouped_mm", "mark_expert_roles", "nearest_router",
           "placed_grouped_mm", "router_of"]

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
    row there (``ids - first + 1``) and clamped into the padding, so ids of other ranks' experts read zeros. The
    table's experts are cut where the GEMM's weight is (checked: the same experts on every rank)."""
    if strategy.inputs[0] != Shard(0) or strategy.output != EP:
        return None
    table = tensor_inputs(node)[0]
    gemm = _expert_table_lookup(node)
    weight = tensor_inputs(gemm)[1] if gemm is not None else None
    first, count = builder.parts.local(table.name, 0, builder.rank)
    if weight is None or builder.parts.local(weight.name, 0, builder.rank) != (first, count):
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
