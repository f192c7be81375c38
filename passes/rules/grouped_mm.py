"""Sharding rules for grouped GEMMs: one matrix product per group of rows (mixture of experts).

``grouped_mm(x (S, K), w (E, K, N), offs (E,))``: the rows of ``x`` come sorted by group
(expert), ``offs`` holds the cumulative row count of each group, and rows ``offs[e-1]:offs[e]``
are multiplied by ``w[e]``. Tensor parallelism inside every expert, as Megatron-style MoE
layers do:

- ``N`` split (``w S(2)``, ``x`` whole) -> output ``S(1)``: column-parallel experts; with a
  fused gate/up projection that is later split into its two halves, ``BlockShard`` keeps each
  half split by rank;
- ``K`` split (``x S(1)``, ``w S(1)``) -> ``Partial``: row-parallel experts;
- ``x`` Partial passes through (the product is linear in ``x``).

The rows (tokens) are never split here: the group offsets are global row positions.

Ops covered: ``aten._grouped_mm`` and the custom op ``transformers::grouped_mm_fallback``
(registered by name, so this module imports without ``transformers``), which implement the
same product.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, shape, tensor_inputs
from autotp.passes.rules.builders import P, R, fitting_blocks
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []


@register_rule(aten._grouped_mm.default, "transformers::grouped_mm_fallback")
def _grouped_mm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x (S, K)`` times ``w (E, K, N)`` by row groups ``offs (E,)`` (module docstring)."""
    inputs = tensor_inputs(node)
    if len(inputs) != 3:
        return []  # no offsets (a batched product) or a bias: replicated
    x, w, offs = inputs
    if arg(node, 2, "offs") is not offs:
        return []  # the third tensor is a bias, not the offsets
    x_shape, w_shape = shape(x), shape(w)
    if len(x_shape) != 2 or len(w_shape) != 3:
        return []
    k, n = w_shape[1], w_shape[2]
    strategies = [Strategy((P, R, R), P)]
    if n > 1:
        strategies.append(Strategy((R, Shard(2), R), Shard(1)))
        for blocks in fitting_blocks(n, ctx.block_counts):
            w_p: Placement = BlockShard(2, blocks)
            strategies.append(Strategy((R, w_p, R), BlockShard(1, blocks)))
    if k > 1:
        strategies.append(Strategy((Shard(1), Shard(1), R), P))
    return strategies
