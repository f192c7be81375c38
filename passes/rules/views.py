"""Shape ops: reshapes, dim moves, slicing, concatenation, splitting.

A reshape keeps a split when the split dim is the outermost dim of its group on both sides
(:func:`view_groups`); ops that move dims (transpose, permute, squeeze...) carry each split to
the dim's new place; slicing, concatenating or stacking along one dim keeps the split of the
others. An equal k-way ``split``/``chunk`` of a dim is what makes k a *block count* of the
graph (:func:`block_counts`): a ``BlockShard(d, k)`` input comes out of it as plain
``Shard(d)`` pieces, so fused projections split by heads.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, norm_dim, shape, tensor_inputs
from autotp.passes.rules.builders import P, dim_map_rule, fitting_blocks
from autotp.passes.rules.registry import LocalGraph, RuleContext, register_local_form, register_rule

aten = torch.ops.aten

__all__ = ["block_counts", "equal_split_count", "view_groups"]


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into groups of input dims and output dims with equal products.

    ``(2, 16, 256) -> (2, 16, 8, 32)`` gives ``[([0], [0]), ([1], [1]), ([2], [2, 3])]``.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = 1
        if i < len(in_shape):
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < len(out_shape):
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(in_shape):
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < len(out_shape):
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def equal_split_count(node: fx.Node) -> tuple[int, int] | None:
    """``(dim, k)`` when ``node`` splits a tensor into k > 1 equal pieces along ``dim``."""
    if node.op != "call_function" or node.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    src = tensor_inputs(node)[0]
    src_shape = shape(src)
    dim = norm_dim(arg(node, 2, "dim", 0), len(src_shape))  # type: ignore[arg-type]
    size = src_shape[dim]
    if node.target is aten.split.Tensor:
        piece = node.args[1]
        k = size // piece if isinstance(piece, int) and piece > 0 and size % piece == 0 else 0
    elif node.target is aten.chunk.default:
        k = node.args[1] if size % node.args[1] == 0 else 0
    else:
        sizes = list(node.args[1])
        k = len(sizes) if len(set(sizes)) == 1 else 0
    return (dim, k) if k > 1 else None


def block_counts(gm: fx.GraphModule) -> frozenset[int]:
    """The k of every equal k-way split in ``gm`` (candidates for ``BlockShard``)."""
    found = (equal_split_count(n) for n in gm.graph.nodes)
    return frozenset(f[1] for f in found if f is not None)


def _outermost(dims: list[int], dims_shape: Sequence[int]) -> int | None:
    for d in dims:
        if dims_shape[d] > 1:
            return d
    return None


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int)
def _view(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A sharded dim survives a reshape when it is the outermost dim of its group on both sides."""
    src = tensor_inputs(node)[0]
    in_shape, out_shape = shape(src), shape(node)
    strategies = [Strategy((P,), P)]
    for gi, gj in view_groups(in_shape, out_shape):
        a, c = _outermost(gi, in_shape), _outermost(gj, out_shape)
        if a is not None and c is not None:
            strategies.append(Strategy((Shard(a),), Shard(c)))
            if in_shape[a] == out_shape[c]:  # the dim is carried over whole: its blocks too
                for k in fitting_blocks(in_shape[a], ctx.block_counts):
                    strategies.append(Strategy((BlockShard(a, k),), BlockShard(c, k)))
    return strategies


@register_rule(aten.transpose.int)
def _transpose(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(shape(node))
    a, b = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return dim_map_rule(node, dict(enumerate(perm)), ctx.block_counts)


@register_rule(aten.t.default)
def _t(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(shape(node))
    return dim_map_rule(node, dict(enumerate(reversed(range(ndim)))) if ndim == 2 else {0: 0}, ctx.block_counts)


@register_rule(aten.permute.default)
def _permute(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(shape(node))
    perm = [norm_dim(d, ndim) for d in node.args[1]]
    return dim_map_rule(node, dict(enumerate(perm)), ctx.block_counts)


@register_rule(aten.unsqueeze.default)
def _unsqueeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(shape(node))
    new = norm_dim(node.args[1], ndim)
    return dim_map_rule(node, {d: d - (d > new) for d in range(ndim) if d != new}, ctx.block_counts)


@register_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape = shape(tensor_inputs(node)[0])
    if node.target is aten.squeeze.default:
        removed = {d for d, s in enumerate(in_shape) if s == 1}
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        removed = {norm_dim(d, len(in_shape)) for d in dims if in_shape[norm_dim(d, len(in_shape))] == 1}
    kept = [d for d in range(len(in_shape)) if d not in removed]
    return dim_map_rule(node, dict(enumerate(kept)), ctx.block_counts)


@register_rule(aten.expand.default)
def _expand(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape, out_shape = shape(tensor_inputs(node)[0]), shape(node)
    lead = len(out_shape) - len(in_shape)
    mapping = {d: d - lead for d in range(lead, len(out_shape)) if in_shape[d - lead] == out_shape[d]}
    return dim_map_rule(node, mapping, ctx.block_counts)


@register_rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def _slice(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Slicing along one dim keeps the split of every other dim."""
    in_shape = shape(tensor_inputs(node)[0])
    cut = norm_dim(arg(node, 1, "dim", 0), len(in_shape))  # type: ignore[arg-type]
    out_ndim = len(shape(node))
    if node.target is aten.select.int:
        mapping = {d - (d > cut): d for d in range(len(in_shape)) if d != cut}
    else:
        mapping = {d: d for d in range(out_ndim) if d != cut}
    return dim_map_rule(node, mapping)


@register_rule(aten.cat.default)
def _cat(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    inputs = tensor_inputs(node)
    out_shape = shape(node)
    cat_dim = norm_dim(arg(node, 1, "dim", 0), len(out_shape))  # type: ignore[arg-type]
    strategies = [Strategy(tuple(P for _ in inputs), P)]
    for dim, size in enumerate(out_shape):
        if dim != cat_dim and size > 1 and all(len(shape(i)) == len(out_shape) for i in inputs):
            strategies.append(Strategy(tuple(Shard(dim) for _ in inputs), Shard(dim)))
    return strategies


@register_rule(aten.stack.default)
def _stack(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Stacking along a new dim: every input dim keeps its split (shifted past the new dim)."""
    inputs = tensor_inputs(node)
    out_ndim = len(shape(node))
    new = norm_dim(arg(node, 1, "dim", 0), out_ndim)  # type: ignore[arg-type]
    strategies = [Strategy(tuple(P for _ in inputs), P)]
    for d, size in enumerate(shape(inputs[0])):
        if size > 1:
            strategies.append(Strategy(tuple(Shard(d) for _ in inputs), Shard(d + (d >= new))))
    return strategies


@register_rule(aten.repeat.default)
def _repeat(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Tiling: a dim repeated once keeps its split (new leading dims and tiled dims are whole)."""
    in_shape = shape(tensor_inputs(node)[0])
    repeats = list(node.args[1])
    lead = len(repeats) - len(in_shape)
    return dim_map_rule(node, {d + lead: d for d in range(len(in_shape)) if repeats[d + lead] == 1})


@register_rule(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Each element repeated r times in place: every dim keeps its split, the repeated one too.

    A contiguous block of input rows ``[a, b)`` becomes output rows ``[a r, b r)``, so the
    repeated dim is cut at proportional points (what ``passes/uneven.py`` does).
    """
    in_shape, out_shape = shape(tensor_inputs(node)[0]), shape(node)
    dim = arg(node, 2, "dim")
    output_size = arg(node, 3, "output_size")
    if dim is None or len(in_shape) != len(out_shape):
        return []
    dim = norm_dim(dim, len(in_shape))  # type: ignore[arg-type]
    strategies = [Strategy((P,), P)]
    for d, size in enumerate(in_shape):
        if size > 1 and (d != dim or output_size is None):
            strategies.append(Strategy((Shard(d),), Shard(d)))
    return strategies


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape = shape(tensor_inputs(node)[0])
    dim_index = 1 if node.target is aten.unbind.int else 2  # unbind(x, dim); split(x, size, dim)
    cut = norm_dim(arg(node, dim_index, "dim", 0), len(in_shape))  # type: ignore[arg-type]
    strategies = [Strategy((P,), P)]
    for dim, size in enumerate(in_shape):
        if dim != cut and size > 1 and node.target is not aten.unbind.int:
            strategies.append(Strategy((Shard(dim),), Shard(dim)))
    equal = equal_split_count(node)
    if equal is not None and in_shape[cut] // equal[1] > 1:
        # each of the k blocks is split across ranks: every piece comes out split on the same dim
        strategies.append(Strategy((BlockShard(cut, equal[1]),), Shard(cut)))
    return strategies


@register_local_form(aten.split.Tensor)
def _local_block_split(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A block-sharded tensor split into its k blocks: always k pieces, even when this rank's are empty.

    (``split(x, 0)`` on an empty dim returns one piece, not k; ``split_with_sizes`` returns k.)
    """
    if not isinstance(strategy.inputs[0], BlockShard):
        return None
    blocks = strategy.inputs[0].blocks
    return builder.graph.call_function(aten.split_with_sizes.default, (args[0], [args[1]] * blocks, *args[2:]), kwargs)


@register_rule(operator.getitem)
def _getitem(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Passes through the placement of the multi-output producer (dims of the item)."""
    ndim = len(shape(node))
    return [Strategy((P,), P)] + [Strategy((Shard(d),), Shard(d)) for d in range(ndim)]
