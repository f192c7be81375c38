"""Sharding rules for indexing ops: gather, scatter, advanced indexing, top-k and sort.

These ops move whole slices of a tensor by integer position, so a dim that is not indexed keeps
its split (each rank moves its columns), and the value operands are linear: a ``Partial`` sum
passes through a gather, and through a scatter when every written value is a ``Partial`` sum
too. The index tensors themselves are split only where the output is split the same way
(a rank gathers the rows its part of the index names). The routing ops of a mixture-of-experts
layer (top-k over the router scores, the sort of tokens by expert, the gather of tokens for
each expert and the scatter back) are all of this kind.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, is_float, is_tensor, norm_dim, shape, tensor_inputs, val
from autotp.passes.rules.builders import P, R, dim_map_rule, fitting_blocks
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for dims in shapes:
        for i, size in enumerate(dims):
            j = ndim - len(dims) + i
            out[j] = size if out[j] == 1 else out[j]
    return tuple(out)


def _indexed_region(ndim: int, present: list[int], b_ndim: int) -> tuple[int, dict[int, int], int]:
    """Where ``x[indices]`` puts each dim: ``(first dim of B, {dim of x not indexed: its dim}, ndim)``.

    ``present``: the dims of ``x`` (of ``ndim``) that an index tensor addresses; their index tensors
    broadcast to a shape B of ``b_ndim`` dims. If the indexed dims are adjacent, B takes their place,
    otherwise B comes first (NumPy's rule); the other dims follow in order.
    """
    adjacent = present == list(range(present[0], present[-1] + 1))
    b_start = present[0] if adjacent else 0
    rest: dict[int, int] = {}
    out_dim = 0
    for d in range(ndim):
        if d in present:
            if adjacent and d == present[0]:
                out_dim += b_ndim
            continue
        if not adjacent and out_dim < b_ndim:
            out_dim = b_ndim
        rest[d] = out_dim
        out_dim += 1
    return b_start, rest, max(out_dim, b_start + b_ndim)


@register_rule(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x[i0, :, i2]`` (advanced indexing with integer index tensors; ``None`` keeps a dim).

    The index tensors broadcast to one shape B. If the indexed dims are adjacent, B takes their
    place in the output, otherwise B comes first (NumPy's rule). A non-indexed dim of ``x``
    keeps its split; a dim of B may be split when every index tensor that spans it is split there.
    """
    x = tensor_inputs(node)[0]
    indices = list(node.args[1])
    index_nodes = [i for i in indices if isinstance(i, fx.Node)]
    if any(not is_tensor(i) or val(i).dtype in (torch.bool, torch.uint8) for i in index_nodes):
        return []  # boolean masks select a data-dependent number of elements
    x_shape = shape(x)
    present = [d for d, i in enumerate(indices) if i is not None]
    if not present:
        return []
    b_shape = _broadcast_shape([shape(i) for i in index_nodes])
    b_start, rest_out, _ = _indexed_region(len(x_shape), present, len(b_shape))
    idx_r = tuple(R for _ in index_nodes)
    strategies: list[Strategy] = []
    if is_float(x):
        strategies.append(Strategy((P, *idx_r), P))
    for d, od in rest_out.items():
        if x_shape[d] > 1:
            strategies.append(Strategy((Shard(d), *idx_r), Shard(od)))
            for k in fitting_blocks(x_shape[d], ctx.block_counts):
                strategies.append(Strategy((BlockShard(d, k), *idx_r), BlockShard(od, k)))
    for j, size in enumerate(b_shape):
        if size <= 1:
            continue
        placements: list[Placement] = [R]
        for i in index_nodes:
            i_shape = shape(i)
            di = j - (len(b_shape) - len(i_shape))
            placements.append(Shard(di) if di >= 0 and i_shape[di] > 1 else R)
        strategies.append(Strategy(tuple(placements), Shard(b_start + j)))
    return strategies


@register_rule(aten.index_select.default)
def _index_select(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x.index_select(dim, index)``: the other dims keep their split; the index may be split too."""
    x, index = tensor_inputs(node)[:2]
    x_shape = shape(x)
    dim = norm_dim(node.args[1], len(x_shape))
    strategies = [Strategy((P, R), P)] if is_float(x) else []
    strategies += [Strategy((Shard(d), R), Shard(d)) for d, size in enumerate(x_shape) if d != dim and size > 1]
    if shape(index) and shape(index)[0] > 1:
        strategies.append(Strategy((R, Shard(0)), Shard(dim)))
    return strategies


@register_rule(aten.gather.default)
def _gather(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x.gather(dim, index)``: output shaped like ``index``; ``out[.., i, ..] = x[.., index[.., i, ..], ..]``.

    Any dim of the index may be split (a rank gathers its part of the index from the whole
    ``x``); a dim other than ``dim`` where ``x`` and ``index`` have the same size may be split
    in both. ``x`` Partial passes through.
    """
    inputs = tensor_inputs(node)
    x, index = inputs[0], inputs[1]
    x_shape, i_shape = shape(x), shape(index)
    dim = norm_dim(node.args[1], len(x_shape))
    strategies = [Strategy((P, R), P)] if is_float(x) else []
    for d, size in enumerate(i_shape):
        if size <= 1:
            continue
        strategies.append(Strategy((R, Shard(d)), Shard(d)))
        if d != dim and x_shape[d] == size:
            strategies.append(Strategy((Shard(d), Shard(d)), Shard(d)))
    return strategies


@register_rule(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter.reduce,
               aten.scatter_reduce.two, aten.index_add.default)
def _scatter(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``self.scatter(dim, index, src)`` and kin: output shaped like ``self``.

    A dim other than ``dim`` where ``self``, ``index`` and ``src`` all have the same size may be
    split in all of them. Sums pass through when ``self`` and ``src`` are both Partial and the
    update is an overwrite or a sum (not a product, max or mean, and not a scalar fill).
    """
    inputs = tensor_inputs(node)
    shapes = [shape(i) for i in inputs]
    out_shape = shape(node)
    dim = norm_dim(node.args[1], len(out_shape))
    strategies: list[Strategy] = []
    for d, size in enumerate(out_shape):
        if d == dim or size <= 1:
            continue
        if node.target is aten.index_add.default:  # index_add(self, dim, index (1-D), source)
            ok = shapes[2][d] == size
            placements = (Shard(d), R, Shard(d))
        else:
            ok = all(len(s) == len(out_shape) and s[d] == size for s in shapes)
            placements = tuple(Shard(d) for _ in inputs)
        if ok:
            strategies.append(Strategy(placements, Shard(d)))
    reduce = arg(node, 4, "reduce")
    sums = node.target in (aten.scatter.src, aten.scatter_add.default, aten.index_add.default) or (
        node.target is aten.scatter_reduce.two and reduce == "sum")
    if sums and is_float(node) and len(inputs) == 3:
        strategies.append(Strategy((P, R, P), P))
    return strategies


@register_rule(aten.index_copy.default)
def _index_copy(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``self.index_copy(dim, index, source)``: rows ``index`` of ``self`` along ``dim`` become ``source``.

    A dim other than ``dim`` may be split in ``self``, ``source`` and the output alike (a KV cache
    written at new positions, split by heads); the 1-D index is whole on every rank. Both Partial
    gives Partial (the same positions are overwritten on every rank).
    """
    self_node, _, source = tensor_inputs(node)
    out_shape, src_shape = shape(node), shape(source)
    dim = norm_dim(node.args[1], len(out_shape))
    strategies = [Strategy((P, R, P), P)] if is_float(self_node) else []
    for d, size in enumerate(out_shape):
        if d != dim and size > 1 and len(src_shape) == len(out_shape) and src_shape[d] == size:
            strategies.append(Strategy((Shard(d), R, Shard(d)), Shard(d)))
    return strategies


@register_rule(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``self[i0, i1] = values`` (or ``+=`` with ``accumulate``), out of place.

    A dim of ``self`` that no index tensor addresses keeps its split, and ``values`` (broadcast to
    the indexed region ``x[indices]``, :func:`_indexed_region`) is split alike: a KV cache
    ``cache[:, :, positions] = keys`` split by heads. Both Partial gives Partial: the written
    positions are the same on every rank.
    """
    inputs = tensor_inputs(node)
    self_node, values = inputs[0], inputs[-1]
    indices = list(node.args[1])
    index_nodes = [i for i in indices if isinstance(i, fx.Node)]
    if any(not is_tensor(i) or val(i).dtype in (torch.bool, torch.uint8) for i in index_nodes):
        return []
    idx_r = tuple(R for _ in index_nodes)
    strategies: list[Strategy] = []
    if is_float(self_node):
        strategies.append(Strategy((P, *idx_r, P), P))
    present = [d for d, i in enumerate(indices) if i is not None]
    if not present:
        return strategies
    self_shape, v_shape = shape(self_node), shape(values)
    _, rest, region_ndim = _indexed_region(len(self_shape), present, len(_broadcast_shape([shape(i) for i in index_nodes])))
    for d, region_dim in rest.items():
        if self_shape[d] <= 1:
            continue
        vd = region_dim - (region_ndim - len(v_shape))  # values broadcast to the region from the right
        v_place: Placement = Shard(vd) if vd >= 0 and v_shape[vd] > 1 else R
        strategies.append(Strategy((Shard(d), *idx_r, v_place), Shard(d)))
    return strategies


@register_rule(aten.slice_scatter.default, aten.select_scatter.default)
def _slice_scatter(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``out = self; out[..., a:b, ...] = src`` along one dim: the other dims keep their split."""
    self_node, src = tensor_inputs(node)[:2]
    out_shape = shape(self_node)
    dim = norm_dim(arg(node, 2, "dim", 0), len(out_shape))  # type: ignore[arg-type]
    strategies = [Strategy((P, P), P)] if is_float(self_node) else []
    for d, size in enumerate(out_shape):
        if d == dim or size <= 1:
            continue
        sd = d - (d > dim) if node.target is aten.select_scatter.default else d
        strategies.append(Strategy((Shard(d), Shard(sd)), Shard(d)))
    return strategies


@register_rule(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
               aten.kthvalue.default, aten.cummax.default, aten.cummin.default)
def _along_one_dim(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that look along one dim (top-k, sort): every other dim keeps its split."""
    x_shape = shape(tensor_inputs(node)[0])
    if node.target in (aten.topk.default, aten.kthvalue.default):  # topk(x, k, dim), kthvalue(x, k, dim)
        dim = arg(node, 2, "dim", -1)
    elif node.target in (aten.sort.stable, aten.argsort.stable):  # dim is keyword-only
        dim = node.kwargs.get("dim", -1)
    else:
        dim = arg(node, 1, "dim", -1)
    dim = norm_dim(dim, len(x_shape))  # type: ignore[arg-type]
    return [Strategy((Shard(d),), Shard(d)) for d, size in enumerate(x_shape) if d != dim and size > 1]


@register_rule(aten.one_hot.default)
def _one_hot(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``one_hot(x, C)`` appends a class dim: the dims of ``x`` keep their split."""
    ndim = len(shape(tensor_inputs(node)[0]))
    return dim_map_rule(node, {d: d for d in range(ndim)})[1:]  # no Partial: integer output


@register_rule(aten.histc.default)
def _histc(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A histogram over a fixed range (``min < max``) of a split tensor is the sum of the ranks' histograms."""
    low = arg(node, 2, "min", 0)
    high = arg(node, 3, "max", 0)
    if not low < high:  # type: ignore[operator]
        return []  # min == max: the range comes from the data, which differs per rank
    return [Strategy((Shard(d),), P) for d, size in enumerate(shape(tensor_inputs(node)[0])) if size > 1]
