"""Sizes of traced tensors when some dims are symbolic (dynamic batch and sequence).

Capture exports the model with dynamic dims (``torch.export`` dynamic shapes), so a node's
``meta["val"]`` may have ``torch.SymInt`` sizes such as ``s72``. The planner prices and splits
tensors at the *hint* of each symbol: the example size the model was traced with. Reading a
SymInt through ``int()`` would also give the hint, but it adds a guard to the export's
ShapeEnv (specialising the symbol there) and is slow; these helpers read the hint directly.

Only *static* dims (plain ints) may be split across ranks: the per-rank sizes of a split
(``passes/uneven.py``) are fixed when the rank-local graph is built, while a symbolic dim
takes a new size at every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["concrete_shape", "concrete_size", "first_tensor", "is_static", "nbytes", "numel"]


def concrete_size(size: int | torch.SymInt) -> int:
    """An int size: a ``torch.SymInt`` counts at its hint (the example size it was traced with)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise ValueError(
                f"size {size} has no example value (an unbacked, data-dependent size); autotp plans at the example "
                "sizes the model was traced with, so make this size depend on input sizes only"
            )
        return int(hint)
    return int(size)


def concrete_shape(value: Any) -> tuple[int, ...]:
    """The example shape of a tensor (or a ``torch.Size``) as ints; ``()`` for a non-tensor."""
    shape = value.shape if isinstance(value, torch.Tensor) else value
    if shape is None or not isinstance(shape, (tuple, list, torch.Size)):
        return ()
    return tuple(concrete_size(s) for s in shape)


def is_static(size: Any) -> bool:
    """True when ``size`` is a plain int (or a SymInt already fixed to one value)."""
    if isinstance(size, torch.SymInt):
        return size.node.is_constant() or size.node.maybe_as_int() is not None
    return isinstance(size, int)


def numel(value: torch.Tensor) -> int:
    """Elements of a tensor at its example sizes."""
    count = 1
    for size in concrete_shape(value):
        count *= size
    return count


def nbytes(value: object) -> int:
    """Bytes of a tensor (or of every tensor in a tuple/list of them) at their example sizes."""
    return sum(numel(v) * v.element_size() for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))


def first_tensor(value: object) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor, or a tuple/list holding tensors), else ``None``."""
    return next((v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)), None)
