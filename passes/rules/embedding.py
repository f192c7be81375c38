"""Embedding lookup: split the hidden dim, the ids, or the vocabulary (with its rank-local form).

Vocabulary-parallel (``weight S(0) -> Partial``): each rank holds a range of rows, looks up the
ids in its range and writes zeros for the others, so the ranks' outputs sum to the lookup.
The rank-local form (:func:`_local_embedding`) localises the ids; :func:`_local_embedding_kernels` names the
ops it adds, which the cost pass prices.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autotp.base.placements import Shard
from autotp.base.shapes import concrete_shape, is_static
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import shape, tensor_inputs
from autotp.passes.rules.builders import P, R
from autotp.passes.rules.registry import (
    LocalGraph,
    RuleContext,
    register_local_form,
    register_local_form_kernels,
    register_rule,
)

aten = torch.ops.aten

__all__: list[str] = []


@register_rule(aten.embedding.default)
def _embedding(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Lookup rows of ``weight (V, H)``: split H (output last dim), the indices' dims, or the vocabulary.

    The vocabulary split is offered when every rank can hold at least one row.
    """
    weight, indices = tensor_inputs(node)[:2]
    out_ndim = len(shape(node))
    vocab, hidden = shape(weight)
    strategies = []
    if hidden > 1:
        strategies.append(Strategy((Shard(1), R), Shard(out_ndim - 1)))
    if vocab >= ctx.world_size:
        strategies.append(Strategy((Shard(0), R), P))
    for d, size in enumerate(shape(indices)):
        if size > 1:
            strategies.append(Strategy((R, Shard(d)), Shard(d)))
    return strategies


@register_local_form(aten.embedding.default)
def _local_embedding(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """Vocabulary-parallel lookup (``weight S(0) -> Partial``): ids outside this rank's rows give zeros.

    ``local = ids - offset``; ids with ``0 <= local < rows`` look up row ``local`` of this rank's
    shard, the others look up row 0 and are zeroed, so the ranks' outputs sum to the lookup.
    """
    if strategy.inputs[0] != Shard(0):
        return None
    weight = node.args[0]
    offset, rows = builder.parts.local(weight.name, 0, builder.rank)
    local_weight, global_ids = args[0], args[1]
    if rows == 0:  # more ranks than rows: this rank holds none, and contributes zeros
        # ids.shape + (embedding dim,), the dynamic sizes read from the ids at run time
        ids = node.args[1].meta["val"]
        out_shape = [size if is_static(size) else builder.call(aten.sym_size.int, global_ids, d, meta_from=node)
                     for d, size in enumerate(ids.shape)] + [concrete_shape(weight.meta["val"])[1]]
        return builder.call(aten.new_zeros.default, local_weight, out_shape, meta_from=node)
    local = builder.call(aten.sub.Tensor, global_ids, offset, meta_from=node)
    inside = builder.call(aten.bitwise_and.Tensor,
                          builder.call(aten.ge.Scalar, local, 0, meta_from=node),
                          builder.call(aten.lt.Scalar, local, rows, meta_from=node), meta_from=node)
    safe = builder.call(aten.where.ScalarOther, inside, local, 0, meta_from=node)
    looked_up = builder.graph.call_function(node.target, (local_weight, safe, *args[2:]), kwargs)
    outside = builder.call(aten.logical_not.default, builder.call(aten.unsqueeze.default, inside, -1, meta_from=node),
                           meta_from=node)
    return builder.call(aten.masked_fill.Scalar, looked_up, outside, 0.0, meta_from=node)


@register_local_form_kernels(aten.embedding.default)
def _local_embedding_kernels(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[object, int], ...]:
    """The ops :func:`_local_embedding` runs besides the lookup under the vocabulary split, with the bytes each
    reads and writes: five over the ids (``n`` of them) that localise and mask them, the mask's view and negation,
    and the zeros written over the rows this rank does not hold (a pass over the output)."""
    if strategy.inputs[0] != Shard(0) or world_size == 1:
        return ()
    indices = tensor_inputs(node)[1]
    n = math.prod(shape(indices))
    id_bytes = indices.meta["val"].element_size()
    out_bytes = n * shape(node)[-1] * node.meta["val"].element_size()
    return ((aten.sub.Tensor, 2 * n * id_bytes), (aten.ge.Scalar, n * id_bytes + n),
            (aten.lt.Scalar, n * id_bytes + n), (aten.bitwise_and.Tensor, 3 * n),
            (aten.where.ScalarOther, n + 2 * n * id_bytes), (aten.unsqueeze.default, 0),
            (aten.logical_not.default, 2 * n), (aten.masked_fill.Scalar, 2 * out_bytes + n))
