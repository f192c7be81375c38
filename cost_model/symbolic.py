"""Costs as sympy expressions of batch size and sequence length.

The same formulas as :mod:`.compute` and :mod:`.collectives` — literally the same code
(``roofline_time_s``, ``flops_formula``, ``form_link_time`` and the rows of
:data:`~.collective_forms.FORM_TABLE` over :data:`~.collective_forms.SYMBOLIC`) — evaluated on sympy expressions
instead of numbers, so one traced model is costed once and then evaluated for prefill (long
sequence) and decode (one token) without re-tracing; :func:`crossover` finds the size at which
one cost (a split layer plus its collectives) drops below another (the layer kept whole).

Sizes may be ints, sympy expressions, or ``torch.SymInt`` (the dynamic sizes of FakeTensors
from ``torch.export`` with ``dynamic_shapes``); a SymInt becomes its sympy expression
(``sym.node.expr``, in the export's own symbols, e.g. ``s0``), which :func:`rename_symbols` maps
onto :data:`BATCH` and :data:`SEQ`.

Units as everywhere in the cost model: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from .collective_forms import SYMBOLIC
from .collectives import form_link_time, validate_collective
from .compute import (
    achievable_flops_per_s,
    achievable_memory_bytes_per_s,
    flops_formula,
    roofline_time_s,
)
from .hardware import Hardware
from .runtime import node_time_s

__all__ = [
    "BATCH",
    "SEQ",
    "crossover",
    "evaluate_s",
    "rename_symbols",
    "symbolic_aten_flops",
    "symbolic_collective_time_s",
    "symbolic_compute_time_s",
    "symbolic_tensor_bytes",
    "to_sympy",
]

BATCH = sympy.Symbol("batch", positive=True, integer=True)  # batch size
SEQ = sympy.Symbol("seq", positive=True, integer=True)  # sequence length (tokens per step)


def to_sympy(size: Any) -> sympy.Expr:
    """An int, a sympy expression or a ``torch.SymInt``/``SymFloat`` as a sympy expression."""
    if isinstance(size, sympy.Basic):
        return size
    if isinstance(size, (torch.SymInt, torch.SymFloat)):
        return size.node.expr
    if isinstance(size, bool):
        raise TypeError(f"a size must be a number or a sympy expression, got {size!r}")
    if isinstance(size, (int, float)):
        return sympy.sympify(size)
    raise TypeError(f"a size must be an int, a sympy expression or a torch.SymInt, got {size!r}")


def symbolic_tensor_bytes(shape: Iterable[Any], dtype: torch.dtype) -> sympy.Expr:
    """numel * itemsize, as an expression of the symbolic sizes in ``shape``."""
    numel: sympy.Expr = sympy.Integer(1)
    for size in shape:
        numel = numel * to_sympy(size)
    return numel * dtype.itemsize


def symbolic_compute_time_s(
    flops: Any, memory_bytes: Any, dtype: torch.dtype, hardware: Hardware
) -> sympy.Expr:
    """Roofline time of one kernel node as an expression: ``Max(flops/peak, bytes/bw) + floor``,
    with the node's host dispatch under the profile's runtime mode (:func:`.runtime.node_time_s`).

    Same formula as :func:`compute_time_s`, at the peak GEMM rate (the shape-dependent
    efficiency and the transcendental rate need concrete shapes and op kinds, which a symbolic
    caller does not give); an op whose FLOPs and bytes are both identically 0 costs 0 (no
    kernel). Sizes are positive, so a non-zero expression stays non-zero.
    """
    flops_expr, bytes_expr = to_sympy(flops), to_sympy(memory_bytes)
    if flops_expr == 0 and bytes_expr == 0:
        return sympy.Integer(0)
    if flops_expr == 0:  # no arithmetic: the dtype's peak is irrelevant
        device_s = bytes_expr / achievable_memory_bytes_per_s(hardware) + hardware.kernel_floor_s
    else:
        device_s = roofline_time_s(
            flops_expr,
            bytes_expr,
            achievable_flops_per_s(dtype, hardware),
            achievable_memory_bytes_per_s(hardware),
            hardware.kernel_floor_s,
            max_fn=sympy.Max,
        )
    return node_time_s(device_s, hardware, max_fn=sympy.Max)


def symbolic_collective_time_s(
    kind: str,
    nbytes: Any,
    group_size: int,
    hardware: Hardware,
    *,
    spans_nodes: bool = False,
    algorithm: str = "ring",
    dtype: Any = None,
) -> sympy.Expr:
    """:func:`collective_time_s` with ``nbytes`` an expression (``group_size`` stays a number:
    it is a mesh axis size, fixed when planning)."""
    validate_collective(kind, algorithm)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    nbytes_expr = to_sympy(nbytes)
    if group_size == 1 or nbytes_expr == 0:
        return sympy.Integer(0)
    link_s = form_link_time(kind, nbytes_expr, group_size, hardware, spans_nodes=spans_nodes, algorithm=algorithm,
                            dtype=dtype, arith=SYMBOLIC)  # the form's row, as collective_time_s
    return link_s + hardware.collective_wait_s  # the in-graph wait, as collective_time_s


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(to_sympy(size) for size in value.shape)
    return value


def symbolic_aten_flops(
    op: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, out: Any = None
) -> sympy.Expr:
    """FLOPs of one ATen op call as an expression of its symbolic sizes.

    Same formulas as :func:`aten_flops` (shared code). Tensor arguments may be FakeTensors with
    SymInt sizes, or be given as shapes directly: a tuple of ints/sympy expressions in place of
    each tensor, e.g. ``symbolic_aten_flops(aten.mm.default, ((BATCH * SEQ, 4096), (4096, 1024)))``.
    """
    shaped_args, shaped_kwargs, shaped_out = tree_map(_shape_of, (tuple(args), dict(kwargs or {}), out))
    return sympy.expand(to_sympy(flops_formula(op, shaped_args, shaped_kwargs, shaped_out)))


def rename_symbols(expr: sympy.Expr, mapping: Mapping[Any, sympy.Symbol]) -> sympy.Expr:
    """Replace symbols (or symbol names, e.g. export's ``"s0"``) by others, e.g. ``{"s0": BATCH}``."""
    by_name = {symbol.name: symbol for symbol in expr.free_symbols if isinstance(symbol, sympy.Symbol)}
    substitutions = {}
    for old, new in mapping.items():
        key = by_name.get(old) if isinstance(old, str) else old
        if key is not None:
            substitutions[key] = new
    return expr.xreplace(substitutions)


def evaluate_s(expr: Any, values: Mapping[sympy.Symbol, float] | None = None) -> float:
    """A cost expression at concrete sizes, as a float (every free symbol must be given)."""
    expr = to_sympy(expr)
    result = expr.xreplace({symbol: sympy.sympify(value) for symbol, value in (values or {}).items()})
    if result.free_symbols:
        missing = ", ".join(sorted(str(symbol) for symbol in result.free_symbols))
        raise ValueError(f"cost expression still depends on {missing}; give a value for each")
    return float(result)


def crossover(
    cost_a: Any,
    cost_b: Any,
    symbol: sympy.Symbol,
    *,
    values: Mapping[sympy.Symbol, float] | None = None,
    low: int = 1,
    high: int = 1 << 24,
) -> int | None:
    """Smallest integer ``symbol`` in [low, high] from which ``cost_a < cost_b`` holds.

    Typical use: ``cost_a`` = a layer split across a mesh axis plus its collectives, ``cost_b`` =
    the layer kept whole; the answer is the sequence length (or batch) from which splitting
    pays. ``values`` fixes the other symbols. Returns ``low`` if ``cost_a`` is already cheaper
    there and None if it never is up to ``high``. Assumes a single crossover (costs here are
    sums of maxima of linear terms, so a split that pays at one size keeps paying at larger
    ones); the search doubles then bisects, O(log high) evaluations.
    """
    fixed = dict(values or {})
    difference = to_sympy(cost_a) - to_sympy(cost_b)

    def a_cheaper(x: int) -> bool:
        return evaluate_s(difference, {**fixed, symbol: x}) < 0

    if low < 1 or high < low:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    if a_cheaper(low):
        return low
    # Doubling: find x_hi with cost_a cheaper, keeping x_lo where it is not.
    x_lo, x_hi = low, low
    while not a_cheaper(x_hi):
        x_lo = x_hi
        if x_hi >= high:
            return None
        x_hi = min(high, 2 * x_hi)
    while x_hi - x_lo > 1:
        middle = (x_lo + x_hi) // 2
        if a_cheaper(middle):
            x_hi = middle
        else:
            x_lo = middle
    return x_hi
