"""Sharding rules for convolutional networks: convolution, batch norm, pooling, upsampling.

Convolution is a GEMM over channels with a spatial stencil, so it splits like one (the
spatial dims are never split: a stencil at a cut would need its neighbours' rows, a halo
exchange autotp does not do):

- output channels (``weight S(0)``, bias ``S(0)``, input whole) -> output ``S(channel)``;
- input channels (``input S(channel)``, ``weight S(1)``) -> ``Partial``, bias added on one rank;
- batch (``input S(0)``) -> output ``S(0)``;
- grouped convolution (``groups > 1``): channels split by whole groups, input and output
  together (each rank convolves its groups); the rewrite passes each rank its local group
  count. Offered when one side has exactly one channel per group (depthwise and its
  channel-multiplier form), so that the proportional cut of ``passes/uneven.py`` falls on
  group boundaries, and when every rank gets at least one group.

Batch norm in eval mode and pooling act per channel: channels and batch keep their split.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Placement, Shard, split_of
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, is_float, shape, tensor_inputs
from autotp.passes.rules.builders import P, R
from autotp.passes.rules.registry import LocalGraph, RuleContext, register_local_form, register_rule

aten = torch.ops.aten

__all__: list[str] = []

_CONV_OPS = {  # op -> (index of ``groups``, weight is transposed (in_channels first))
    aten.conv1d.default: (6, False), aten.conv2d.default: (6, False), aten.conv3d.default: (6, False),
    aten.conv1d.padding: (6, False), aten.conv2d.padding: (6, False), aten.conv3d.padding: (6, False),
    aten.convolution.default: (8, None), aten.conv_transpose1d.default: (6, True),
    aten.conv_transpose2d.input: (6, True), aten.conv_transpose3d.input: (6, True),
}


@register_rule(*_CONV_OPS)
def _convolution(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Split a convolution over output channels, input channels (-> Partial) or batch (module doc)."""
    inputs = tensor_inputs(node)
    x, weight = inputs[0], inputs[1]
    has_bias = len(inputs) > 2
    groups_index, transposed = _CONV_OPS[node.target]
    if transposed is None:
        transposed = bool(arg(node, 6, "transposed", False))
    groups = int(arg(node, groups_index, "groups", 1))  # type: ignore[call-overload]
    x_shape, w_shape = shape(x), shape(weight)
    spatial = len(w_shape) - 2
    channel = len(x_shape) - spatial - 1  # 1 for (N, C, ...), 0 for an unbatched (C, ...)
    out_channel = len(shape(node)) - spatial - 1
    c_in = x_shape[channel]
    c_out = shape(node)[out_channel]

    def with_bias(x_p: Placement, w_p: Placement, bias_p: Placement, out: Placement) -> Strategy:
        return Strategy((x_p, w_p, bias_p) if has_bias else (x_p, w_p), out)

    strategies = [with_bias(P, R, P, P)]
    for d in range(channel):
        if x_shape[d] > 1:
            strategies.append(with_bias(Shard(d), R, R, Shard(d)))
    if transposed:
        return strategies  # weight (in, out / groups, ...): batch and Partial only
    if groups == 1:
        if c_out >= ctx.world_size:
            strategies.append(with_bias(R, Shard(0), Shard(0), Shard(out_channel)))
        if c_in >= ctx.world_size:
            strategies.append(with_bias(Shard(channel), Shard(1), P, P))
    elif groups >= ctx.world_size and min(c_in, c_out) == groups:
        strategies.append(with_bias(Shard(channel), Shard(0), Shard(0), Shard(out_channel)))
    return strategies


@register_local_form(*(op for op, (_, transposed) in _CONV_OPS.items() if not transposed))
def _local_convolution(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A grouped convolution split by whole groups runs this rank's groups: ``groups`` becomes the local count."""
    index = _CONV_OPS[node.target][0]
    groups = arg(node, index, "groups", 1)
    if groups == 1 or split_of(strategy.output) is None or strategy.inputs[1] != Shard(0):
        return None
    weight = node.args[1]
    out_channels = int(weight.meta["val"].shape[0])
    local_out = builder.parts.local(weight.name, 0, builder.rank)[1]
    local_groups = groups * local_out // out_channels  # type: ignore[operator]
    if len(args) > index:
        args = (*args[:index], local_groups, *args[index + 1:])
    else:
        kwargs = {**kwargs, "groups": local_groups}
    return builder.graph.call_function(node.target, args, kwargs)


@register_rule(aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)
def _batch_norm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Per-channel affine map with running statistics (eval mode): channels or batch may be split.

    With ``training=True`` the statistics come from the batch itself, so only channels may be split.
    """
    inputs = tensor_inputs(node)
    x_shape = shape(inputs[0])
    training = node.target is aten.batch_norm.default and bool(arg(node, 5, "training", False))
    per_channel = tuple(Shard(0) for _ in inputs[1:])
    whole = tuple(R for _ in inputs[1:])
    strategies = []
    if len(x_shape) > 1 and x_shape[1] > 1:
        strategies.append(Strategy((Shard(1), *per_channel), Shard(1)))
    if not training:
        strategies += [Strategy((Shard(d), *whole), Shard(d)) for d in range(len(x_shape)) if d != 1 and x_shape[d] > 1]
    return strategies


_POOLS = {  # op -> (spatial dims, linear)
    aten.max_pool1d.default: (1, False), aten.max_pool2d.default: (2, False), aten.max_pool3d.default: (3, False),
    aten.max_pool2d_with_indices.default: (2, False), aten.max_pool3d_with_indices.default: (3, False),
    aten.avg_pool1d.default: (1, True), aten.avg_pool2d.default: (2, True), aten.avg_pool3d.default: (3, True),
    aten.adaptive_avg_pool1d.default: (1, True), aten.adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool2d.default: (2, True), aten.adaptive_avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool3d.default: (3, True), aten.adaptive_max_pool1d.default: (1, False),
    aten.adaptive_max_pool2d.default: (2, False), aten.upsample_nearest2d.vec: (2, True),
    aten.upsample_bilinear2d.vec: (2, True), aten.upsample_nearest1d.vec: (1, True),
}


@register_rule(*_POOLS)
def _pool(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Pooling and resizing act on the trailing spatial dims: batch and channels keep their split."""
    spatial, linear = _POOLS[node.target]
    x_shape = shape(tensor_inputs(node)[0])
    strategies = [Strategy((Shard(d),), Shard(d)) for d in range(len(x_shape) - spatial) if x_shape[d] > 1]
    if linear and is_float(node):
        strategies.append(Strategy((P,), P))
    return strategies


@register_rule(aten.group_norm.default, aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def _batch_only(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that mix channels (group norm's groups, pixel shuffle): only the batch dim may be split."""
    inputs = tensor_inputs(node)
    x_shape = shape(inputs[0])
    if len(x_shape) < 3 or x_shape[0] <= 1:
        return []
    return [Strategy((Shard(0), *(R for _ in inputs[1:])), Shard(0))]
