"""Sharding rules: for one ATen op, the placements its inputs and output may take.

One table (:data:`RULES`) maps an op overload to a rule; a rule is a pure function
``rule(node, ctx) -> list[Strategy]`` that reads only ``node.meta["val"]`` shapes and
the node's arguments. Rules know ops, never models: no module names, no model classes.

A :class:`Strategy` lists one placement per *tensor input slot* of the node (the fx.Node
arguments in the order :func:`tensor_inputs` yields them) and one placement for the output
(for ops returning several tensors, e.g. ``split``, it applies to every output).

On a one-axis mesh every ``Shard`` placement in one strategy is the *same* split of the work:
the rewrite gives all of them one partition (``passes/uneven.py``), so e.g. the ``k`` dim
of both GEMM operands is cut at the same boundaries.

Every op also has the all-``Replicate`` strategy, so the solver always has a correct choice.
An op missing from the table gets only that one, and the plan reports it as a fallback.

Keys of the table are op overloads (``aten.mm.default``) or, for ops of libraries that may not
be imported (custom ops such as ``transformers::grouped_mm_fallback``), the overload's
qualified name. Families of rules live in sibling modules that register into this one table:
``rules_indexing`` (gather/scatter/index/top-k/sort), ``rules_conv`` (convolution, pooling,
batch norm), ``rules_grouped_mm`` (grouped GEMMs of mixture-of-experts layers).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import BlockShard, Partial, Placement, Replicate, Shard
from autotp.base.shapes import concrete_shape

aten = torch.ops.aten

__all__ = [
    "RULES", "RuleContext", "Strategy", "block_counts", "has_rule", "holds_tensor", "register_rule", "rule_for",
    "strategies_for",
    "tensor_inputs", "view_groups",
]

R = Replicate()
P = Partial()


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run a node: a placement per tensor input slot and one for the output."""

    inputs: tuple[Placement, ...]
    output: Placement

    def __str__(self) -> str:
        ins = ", ".join(str(p) for p in self.inputs)
        return f"({ins}) -> {self.output}"


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule may know beyond the node: the mesh axis size and the graph's block counts.

    ``block_counts``: the k of every equal k-way ``split``/``chunk`` in the graph; GEMMs and
    views offer ``BlockShard(d, k)`` for these k only (fused projections split per block).
    """

    world_size: int
    block_counts: frozenset[int] = frozenset()


Rule = Callable[[fx.Node, RuleContext], list[Strategy]]
RULES: dict[object, Rule] = {}


def register_rule(*ops: object) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule`` for each op overload (or qualified op name, ``"ns::op"``) in ``ops``."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule

    return wrap


def rule_for(target: object) -> Rule | None:
    """The rule of an op overload: registered by overload, else by its qualified name."""
    rule = RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = RULES.get(target.name())
    return rule


def has_rule(node: fx.Node) -> bool:
    """True when ``node`` is covered by a sharding rule (placeholders and outputs always are)."""
    return node.op in ("placeholder", "output") or rule_for(node.target) is not None


def holds_tensor(node: fx.Node) -> bool:
    """True unless ``node`` computes a scalar (a symbolic size ``sym_size``, ``s0 * 4``, an assert):
    such nodes are no input slots, they carry no placement."""
    val = node.meta.get("val")
    if val is None and "val" not in node.meta:
        return True
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(val))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued fx.Node arguments, flattened in (args, kwargs) order: its input slots."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and holds_tensor(a)]


def _equal_split_count(node: fx.Node) -> tuple[int, int] | None:
    """``(dim, k)`` when ``node`` splits a tensor into k > 1 equal pieces along ``dim``."""
    if node.op != "call_function" or node.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    src = tensor_inputs(node)[0]
    shape = _shape(src)
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(shape))
    size = shape[dim]
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
    found = (_equal_split_count(n) for n in gm.graph.nodes)
    return frozenset(f[1] for f in found if f is not None)


def _val(node: fx.Node) -> object:
    return node.meta.get("val")


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = _val(node)
    if isinstance(val, torch.Tensor):
        return concrete_shape(val)  # example sizes where dims are symbolic
    return ()


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _replicated(node: fx.Node) -> Strategy:
    return Strategy(tuple(R for _ in tensor_inputs(node)), R)


def strategies_for(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """All candidate strategies of ``node``; the all-replicate one is always first."""
    base = _replicated(node)
    rule = rule_for(node.target) if node.op == "call_function" else None
    found = rule(node, ctx) if rule is not None else []
    unique = [base]
    for strategy in found:
        if len(strategy.inputs) != len(base.inputs):
            raise AssertionError(f"rule for {node.target} returned {len(strategy.inputs)} input placements, expected {len(base.inputs)}")
        if strategy not in unique:
            unique.append(strategy)
    return unique


# --------------------------------------------------------------------------- elementwise

def _broadcast_placement(inp: fx.Node, out_ndim: int, out_dim: int) -> Placement:
    """Placement of a broadcast input when the output is sharded on ``out_dim``."""
    if not _is_tensor(inp):
        return R
    shape = _shape(inp)
    in_dim = out_dim - (out_ndim - len(shape))
    if in_dim < 0 or shape[in_dim] == 1:
        return R
    return Shard(in_dim)


def _elementwise(node: fx.Node, ctx: RuleContext, partial_mode: str | None) -> list[Strategy]:
    """Shard any output dim of size > 1 (inputs follow by broadcasting).

    ``partial_mode`` says how ``Partial`` may flow through: ``"all"`` (every tensor input P,
    e.g. add), ``"one"`` (one input P, the others R, e.g. mul), ``"first"`` (only the first
    input P, e.g. div), or ``None`` (not linear).
    """
    inputs = tensor_inputs(node)
    out_shape = _shape(node)
    strategies = []
    for dim, size in enumerate(out_shape):
        if size > 1:
            strategies.append(Strategy(tuple(_broadcast_placement(i, len(out_shape), dim) for i in inputs), Shard(dim)))
    float_out = isinstance(_val(node), torch.Tensor) and _val(node).is_floating_point()
    if partial_mode and float_out and inputs:
        if partial_mode == "all":
            strategies.append(Strategy(tuple(P for _ in inputs), P))
        elif partial_mode == "one":
            for k in range(len(inputs)):
                strategies.append(Strategy(tuple(P if j == k else R for j in range(len(inputs))), P))
        elif partial_mode == "first":
            strategies.append(Strategy(tuple(P if j == 0 else R for j in range(len(inputs))), P))
    return strategies


def _scalar_args_are_zero(node: fx.Node) -> bool:
    """add/sub with a Python scalar is linear only when the scalar is 0 (else it is added N times)."""
    scalars = [a for a in node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    alpha = node.kwargs.get("alpha", 1)
    return all(s == 0 for s in scalars) and alpha is not None


_NONLINEAR_ELEMENTWISE = [
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.rsqrt.default, aten.sqrt.default, aten.exp.default,
    aten.log.default, aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default,
    aten.sigmoid.default, aten.sin.default, aten.cos.default, aten.erf.default, aten.abs.default,
    aten.reciprocal.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor,
    aten.le.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor,
    aten.gt.Scalar, aten.__and__.Tensor, aten.__or__.Tensor, aten.logical_and.default, aten.logical_or.default,
    aten.logical_not.default, aten.bitwise_not.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.minimum.default,
    aten.maximum.default, aten.clamp.default, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar,
    aten.softplus.default, aten.hardtanh.default, aten.leaky_relu.default, aten.gelu_.default,
    aten.relu_.default, aten.silu_.default, aten.pow.Scalar, aten.isnan.default, aten.isinf.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.round.default, aten.triu.default, aten.tril.default, aten.floor_divide.default, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.fmod.Scalar, aten.fmod.Tensor, aten.bitwise_xor.Tensor, aten.logical_xor.default,
    aten.trunc.default, aten.log1p.default, aten.expm1.default, aten.exp2.default, aten.log2.default,
    aten.atan.default, aten.sinh.default, aten.cosh.default, aten.asin.default, aten.acos.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.clamp.Tensor, aten.elu.default, aten.selu.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default, aten.logit.default, aten.erfinv.default,
    aten.relu6.default, aten.square.default, aten.greater.Scalar, aten.greater_equal.Scalar, aten.less.Scalar, aten.less_equal.Scalar, aten.not_equal.Scalar,
    aten.isfinite.default, aten.nan_to_num.default, aten.signbit.default, aten.fill.Tensor, aten.fill.Scalar,
    aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.lerp.Scalar, aten.lerp.Tensor, aten.addcmul.default,
    aten.addcdiv.default, aten.copysign.Tensor, aten.atan2.default, aten.xlogy.Tensor, aten.hypot.default,
]
_IDENTITY_LIKE = [
    aten.alias.default, aten.clone.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten._to_copy.default, aten.detach.default, aten.lift_fresh_copy.default,
    aten.neg.default, aten.type_as.default, aten.dropout.default, aten.native_dropout.default,
    aten.feature_dropout.default, aten.lift_fresh.default, aten.positive.default,
]


@register_rule(*_NONLINEAR_ELEMENTWISE)
def _nonlinear_elementwise(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    return _elementwise(node, ctx, None)


@register_rule(*_IDENTITY_LIKE)
def _identity_like(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    if node.target in (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default):
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
        if train:
            return []  # random masks differ per rank: keep replicated
    inputs = tensor_inputs(node)
    strategies = _elementwise(node, ctx, None)
    if len(inputs) == 1 and _shape(inputs[0]) == _shape(node):
        for dim, size in enumerate(_shape(node)):
            for k in sorted(ctx.block_counts):
                if size % k == 0 and size // k > 1:
                    strategies.append(Strategy((BlockShard(dim, k),), BlockShard(dim, k)))
    if isinstance(_val(node), torch.Tensor) and _val(node).is_floating_point():
        src = _val(inputs[0]) if inputs else None
        if isinstance(src, torch.Tensor) and src.is_floating_point():
            strategies.append(Strategy(tuple(P if j == 0 else R for j in range(len(inputs))), P))
    return strategies


@register_rule(aten.add.Tensor, aten.sub.Tensor)
def _add(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    tensor_args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    linear = len(tensor_args) == 2 or _scalar_args_are_zero(node)
    return _elementwise(node, ctx, "all" if linear else None)


@register_rule(aten.mul.Tensor, aten.mul.Scalar)
def _mul(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    return _elementwise(node, ctx, "one")


@register_rule(aten.div.Tensor, aten.div.Scalar)
def _div(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    return _elementwise(node, ctx, "first")


# --------------------------------------------------------------------------- shape ops

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


def _outermost(dims: list[int], shape: Sequence[int]) -> int | None:
    for d in dims:
        if shape[d] > 1:
            return d
    return None


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int)
def _view(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A sharded dim survives a reshape when it is the outermost dim of its group on both sides."""
    src = tensor_inputs(node)[0]
    in_shape, out_shape = _shape(src), _shape(node)
    strategies = [Strategy((P,), P)]
    for gi, gj in view_groups(in_shape, out_shape):
        a, c = _outermost(gi, in_shape), _outermost(gj, out_shape)
        if a is not None and c is not None:
            strategies.append(Strategy((Shard(a),), Shard(c)))
            if in_shape[a] == out_shape[c]:  # the dim is carried over whole: its blocks too
                for k in sorted(ctx.block_counts):
                    if in_shape[a] % k == 0 and in_shape[a] // k > 1:
                        strategies.append(Strategy((BlockShard(a, k),), BlockShard(c, k)))
    return strategies


def _dim_map_rule(node: fx.Node, out_to_in: dict[int, int], blocks: frozenset[int] = frozenset()) -> list[Strategy]:
    """Rule for ops that move dims around: output dim d holds input dim ``out_to_in[d]``.

    A dim carried over whole keeps its ``BlockShard(d, k)`` too, for each k in ``blocks``.
    """
    n_inputs = len(tensor_inputs(node))
    rest = tuple(R for _ in range(n_inputs - 1))
    in_shape, out_shape = _shape(tensor_inputs(node)[0]), _shape(node)
    strategies = [Strategy((P, *rest), P)]
    for out_dim, in_dim in out_to_in.items():
        if out_shape[out_dim] > 1 and in_shape[in_dim] == out_shape[out_dim]:
            strategies.append(Strategy((Shard(in_dim), *rest), Shard(out_dim)))
            for k in sorted(blocks):
                if in_shape[in_dim] % k == 0 and in_shape[in_dim] // k > 1:
                    strategies.append(Strategy((BlockShard(in_dim, k), *rest), BlockShard(out_dim, k)))
    return strategies


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@register_rule(aten.transpose.int)
def _transpose(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(_shape(node))
    a, b = _norm_dim(node.args[1], ndim), _norm_dim(node.args[2], ndim)
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return _dim_map_rule(node, dict(enumerate(perm)), ctx.block_counts)


@register_rule(aten.t.default)
def _t(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(_shape(node))
    return _dim_map_rule(node, dict(enumerate(reversed(range(ndim)))) if ndim == 2 else {0: 0}, ctx.block_counts)


@register_rule(aten.permute.default)
def _permute(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(_shape(node))
    perm = [_norm_dim(d, ndim) for d in node.args[1]]
    return _dim_map_rule(node, dict(enumerate(perm)), ctx.block_counts)


@register_rule(aten.unsqueeze.default)
def _unsqueeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = len(_shape(node))
    new = _norm_dim(node.args[1], ndim)
    return _dim_map_rule(node, {d: d - (d > new) for d in range(ndim) if d != new}, ctx.block_counts)


@register_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape = _shape(tensor_inputs(node)[0])
    if node.target is aten.squeeze.default:
        removed = {d for d, s in enumerate(in_shape) if s == 1}
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        removed = {_norm_dim(d, len(in_shape)) for d in dims if in_shape[_norm_dim(d, len(in_shape))] == 1}
    kept = [d for d in range(len(in_shape)) if d not in removed]
    return _dim_map_rule(node, dict(enumerate(kept)), ctx.block_counts)


@register_rule(aten.expand.default)
def _expand(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape, out_shape = _shape(tensor_inputs(node)[0]), _shape(node)
    lead = len(out_shape) - len(in_shape)
    mapping = {d: d - lead for d in range(lead, len(out_shape)) if in_shape[d - lead] == out_shape[d]}
    return _dim_map_rule(node, mapping, ctx.block_counts)


@register_rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def _slice(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Slicing along one dim keeps the split of every other dim."""
    in_shape = _shape(tensor_inputs(node)[0])
    cut = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(in_shape))
    out_ndim = len(_shape(node))
    if node.target is aten.select.int:
        mapping = {d - (d > cut): d for d in range(len(in_shape)) if d != cut}
    else:
        mapping = {d: d for d in range(out_ndim) if d != cut}
    return _dim_map_rule(node, mapping)


@register_rule(aten.cat.default)
def _cat(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    inputs = tensor_inputs(node)
    out_shape = _shape(node)
    cat_dim = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out_shape))
    strategies = [Strategy(tuple(P for _ in inputs), P)]
    for dim, size in enumerate(out_shape):
        if dim != cat_dim and size > 1 and all(len(_shape(i)) == len(out_shape) for i in inputs):
            strategies.append(Strategy(tuple(Shard(dim) for _ in inputs), Shard(dim)))
    return strategies


@register_rule(aten.stack.default)
def _stack(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Stacking along a new dim: every input dim keeps its split (shifted past the new dim)."""
    inputs = tensor_inputs(node)
    out_ndim = len(_shape(node))
    new = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out_ndim)
    strategies = [Strategy(tuple(P for _ in inputs), P)]
    for d, size in enumerate(_shape(inputs[0])):
        if size > 1:
            strategies.append(Strategy(tuple(Shard(d) for _ in inputs), Shard(d + (d >= new))))
    return strategies


@register_rule(aten.repeat.default)
def _repeat(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Tiling: a dim repeated once keeps its split (new leading dims and tiled dims are whole)."""
    in_shape = _shape(tensor_inputs(node)[0])
    repeats = list(node.args[1])
    lead = len(repeats) - len(in_shape)
    return _dim_map_rule(node, {d + lead: d for d in range(len(in_shape)) if repeats[d + lead] == 1})


@register_rule(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Each element repeated r times in place: every dim keeps its split, the repeated one too.

    A contiguous block of input rows ``[a, b)`` becomes output rows ``[a r, b r)``, so the
    repeated dim is cut at proportional points (what ``passes/uneven.py`` does).
    """
    in_shape, out_shape = _shape(tensor_inputs(node)[0]), _shape(node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    output_size = node.args[3] if len(node.args) > 3 else node.kwargs.get("output_size")
    if dim is None or len(in_shape) != len(out_shape):
        return []
    dim = _norm_dim(dim, len(in_shape))
    strategies = [Strategy((P,), P)]
    for d, size in enumerate(in_shape):
        if size > 1 and (d != dim or output_size is None):
            strategies.append(Strategy((Shard(d),), Shard(d)))
    return strategies


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    in_shape = _shape(tensor_inputs(node)[0])
    default_dim = 0
    dim_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", default_dim)
    if node.target is aten.unbind.int:
        dim_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    cut = _norm_dim(dim_arg, len(in_shape))
    strategies = [Strategy((P,), P)]
    for dim, size in enumerate(in_shape):
        if dim != cut and size > 1 and node.target is not aten.unbind.int:
            strategies.append(Strategy((Shard(dim),), Shard(dim)))
    equal = _equal_split_count(node)
    if equal is not None and in_shape[cut] // equal[1] > 1:
        # each of the k blocks is split across ranks: every piece comes out split on the same dim
        strategies.append(Strategy((BlockShard(cut, equal[1]),), Shard(cut)))
    return strategies


@register_rule(operator.getitem)
def _getitem(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Passes through the placement of the multi-output producer (dims of the item)."""
    ndim = len(_shape(node))
    return [Strategy((P,), P)] + [Strategy((Shard(d),), Shard(d)) for d in range(ndim)]


# --------------------------------------------------------------------------- reductions

def _reduced_dims(node: fx.Node, in_ndim: int) -> list[int]:
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(in_ndim))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(in_ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(_norm_dim(d, in_ndim) for d in dims)


def _keepdim(node: fx.Node) -> bool:
    if node.target in (aten.sum.default, aten.mean.default):
        return False
    if node.target in (aten.var.correction, aten.std.correction):
        return bool(node.kwargs.get("keepdim", False))
    if node.target in (aten.var.dim, aten.std.dim):  # var(input, dim, unbiased, keepdim)
        return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False))
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


@register_rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.sum.default,
               aten.mean.default, aten.var.correction, aten.std.correction, aten.any.dim, aten.all.dim,
               aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.logsumexp.default,
               aten.prod.dim_int, aten.any.dims, aten.all.dims, aten.var.dim, aten.std.dim)
def _reduction(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Sharded non-reduced dims stay sharded; a ``sum`` over a sharded dim gives Partial."""
    in_shape = _shape(tensor_inputs(node)[0])
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
    in_shape = _shape(inputs[0])
    if node.target is aten.flip.default:
        flipped = [_norm_dim(d, len(in_shape)) for d in node.args[1]]
        return _dim_map_rule(node, {d: d for d in range(len(in_shape)) if d not in flipped}, ctx.block_counts)
    dim_index = 2 if node.target is aten.diff.default else 1  # diff(input, n, dim, prepend, append)
    dim = _norm_dim(node.args[dim_index] if len(node.args) > dim_index else node.kwargs.get("dim", -1), len(in_shape))
    rest = tuple(R for _ in inputs[1:])
    strategies = []
    if node.target is aten.cumsum.default:
        strategies.append(Strategy((P, *rest), P))
    for d, size in enumerate(in_shape):
        if d != dim and size > 1:
            others = tuple(_broadcast_placement(i, len(in_shape), d) for i in inputs[1:])
            strategies.append(Strategy((Shard(d), *others), Shard(d)))
    return strategies


@register_rule(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default)
def _layer_norm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Normalisation over the trailing dims: only leading (token) dims may be split.

    (``native_layer_norm`` also returns mean and 1/std, shaped like the leading dims: split alike.)
    """
    inputs = tensor_inputs(node)
    in_shape = _shape(inputs[0])
    normalized = len(node.args[1])
    rest = tuple(R for _ in inputs[1:])
    return [Strategy((Shard(d), *rest), Shard(d)) for d in range(len(in_shape) - normalized) if in_shape[d] > 1]


# --------------------------------------------------------------------------- GEMMs

def _einsum_strategies(operands: list[str], output: str, shapes: list[tuple[int, ...]],
                       out_shape: tuple[int, ...], blocks: frozenset[int] = frozenset()) -> list[tuple[list[Placement], Placement]]:
    """DTensor-style GEMM rule from an einsum description (e.g. ``["mk", "kn"] -> "mn"``).

    For each index letter: if it appears in the output, split it everywhere it appears (the
    output is ``Shard``); if it is contracted, split it in every operand and the output is
    ``Partial``. A letter whose size is 1 anywhere is not split. Plus Partial in each operand
    passing through (the GEMM is linear in each operand). For a row or column letter (not a
    batch letter, see :func:`_batch_letters`) that only one operand has (e.g. the weight's
    output features) also ``BlockShard`` with each k in ``blocks``.
    """
    letters = sorted(set("".join(operands)), key=lambda c: ("".join(operands) + output).index(c))
    found = []
    for letter in letters:
        sizes = [shape[spec.index(letter)] for spec, shape in zip(operands, shapes) if letter in spec]
        if letter in output:
            sizes.append(out_shape[output.index(letter)])
        if min(sizes) <= 1:
            continue
        ins = [Shard(spec.index(letter)) if letter in spec else R for spec in operands]
        out = Shard(output.index(letter)) if letter in output else P
        found.append((ins, out))
        owners = [i for i, spec in enumerate(operands) if letter in spec]
        if letter in output and len(owners) == 1 and letter not in _BATCH_LETTERS:
            size = out_shape[output.index(letter)]
            for k in sorted(blocks):
                if size % k == 0 and size // k > 1:
                    owner = owners[0]
                    ins_k: list[Placement] = [R] * len(operands)
                    ins_k[owner] = BlockShard(operands[owner].index(letter), k)
                    found.append((ins_k, BlockShard(output.index(letter), k)))
    for k in range(len(operands)):
        found.append(([P if j == k else R for j in range(len(operands))], P))
    return found


_BATCH_LETTERS = "abcdefgh"


def _batch_letters(n: int) -> str:
    """Letters of the leading (batch) dims of a GEMM operand; rows, columns and sums use m, n, k."""
    return _BATCH_LETTERS[:n]


def _with_bias(found: list[tuple[list[Placement], Placement]], bias_spec: str | None, output: str,
               bias_first: bool) -> list[Strategy]:
    """Attach an additive bias input: it follows the output (R if broadcast, P if output is P)."""
    strategies = []
    for ins, out in found:
        if bias_spec is not None:
            if isinstance(out, Partial):
                bias: Placement = P
            elif isinstance(out, Shard) and output[out.dim] in bias_spec:
                bias = Shard(bias_spec.index(output[out.dim]))
            elif isinstance(out, BlockShard) and output[out.dim] in bias_spec:
                bias = BlockShard(bias_spec.index(output[out.dim]), out.blocks)
            else:
                bias = R
            ins = [bias, *ins] if bias_first else [*ins, bias]
        strategies.append(Strategy(tuple(ins), out))
    return strategies


@register_rule(aten.linear.default)
def _linear(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``y = x @ w.T + b``: x ``(..., k)``, w ``(n, k)``, b ``(n,)``."""
    inputs = tensor_inputs(node)
    x_shape, w_shape = _shape(inputs[0]), _shape(inputs[1])
    batch = _batch_letters(len(x_shape) - 1)
    found = _einsum_strategies([batch + "k", "nk"], batch + "n", [x_shape, w_shape], _shape(node), ctx.block_counts)
    return _with_bias(found, "n" if len(inputs) > 2 else None, batch + "n", bias_first=False)


@register_rule(aten.addmm.default)
def _addmm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``out = beta * bias + x @ w``: bias ``(n,)`` or ``(m, n)``, x ``(m, k)``, w ``(k, n)``."""
    inputs = tensor_inputs(node)
    bias_shape = _shape(inputs[0])
    found = _einsum_strategies(["mk", "kn"], "mn", [_shape(inputs[1]), _shape(inputs[2])], _shape(node), ctx.block_counts)
    bias_spec = "mn"[2 - len(bias_shape):] if bias_shape else ""
    strategies = _with_bias(found, bias_spec, "mn", bias_first=True)
    return [s for s in strategies if not (isinstance(s.inputs[0], (Shard, BlockShard)) and bias_shape[s.inputs[0].dim] == 1)]


@register_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``a @ b`` with equal batch dims, or one operand a plain matrix (``(..., m, k) @ (k, n)``)."""
    inputs = tensor_inputs(node)
    if len(inputs) != 2:
        return []
    a_shape, b_shape = _shape(inputs[0]), _shape(inputs[1])
    if len(a_shape) < 2 or len(b_shape) < 2:
        return []
    if len(a_shape) == len(b_shape) and a_shape[:-2] == b_shape[:-2]:
        batch = _batch_letters(len(a_shape) - 2)
        specs = [batch + "mk", batch + "kn"]
    elif len(b_shape) == 2:
        batch = _batch_letters(len(a_shape) - 2)
        specs = [batch + "mk", "kn"]
    elif len(a_shape) == 2:
        batch = _batch_letters(len(b_shape) - 2)
        specs = ["mk", batch + "kn"]
    else:
        return []  # broadcast batch dims: replicated
    found = _einsum_strategies(specs, batch + "mn", [a_shape, b_shape], _shape(node), ctx.block_counts)
    return _with_bias(found, None, batch + "mn", bias_first=False)


@register_rule(aten.einsum.default)
def _einsum(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``torch.einsum(equation, operands)`` with explicit output letters and no ``...`` or repeated letters."""
    equation = str(node.args[0]).replace(" ", "")
    operands = tensor_inputs(node)
    if "..." in equation or "->" not in equation:
        return []
    lhs, output = equation.split("->")
    specs = lhs.split(",")
    if len(specs) != len(operands) or any(len(set(spec)) != len(spec) for spec in specs):
        return []
    shapes = [_shape(op) for op in operands]
    if any(len(spec) != len(shape) for spec, shape in zip(specs, shapes)):
        return []
    for letter in set(lhs.replace(",", "")):  # a broadcast size-1 letter would be cut at different sizes
        if len({shape[spec.index(letter)] for spec, shape in zip(specs, shapes) if letter in spec}) > 1:
            return []
    found = _einsum_strategies(specs, output, shapes, _shape(node))
    return _with_bias(found, None, output, bias_first=False)


@register_rule(aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Attention is independent per batch element and per head; queries may also be split.

    q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``, optional mask broadcastable to ``(B, H, Sq, Sk)``.
    Splitting heads splits q heads and kv heads at the same fractions (grouped-query attention
    keeps each kv head with its query group).
    """
    if node.target is not aten.scaled_dot_product_attention.default:
        return []
    inputs = tensor_inputs(node)
    q_shape = _shape(inputs[0])
    if len(q_shape) != 4:
        return []
    mask = inputs[3] if len(inputs) > 3 else None
    strategies = []
    for dim, qkv in ((0, True), (1, True), (2, False)):
        placements: list[Placement] = []
        for index, inp in enumerate(inputs):
            shape = _shape(inp)
            if inp is mask:
                mdim = dim - (4 - len(shape))
                placements.append(Shard(mdim) if mdim >= 0 and shape[mdim] > 1 else R)
            elif index == 0 or qkv:
                placements.append(Shard(dim) if shape[dim] > 1 else R)
            else:
                placements.append(R)
        if q_shape[dim] > 1:
            strategies.append(Strategy(tuple(placements), Shard(dim)))
    return strategies


@register_rule(aten.embedding.default)
def _embedding(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Lookup rows of ``weight (V, H)``: split H (output last dim), the indices' dims, or the vocabulary.

    Vocabulary-parallel (``weight S(0) -> Partial``): each rank holds a range of rows, looks up
    the ids in its range and writes zeros for the others, so the ranks' outputs sum to the
    lookup. The rewrite localises the ids (``passes/rewrite.py``); offered when every rank can
    hold at least one row.
    """
    weight, indices = tensor_inputs(node)[:2]
    out_ndim = len(_shape(node))
    vocab, hidden = _shape(weight)
    strategies = []
    if hidden > 1:
        strategies.append(Strategy((Shard(1), R), Shard(out_ndim - 1)))
    if vocab >= ctx.world_size:
        strategies.append(Strategy((Shard(0), R), P))
    for d, size in enumerate(_shape(indices)):
        if size > 1:
            strategies.append(Strategy((R, Shard(d)), Shard(d)))
    return strategies


# --------------------------------------------------------------------------- factories

@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
               aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
               aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
               aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
               aten.sym_size.int, aten.item.default)
def _factory(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Tensors made from constants are computed whole on every rank (cheap, no communication)."""
    return []


# --------------------------------------------------------------------------- rule families in sibling modules

from autotp.passes import rules_conv, rules_grouped_mm, rules_indexing, rules_symbolic  # noqa: E402,F401 - they register into RULES
