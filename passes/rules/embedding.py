"""Embedding lookup: split the hidden dim, the ids, or the vocabulary (with its rank-local form).

Vocabulary-parallel (``weight S(0) -> Partial``): each rank holds a range of rows, looks up the
ids in its range and writes zeros for the others, so the ranks' outputs sum to the lookup.
The rank-local form (:func:`_local_embedding`) localises the ids.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Shard
from autotp.base.shapes import concrete_shape, is_static
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import shape, tensor_inputs
from autotp.passes.rules.builders import P, R
from autotp.passes.rules.registry import LocalGraph, RuleContext, register_local_form, register_rule

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
