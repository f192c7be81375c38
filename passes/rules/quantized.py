"""Dequantization: torchao's ``dequantize_affine`` splits with its data, scales kept per block.

``torchao::dequantize_affine(input, block_size, scale, zero_point, ...)`` computes
``(input - zero_point) * scale`` where each ``scale``/``zero_point`` element covers one block of
``block_size`` elements of ``input`` (``scale.shape[d] == input.shape[d] / block_size[d]``): per-row
scales of ``(N, K)`` data have blocks ``(1, K)``, group-wise ones ``(1, g)``. The output has the
input's shape. Under ``Shard(d)`` of the input and the output:

- a dim the blocks span whole (``scale.shape[d] == 1``) keeps the scales and zero points whole;
- otherwise they are split along ``d`` too. The rewrite cuts every tensor of one split at the
  same fraction (``passes/uneven.py``: in ``gcd`` units of the sizes), and the scales' length is
  the number of blocks, so each rank holds whole blocks and ``block_size`` stays as traced.

Registered by name, so this module imports without torchao (IntxWeightOnlyConfig's int4 and
Int8WeightOnlyConfig's per-group weights dequantize with it).
"""

from __future__ import annotations

import torch.fx as fx

from autotp.base.placements import Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, shape, tensor_inputs
from autotp.passes.rules.builders import R
from autotp.passes.rules.registry import RuleContext, register_rule

__all__: list[str] = []


@register_rule("torchao::dequantize_affine")
def _dequantize_affine(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``input`` and output ``Shard(d)``; each scale / zero point ``Shard(d)`` or, spanning ``d`` whole, R."""
    inputs = tensor_inputs(node)
    data = arg(node, 0, "input")
    if not inputs or inputs[0] is not data:
        return []
    data_shape = shape(data)
    strategies = []
    for dim, size in enumerate(data_shape):
        if size <= 1:
            continue
        placements: list[Placement] = [Shard(dim)]
        for part in inputs[1:]:
            part_shape = shape(part)
            if len(part_shape) != len(data_shape) or size % max(part_shape[dim], 1):
                break  # not one scale per block along this dim: keep it replicated
            placements.append(R if part_shape[dim] == 1 else Shard(dim))
        else:
            strategies.append(Strategy(tuple(placements), Shard(dim)))
    return strategies
