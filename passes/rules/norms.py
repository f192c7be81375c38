"""Layer and RMS normalisation over the trailing dims: only the leading (token) dims may be split.

(Batch norm and group norm, which normalise per channel, sit with the convolutional family in
:mod:`autotp.passes.rules.conv`.)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import shape, tensor_inputs
from autotp.passes.rules.builders import R
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


@register_rule(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default)
def _layer_norm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Normalisation over the trailing dims: only leading (token) dims may be split.

    (``native_layer_norm`` also returns mean and 1/std, shaped like the leading dims: split alike.)
    """
    inputs = tensor_inputs(node)
    in_shape = shape(inputs[0])
    normalized = len(node.args[1])
    rest = tuple(R for _ in inputs[1:])
    return [Strategy((Shard(d), *rest), Shard(d)) for d in range(len(in_shape) - normalized) if in_shape[d] > 1]
