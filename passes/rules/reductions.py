"""Reductions (sum, mean, max, var...) and ops that mix values along one dim (softmax, cumsum, flip).

A non-reduced dim keeps its split; a ``sum`` over a split dim gives a ``Partial`` sum; a
Partial input passes through the linear ones (sum, mean, cumsum). Softmax-like ops keep the
split of every dim but the one they mix along.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, norm_dim, shape, tensor_inputs
from autotp.passes.rules.builders import P, R, broadcast_placement, dim_map_rule
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


def _reduced_dims(node: fx.Node, in_ndim: int) -> list[int]:
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(in_ndim))
    dims = arg(node, 1, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(in_ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(norm_dim(d, in_ndim) for d in dims)  # type: ignore[union-attr]


def _keepdim(node: fx.Node) -> bool:
    if node.target in (aten.sum.default, aten.mean.default):
        return False
    if node.target in (aten.var.correction, aten.std.correction):
        return bool(node.kwargs.get("keepdim", False))
    if node.target in (aten.var.dim, aten.std.dim):  # var(input, dim, unbiased, keepdim)
        return bool(arg(node, 3, "keepdim", False))
    return bool(arg(node, 2, "keepdim", False))


@register_rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.sum.default,
               aten.mean.default, aten.var.correction, aten.std.correction, aten.any.dim, aten.all.dim,
               aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.logsumexp.default,
               aten.prod.dim_int, aten.any.dims, aten.all.dims, aten.var.dim, aten.std.dim)
def _reduction(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Sharded non-reduced dims stay sharded; a ``sum`` over a sharded dim gives Partial."""
    in_shape = shape(tensor_inputs(node)[0])
    reduced = _reduced_dims(node, len(in_shape))
    keep = _keepdim(node)
    strategies = []
    linear = node.target in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
    if linear:
        strategies.append(Strategy((P,), P))
    for d, size in enumerate(in_shape):
        if size <= 1:
            continue
        if d in reduced:
            if node.target in (aten.sum.dim_IntList, aten.sum.default):
                strategies.append(Strategy((Shard(d),), P))
            continue
        out_dim = d if keep else d - sum(1 for r in reduced if r < d)
        strategies.append(Strategy((Shard(d),), Shard(out_dim)))
    return strategies


@register_rule(aten.cumsum.default, aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
               aten.log_softmax.int, aten.diff.default, aten._safe_softmax.default, aten.cumprod.default,
               aten.logcumsumexp.default, aten.flip.default)
def _along_dim(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that mix values along one dim: any other dim may stay sharded."""
    inputs = tensor_inputs(node)
    in_shape = shape(inputs[0])
    if node.target is aten.flip.default:
        flipped = [norm_dim(d, len(in_shape)) for d in node.args[1]]
        return dim_map_rule(node, {d: d for d in range(len(in_shape)) if d not in flipped}, ctx.block_counts)
    dim_index = 2 if node.target is aten.diff.default else 1  # diff(input, n, dim, prepend, append)
    dim = norm_dim(arg(node, dim_index, "dim", -1), len(in_shape))  # type: ignore[arg-type]
    rest = tuple(R for _ in inputs[1:])
    strategies = []
    if node.target is aten.cumsum.default:
        strategies.append(Strategy((P, *rest), P))
    for d, size in enumerate(in_shape):
        if d != dim and size > 1:
            others = tuple(broadcast_placement(i, len(in_shape), d) for i in inputs[1:])
            strategies.append(Strategy((Shard(d), *others), Shard(d)))
    return strategies
