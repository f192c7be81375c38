"""Empty shards: the rank-local form of an op whose kernel refuses a 0-sized dim.

A split of ``n`` units over more than ``n`` ranks leaves some ranks an empty part (2 heads over 3
ranks: 1/1/0, ``passes/uneven.py``). Most kernels take a 0-sized dim in their stride (a matmul,
softmax, a norm over other dims, an embedding); a few refuse one: a convolution with no output
channels, max pooling and upsampling of no channels, batch norm with batch statistics of no
channels. Their local form runs the op on one zero element in the empty dim (a zero filter,
a zero channel) and cuts the result back to 0: the output has the right shape, symbolic sizes
included, for the price of one channel of work on the ranks that hold none. Attention on no heads
needs no local form: ``aten.scaled_dot_product_attention`` takes its math path there, eager and compiled
(CPU's flash kernel, which divides by zero on no heads, is offered replicated only).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.placements import Placement, split_of
from autotp.passes.rules.registry import LocalGraph

aten = torch.ops.aten

__all__ = ["cut_to_empty", "empty_dim", "pad_with_zeros"]


def empty_dim(builder: LocalGraph, producer: fx.Node, placement: Placement) -> int | None:
    """The dim of ``producer`` split under ``placement`` when this rank's part of it is empty, else ``None``."""
    split = split_of(placement)
    if split is None:
        return None
    dim, blocks = split
    ndim = producer.meta["val"].dim()
    dim %= ndim
    return dim if builder.parts.local(producer.name, dim, builder.rank, blocks)[1] == 0 else None


def pad_with_zeros(builder: LocalGraph, x: object, dim: int, ndim: int, amount: int = 1) -> fx.Node:
    """``x`` (of ``ndim`` dims) with ``amount`` zero entries appended along ``dim``."""
    pad = [0, 0] * (ndim - 1 - dim) + [0, amount]  # constant_pad_nd pads the last dim first
    return builder.graph.call_function(aten.constant_pad_nd.default, (x, pad, 0.0))


def _cut_each(outputs: tuple, dims: tuple[int | None, ...]) -> tuple:
    """``outputs`` with each tensor cut to 0 entries along its dim (``None``: kept whole)."""
    return tuple(out if dim is None else out.narrow(dim, 0, 0) for out, dim in zip(outputs, dims))


def cut_to_empty(builder: LocalGraph, out: fx.Node, node: fx.Node, dim: int) -> fx.Node:
    """``out`` (the op run with one padded entry) cut back to 0 entries along output ``dim``
    (of each tensor output, for an op returning several, such as pooling with indices)."""
    if isinstance(node.meta["val"], torch.Tensor):
        return builder.graph.call_function(aten.slice.Tensor, (out, dim, 0, 0))
    dims = tuple(dim if isinstance(value, torch.Tensor) else None for value in node.meta["val"])
    return builder.graph.call_function(_cut_each, (out, dims))

