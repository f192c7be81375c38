"""GEMMs described by einsum strings: linear, addmm, mm/bmm/matmul, einsum.

One helper, :func:`einsum_strategies`, serves every GEMM-like op (as DTensor's
``_ops/_matrix_ops.py`` does): for each index letter, split it everywhere it appears; a
contracted letter gives a ``Partial`` output. Biases follow the output (:func:`_with_bias`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import BlockShard, Partial, Placement, Shard
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import shape, tensor_inputs
from autotp.passes.rules.builders import P, R, fitting_blocks
from autotp.passes.rules.registry import RuleContext, register_rule

aten = torch.ops.aten

__all__ = ["einsum_strategies"]


def einsum_strategies(operands: list[str], output: str, shapes: list[tuple[int, ...]],
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
        sizes = [dims[spec.index(letter)] for spec, dims in zip(operands, shapes) if letter in spec]
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
            for k in fitting_blocks(size, blocks):
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
    x_shape, w_shape = shape(inputs[0]), shape(inputs[1])
    batch = _batch_letters(len(x_shape) - 1)
    found = einsum_strategies([batch + "k", "nk"], batch + "n", [x_shape, w_shape], shape(node), ctx.block_counts)
    return _with_bias(found, "n" if len(inputs) > 2 else None, batch + "n", bias_first=False)


@register_rule(aten.addmm.default)
def _addmm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``out = beta * bias + x @ w``: bias ``(n,)`` or ``(m, n)``, x ``(m, k)``, w ``(k, n)``."""
    inputs = tensor_inputs(node)
    bias_shape = shape(inputs[0])
    found = einsum_strategies(["mk", "kn"], "mn", [shape(inputs[1]), shape(inputs[2])], shape(node), ctx.block_counts)
    bias_spec = "mn"[2 - len(bias_shape):] if bias_shape else ""
    strategies = _with_bias(found, bias_spec, "mn", bias_first=True)
    return [s for s in strategies if not (isinstance(s.inputs[0], (Shard, BlockShard)) and bias_shape[s.inputs[0].dim] == 1)]


@register_rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``a @ b`` with equal batch dims, or one operand a plain matrix (``(..., m, k) @ (k, n)``)."""
    inputs = tensor_inputs(node)
    if len(inputs) != 2:
        return []
    a_shape, b_shape = shape(inputs[0]), shape(inputs[1])
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
    found = einsum_strategies(specs, batch + "mn", [a_shape, b_shape], shape(node), ctx.block_counts)
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
    shapes = [shape(op) for op in operands]
    if any(len(spec) != len(dims) for spec, dims in zip(specs, shapes)):
        return []
    for letter in set(lhs.replace(",", "")):  # a broadcast size-1 letter would be cut at different sizes
        if len({dims[spec.index(letter)] for spec, dims in zip(specs, shapes) if letter in spec}) > 1:
            return []
    found = einsum_strategies(specs, output, shapes, shape(node))
    return _with_bias(found, None, output, bias_first=False)
