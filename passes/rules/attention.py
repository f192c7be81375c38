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
from autotp.passes.rules.empty import empty_dim
from autotp.passes.rules.registry import LocalGraph, RuleContext, register_local_form, register_rule

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


@register_local_form(aten.scaled_dot_product_attention.default)
def _local_sdpa(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node | None:
    """A rank with no heads (or no queries) of its own: its output ``(B, 0, Sq, Dv)`` is made by a matmul of the
    empty query with zeros ``(D, Dv)``, whatever kernel sdpa would pick: CPU's flash kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) dies of a division by zero on 0 heads or 0 queries
    (:mod:`autotp.passes.rules.empty`)."""
    if empty_dim(builder, node, strategy.output) is None:
        return None
    q, v = tensor_inputs(node)[0], tensor_inputs(node)[2]
    head_dim, value_dim = shape(q)[-1], shape(v)[-1]
    zeros = builder.call(aten.new_zeros.default, args[0], [head_dim, value_dim], meta_from=node)
    return builder.call(aten.matmul.default, args[0], zeros, meta_from=node)
