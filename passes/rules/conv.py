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
  group boundaries. Fewer channels or groups than ranks leave some ranks none: their local form
  runs on one zero channel (:mod:`autotp.passes.rules.empty`).

Batch norm in eval mode and pooling act per channel: channels and batch keep their split (a rank
with no channels pools or normalises one zero channel, cut off after).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Placement, Shard, split_of
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, is_float, shape, tensor_inputs
from autotp.passes.rules.builders import P, R
from autotp.passes.rules.empty import cut_to_empty, empty_dim, pad_with_zeros
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
        if c_out > 1:
            strategies.append(with_bias(R, Shard(0), Shard(0), Shard(out_channel)))
        if c_in > 1:
            strategies.append(with_bias(Shard(channel), Shard(1), P, P))
    elif min(c_in, c_out) == groups:
        strategies.append(with_bias(Shard(channel), Shard(0), Shard(0), Shard(out_channel)))
    return strategies


@register_local_form(*(op for op, (_, transposed) in _CONV_OPS.items() if not transposed))
def _local_convolution(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """This rank's part of a split convolution.

    A grouped convolution split by whole groups runs this rank's groups: ``groups`` becomes the local
    count. A rank with no output channels (or groups) runs one zero filter and cuts its channel off;
    one with no input channels runs one zero channel, so its Partial output keeps its shape
    (:mod:`autotp.passes.rules.empty`: the kernels refuse an empty channel dim).
    """
    index = _CONV_OPS[node.target][0]
    groups = arg(node, index, "groups", 1)
    weight, x = node.args[1], node.args[0]
    w_ndim, x_ndim = weight.meta["val"].dim(), x.meta["val"].dim()  # type: ignore[union-attr]
    channel = x_ndim - (w_ndim - 2) - 1  # 1 for (N, C, ...), 0 for an unbatched (C, ...)
    if strategy.inputs[1] == Shard(1) and empty_dim(builder, weight, Shard(1)) is not None:  # type: ignore[arg-type]
        padded = (pad_with_zeros(builder, args[0], channel, x_ndim), pad_with_zeros(builder, args[1], 1, w_ndim))
        return builder.graph.call_function(node.target, (*padded, *args[2:]), kwargs)
    if strategy.inputs[1] != Shard(0) or split_of(strategy.output) is None:
        return None
    if empty_dim(builder, weight, Shard(0)) is not None:  # type: ignore[arg-type]
        return _no_output_channels(builder, node, args, kwargs, groups, channel)  # type: ignore[arg-type]
    if groups == 1:
        return None
    out_channels = int(weight.meta["val"].shape[0])  # type: ignore[union-attr]
    local_out = builder.parts.local(weight.name, 0, builder.rank)[1]  # type: ignore[union-attr]
    local_groups = groups * local_out // out_channels  # type: ignore[operator]
    return builder.graph.call_function(node.target, *_with_groups(node, args, kwargs, local_groups))


def _with_groups(node: fx.Node, args: tuple, kwargs: dict, groups: int) -> tuple[tuple, dict]:
    """A convolution's ``(args, kwargs)`` with ``groups`` set."""
    index = _CONV_OPS[node.target][0]
    if len(args) > index:
        return (*args[:index], groups, *args[index + 1:]), kwargs
    return args, {**kwargs, "groups": groups}


def _no_output_channels(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, groups: int,
                        channel: int) -> fx.Node:
    """A convolution on a rank with no output channels: one zero filter (over one group's worth of zero
    input channels when grouped, as this rank holds no input channels either), its channel then cut off."""
    weight, x = node.args[1], node.args[0]
    w_ndim, x_ndim = weight.meta["val"].dim(), x.meta["val"].dim()  # type: ignore[union-attr]
    x_local, w_local = args[0], pad_with_zeros(builder, args[1], 0, w_ndim)
    if groups != 1:
        x_local = pad_with_zeros(builder, x_local, channel, x_ndim, int(weight.meta["val"].shape[1]))  # type: ignore[union-attr]
    rest = list(args[2:])
    if rest and rest[0] is not None:
        rest[0] = pad_with_zeros(builder, rest[0], 0, 1)
    if kwargs.get("bias") is not None:
        kwargs = {**kwargs, "bias": pad_with_zeros(builder, kwargs["bias"], 0, 1)}
    padded_args, padded_kwargs = (x_local, w_local, *rest), kwargs
    if groups != 1:
        padded_args, padded_kwargs = _with_groups(node, padded_args, padded_kwargs, 1)
    out = builder.graph.call_function(node.target, padded_args, padded_kwargs)
    out_channel = node.meta["val"].dim() - (w_ndim - 2) - 1
    return cut_to_empty(builder, out, node, out_channel)


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



@register_local_form(aten.batch_norm.default)
def _local_batch_norm(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A rank with no channels normalises one zero channel and cuts it off (batch statistics of no
    channels fail in the kernel; :mod:`autotp.passes.rules.empty`)."""
    x = node.args[0]
    if strategy.output != Shard(1) or empty_dim(builder, x, Shard(1)) is None:  # type: ignore[arg-type]
        return None
    ndim = x.meta["val"].dim()  # type: ignore[union-attr]
    padded = [pad_with_zeros(builder, args[0], 1, ndim)]
    padded += [a if a is None else pad_with_zeros(builder, a, 0, 1) for a in args[1:5]]
    out = builder.graph.call_function(node.target, (*padded, *args[5:]), kwargs)
    return cut_to_empty(builder, out, node, 1)


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



@register_local_form(*_POOLS)
def _local_pool(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A rank with no channels (or batch rows) pools one zero entry and cuts it off: max pooling and
    upsampling refuse an empty channel dim (:mod:`autotp.passes.rules.empty`)."""
    x = node.args[0]
    dim = empty_dim(builder, x, strategy.inputs[0])  # type: ignore[arg-type]
    if dim is None:
        return None
    out = builder.graph.call_function(node.target, (pad_with_zeros(builder, args[0], dim, x.meta["val"].dim()),  # type: ignore[union-attr]
                                                    *args[1:]), kwargs)
    return cut_to_empty(builder, out, node, dim)


@register_rule(aten.group_norm.default, aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def _batch_only(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Ops that mix channels (group norm's groups, pixel shuffle): only the batch dim may be split."""
    inputs = tensor_inputs(node)
    x_shape = shape(inputs[0])
    if len(x_shape) < 3 or x_shape[0] <= 1:
        return []
    return [Strategy((Shard(0), *(R for _ in inputs[1:])), Shard(0))]
