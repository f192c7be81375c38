"""Scaled dot-product attention: independent per batch element and per head.

Splitting heads splits query heads and key/value heads at the same fractions, so grouped-query
attention keeps each kv head with its query group (``passes/uneven.py`` cuts them together).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, shape, tensor_inputs
from autotp.passes.rules.builders import R
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


@register_rule(aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Attention is independent per batch element and per head; queries may also be split.

    q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``, optional mask broadcastable to ``(B, H, Sq, Sk)``.
    Splitting heads splits q heads and kv heads at the same fractions (grouped-query attention
    keeps each kv head with its query group).
    """
    if node.target is not aten.scaled_dot_product_attention.default:
        return []
    if arg(node, 4, "dropout_p", 0.0) != 0 and not ctx.split_random:
        return []  # random masks differ per rank: keep replicated, as dropout (rules/elementwise.py)
    inputs = tensor_inputs(node)
    q_shape = shape(inputs[0])
    if len(q_shape) != 4:
        return []
    mask = inputs[3] if len(inputs) > 3 else None
    strategies = []
    for dim, qkv in ((0, True), (1, True), (2, False)):
        placements: list[Placement] = []
        for index, inp in enumerate(inputs):
            inp_shape = shape(inp)
            if inp is mask:
                mdim = dim - (4 - len(inp_shape))
                placements.append(Shard(mdim) if mdim >= 0 and inp_shape[mdim] > 1 else R)
            elif index == 0 or qkv:
                placements.append(Shard(dim) if inp_shape[dim] > 1 else R)
            else:
                placements.append(R)
        if q_shape[dim] > 1:
            strategies.append(Strategy(tuple(placements), Shard(dim)))
    return strategies
