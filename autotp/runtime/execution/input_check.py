"""Check every call's input sizes against the traced ones, before the rank-local graph runs.

The captured graph takes any size in a dynamic dim (within the range export derived) but
exactly the traced size in a static one; a wrong size would otherwise fail deep inside the
graph (``shape '[2, 16, 4, 32]' is invalid for input of size 2048``) or, worse, on one rank
only. :class:`InputShapeCheck` turns that into an :class:`~autotp.base.errors.InputShapeError`
naming the input, the dim, the traced size and the option that makes the dim dynamic.

One pass over a short list of ``(input, dim)`` pairs per call: no tracing, no guards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autotp.base.errors import InputShapeError
from autotp.capture.tracing import DYNAMIC_DIMS, CapturedGraph, InputDims

__all__ = ["InputShapeCheck"]

_WHY_STATIC = {
    "dynamic": (
        "by default only dims 0 and 1 (batch, sequence) are dynamic",
        "pass dynamic_shapes= to autotp.compile (torch.export's format, e.g. {'x': {2: torch.export.Dim.AUTO}}) "
        "to make it dynamic",
    ),
    "static": ("autotp.compile(..., dynamic=False) pinned every size", "compile with dynamic=True (the default)"),
    "custom": ("the dynamic_shapes= passed to autotp.compile leave it static",
               "mark it dynamic in dynamic_shapes (e.g. torch.export.Dim.AUTO)"),
    "static-fallback": (
        "the model could not be traced with dynamic dims, so every size is pinned (see the warning at compile time)",
        "call it at the traced size, or compile it once per size you need",
    ),
}
_FIXED_BY_EXPORT = (
    "torch.export fixed it while tracing (the model's code needs this size, or the example size was 0 or 1)",
    "trace with an example of another size >= 2 in this dim; if it stays fixed, the model needs this size",
)
_TRACED_AT_ONE = (
    "torch.export specialises a dim whose example size is 0 or 1, so that dim is not made dynamic",
    "trace with an example of size 2 or more in this dim (e.g. a batch of 2) to serve other sizes",
)


class InputShapeCheck:
    """The size rules of one traced graph's user inputs (see the module docstring)."""

    def __init__(self, captured: CapturedGraph) -> None:
        self._dims: tuple[InputDims, ...] = captured.input_dims
        self._mode = captured.shape_mode
        self._ndim: dict[int, int] = {}
        for d in self._dims:
            self._ndim[d.index] = max(self._ndim.get(d.index, 0), d.dim + 1)

    def __call__(self, flat: Sequence[Any]) -> None:
        """Raise :class:`InputShapeError` if ``flat`` (the flattened user inputs) cannot run."""
        seen: dict[str, tuple[int, InputDims]] = {}
        for d in self._dims:
            value = flat[d.index]
            if not isinstance(value, torch.Tensor) or value.dim() != self._ndim[d.index]:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise InputShapeError(
                    f"input {d.name!r} was traced as a {self._ndim[d.index]}-d tensor, got {shape}; "
                    "pass a tensor with as many dims as the example input"
                )
            size = int(value.shape[d.dim])
            if d.symbol is None:
                if size != d.traced:
                    why, fix = (_FIXED_BY_EXPORT if d.requested else
                                _TRACED_AT_ONE if self._mode == "dynamic" and d.traced <= 1 and d.dim in DYNAMIC_DIMS
                                else _WHY_STATIC[self._mode])
                    raise InputShapeError(
                        f"input {d.name!r} dim {d.dim} has size {size}, but the model was traced with size {d.traced} "
                        f"there and that dim is static: {why}. To fix: {fix}."
                    )
                continue
            # export's lower bound 2 only means 0 and 1 were not traced; size 1 runs the same graph
            low = 1 if d.low <= 2 else d.low
            if size < low or (d.high is not None and size > d.high):
                bound = f"{low}..{d.high}" if d.high is not None else f">= {low}"
                raise InputShapeError(
                    f"input {d.name!r} dim {d.dim} has size {size}, outside the sizes the traced model takes ({bound}); "
                    "the model's code limits this dim (e.g. a maximum number of positions)"
                )
            if d.symbol in seen and seen[d.symbol][0] != size:
                other_size, other = seen[d.symbol]
                raise InputShapeError(
                    f"input {d.name!r} dim {d.dim} has size {size} but input {other.name!r} dim {other.dim} has size "
                    f"{other_size}; the model was traced with these two sizes equal (both {d.traced}), so they must be"
                )
            seen[d.symbol] = (size, d)
