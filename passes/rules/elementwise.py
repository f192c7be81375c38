"""Elementwise ops and tensors made from constants.

An elementwise op may be split on any output dim of size > 1; its inputs follow by
broadcasting. A ``Partial`` sum passes through only where the op is linear in that input:
every input for ``add``/``sub`` (of tensors, or with a scalar 0), one input for ``mul``, the
numerator for ``div``; never through a nonlinear op. Identity-like ops (copies, casts, eval
dropout) also keep a ``BlockShard``. Factories (``arange``, ``zeros``...) are computed whole
on every rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, is_float, shape, tensor_inputs, val
from autotp.passes.rules.builders import P, R, broadcast_placement, fitting_blocks
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


def _elementwise(node: fx.Node, ctx: RuleContext, partial_mode: str | None) -> list[Strategy]:
    """Shard any output dim of size > 1 (inputs follow by broadcasting).

    ``partial_mode`` says how ``Partial`` may flow through: ``"all"`` (every tensor input P,
    e.g. add), ``"one"`` (one input P, the others R, e.g. mul), ``"first"`` (only the first
    input P, e.g. div), or ``None`` (not linear).
    """
    inputs = tensor_inputs(node)
    out_shape = shape(node)
    strategies = []
    for dim, size in enumerate(out_shape):
        if size > 1:
            strategies.append(Strategy(tuple(broadcast_placement(i, len(out_shape), dim) for i in inputs), Shard(dim)))
    if partial_mode and is_float(node) and inputs:
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
    aten.isfinite.default, aten.nan_to_num.default, aten.signbit.default, aten.fill.Tensor, aten.fill.Scalar, aten.copy.default,
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
    dropout = node.target in (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default)
    if dropout and arg(node, 2, "train", False) and not ctx.split_random:
        return []  # random masks differ per rank: keep replicated (dropout="split": per-rank streams)
    inputs = tensor_inputs(node)
    strategies = _elementwise(node, ctx, None)
    if len(inputs) == 1 and shape(inputs[0]) == shape(node):
        for dim, size in enumerate(shape(node)):
            for k in fitting_blocks(size, ctx.block_counts):
                strategies.append(Strategy((BlockShard(dim, k),), BlockShard(dim, k)))
    if is_float(node):
        src = val(inputs[0]) if inputs else None
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


@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
               aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
               aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
               aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
               aten.sym_size.int, aten.item.default)
def _factory(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Tensors made from constants are computed whole on every rank (cheap, no communication)."""
    return []
