"""Sharding rules for the size arithmetic of graphs with dynamic (symbolic) batch and sequence dims.

A graph exported with dynamic shapes reads sizes at run time: ``sym_size.int(x, 1)`` is the
sequence length of ``x``, and Python arithmetic on it (``operator.mul``, ``floordiv``, ...) or
runtime asserts (``_assert_scalar``) follow. These nodes compute scalars, not tensors: they are
no input slots of their consumers (:func:`autotp.passes.rules.args.holds_tensor`) and carry no
placement of their own (``Replicate``).

``sym_size.int(x, d)`` reads a dim that is never split (only static dims are split, see
:mod:`autotp.passes.strategies`), so it reads the right size from ``x`` under any placement:
its rule accepts every placement of ``x`` that leaves ``d`` whole, and no collective is ever
inserted to feed it. ``sym_numel`` would count only this rank's block of a split tensor, so it
needs ``x`` whole. Imported by :mod:`autotp.passes.rules`.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import shape, tensor_inputs
from autotp.passes.rules.builders import P, R, fitting_blocks
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__: list[str] = []

_SCALAR_OPS = (
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.neg,
    operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, math.ceil, math.floor, torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min,
    torch.sym_not, torch.sym_ite, aten.sym_numel.default, aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
)


@register_rule(*_SCALAR_OPS)
def _scalar(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Size arithmetic and asserts: replicated (the only strategy, which ``strategies_for`` always offers)."""
    return []


@register_rule(aten.sym_size.int)
def _sym_size(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``sym_size(x, d)``: any placement of ``x`` that keeps dim ``d`` whole (nothing moves)."""
    inputs = tensor_inputs(node)
    if len(inputs) != 1:
        return []
    sizes = shape(inputs[0])
    read = int(node.args[1]) % len(sizes) if sizes else 0  # type: ignore[arg-type]
    placements: list[Placement | BlockShard] = [P]
    for dim, size in enumerate(sizes):
        if dim != read and size > 1:
            placements.append(Shard(dim))
            placements += [BlockShard(dim, k) for k in fitting_blocks(size, ctx.block_counts)]
    return [Strategy((p,), R) for p in placements]
