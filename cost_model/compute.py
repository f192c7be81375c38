"""Compute cost of one op: FLOPs and bytes from shapes, time from a roofline.

Roofline (Williams, Waterman & Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 52(4), 2009): a kernel takes as long as the slower of doing its
arithmetic at peak throughput and moving its bytes at peak memory bandwidth,

    time_s = max(flops / (peak_tflops[dtype] * 1e12 * achievable_fraction_compute),
                 memory_bytes / (memory_bandwidth_gbps * 1e9 * achievable_fraction_memory))
             + kernel_floor_s

plus the per-kernel floor (launch and scheduling, see ``Hardware.kernel_floor_s``), which is what a
tiny op costs. An op with no FLOPs and no bytes (a view, a shape query) launches no kernel and
costs 0.0.

Two refinements of the compute roof, both measured by ``autotp calibrate`` and both off (1.0 and
0.0) in a profile that does not set them:

* **shape-dependent GEMM rate** (:func:`gemm_efficiency`): small and skinny GEMMs run far below
  peak, because a tile that is mostly empty wastes the units it occupies (CUTLASS and cuBLAS
  pick tiles of 64-256 along each dim; a dim smaller than a tile leaves it part idle). The
  fraction of peak is the saturating curve ``d / (d + d_half)`` of the GEMM's smallest dim ``d``
  (of m, n, k), with ``d_half = Hardware.gemm_half_efficiency_dim`` the dim at which half the
  peak is reached; it is monotone in ``d`` and tends to 1. A dim of 1 makes the product a
  matrix-vector product (decode's linears at batch 1, attention over the cache for one query):
  BLAS runs it as a GEMV kernel that streams the matrix once with no tile to fill, so its roof
  is its bytes (measured on this project's CPU: a one-token ``aten.linear`` of a 512 x 512 weight
  reads it at the copy bandwidth of its working set, where the curve at ``d = 1`` predicted
  1.45x longer); the curve applies from ``d = 2``. In eager mode its bytes move at the rate BLAS's
  matrix-vector product streams a matrix where the profile measured one (``Hardware.gemv_bandwidth_gbps``:
  on this project's VM, at DRAM working sets, about half what the copy moves), else at the copy's; a
  compiled CPU decode graph sums its one-row linears in a fused pass instead
  (:func:`autotp.runtime.execution.runtime_modes.one_row_linear`), priced at the copy's.
* **per-element rates** (:func:`rated_elements`): a transcendental elementwise op (exp, tanh, silu, gelu,
  softmax, ...) runs its arithmetic on special-function units (GPU) or polynomial code (CPU), and a pooling op
  compares or adds each element of its windows (a max with a branch per element, which a CPU predicts badly
  on fresh data); each takes the longer of its elements at a rate per element
  (``Hardware.element_rate_s``) and its bytes.

Some op families pay a fixed cost per call that their bytes and FLOPs do not
show (:data:`~.hardware.OP_FIXED_COSTS`, ``Hardware.op_fixed_s``, :func:`fixed_costs`: a CPU convolution sets up a
oneDNN primitive, about 40 us on this project's VM whatever its size; an attention pays per call and per block of
queries in PyTorch's flash kernel, or per call in its math kernel, whichever PyTorch picks). The kernel's time
then meets the host's dispatch of the node as the runtime mode says (:func:`.runtime.node_time_s`): added on a
CPU, overlapped on a GPU, absent when compiled or replayed from a CUDA graph.

FLOPs come from ``torch.utils.flop_counter``'s formula table (``flop_registry``) where it covers
the op, so autotp's counts agree with ``FlopCounterMode``; a few composite ops that appear in
``torch.export`` graphs before decomposition (``aten.linear``, ``aten.matmul``,
``aten.scaled_dot_product_attention``, ``aten.conv{1,2,3}d``, ...) get the formula of the kernels
they decompose into. Ops outside both tables count 0 FLOPs: elementwise and reduction ops are
memory bound, and their time comes from their bytes.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import conv_flop_count, flop_registry

from autotp.adapters.torch_internals import fused_sdp_choice, select_conv_backend

from .hardware import Hardware
from .runtime import node_time_s, python_loop_host_s

__all__ = [
    "HOST_CALLS",
    "achievable_flops_per_s",
    "achievable_memory_bytes_per_s",
    "aten_flops",
    "aten_memory_bytes",
    "compute_time_s",
    "convolution_sets_up_primitive",
    "dtype_name",
    "first_call_key",
    "gemm_dims",
    "gemm_efficiency",
    "has_element_rate",
    "is_lookup",
    "is_matrix_vector",
    "is_transcendental",
    "launches_no_kernel",
    "makes_host_calls",
    "op_family",
    "op_name",
    "rated_elements",
    "tensor_bytes",
]

aten = torch.ops.aten


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the key of ``Hardware.peak_tflops``."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")


def achievable_flops_per_s(dtype: torch.dtype | str, hardware: Hardware) -> float:
    """Achievable dense FLOP/s of ``hardware`` in ``dtype``.

    Raises ValueError when the profile has no peak for ``dtype``, naming the dtypes it has.
    """
    name = dtype_name(dtype)
    if name not in hardware.peak_tflops:
        raise ValueError(
            f"hardware {hardware.name!r} has no peak_tflops for dtype {name!r} (it has "
            f"{', '.join(sorted(hardware.peak_tflops))}); add peak_tflops[{name!r}] to the profile "
            f"(a JSON profile or a Hardware object)"
        )
    return hardware.peak_tflops[name] * 1e12 * hardware.achievable_fraction_compute


def achievable_memory_bytes_per_s(hardware: Hardware, *, matrix_vector: bool = False) -> float:
    """Achievable device-memory bandwidth of ``hardware``, bytes per second; with ``matrix_vector``, what a
    matrix-vector product streams its matrix at (``Hardware.gemv_bandwidth_gbps`` where measured)."""
    gbps = hardware.gemv_bandwidth_gbps if matrix_vector and hardware.gemv_bandwidth_gbps else \
        hardware.memory_bandwidth_gbps
    return gbps * 1e9 * hardware.achievable_fraction_memory


def roofline_time_s(
    flops: Any,
    memory_bytes: Any,
    flops_per_s: float,
    memory_bytes_per_s: float,
    kernel_floor_s: float,
    *,
    max_fn: Callable[[Any, Any], Any] = max,
) -> Any:
    """The roofline formula itself, on numbers or (with ``max_fn=sympy.Max``) on expressions."""
    return max_fn(flops / flops_per_s, memory_bytes / memory_bytes_per_s) + kernel_floor_s


def gemm_efficiency(min_dim: Any, hardware: Hardware) -> Any:
    """Fraction of the peak a GEMM whose smallest dim (of m, n, k) is ``min_dim`` reaches:
    ``d / (d + Hardware.gemm_half_efficiency_dim)``, 1.0 when the profile sets no curve.
    Monotone increasing in ``d``, equal to 1/2 at ``d = gemm_half_efficiency_dim``; 1.0 at ``d = 1``
    (a matrix-vector product: bandwidth bound, see the module docstring)."""
    half = hardware.gemm_half_efficiency_dim
    if half == 0 or is_matrix_vector(min_dim):
        return 1.0
    return min_dim / (min_dim + half)


def is_matrix_vector(min_dim: Any) -> bool:
    """Whether a GEMM whose smallest dim is ``min_dim`` is a matrix-vector product (a concrete dim of 1 or less):
    no tile to fill, its roof its bytes (the module docstring)."""
    return isinstance(min_dim, (int, float)) and min_dim <= 1


def compute_time_s(
    flops: float,
    memory_bytes: float,
    dtype: torch.dtype,
    hardware: Hardware,
    *,
    gemm_min_dim: float | None = None,
    rated_elements: float = 0,
    rated_op: str | None = None,
    fixed: Iterable[tuple[str, float]] = (),
) -> float:
    """Predicted seconds of one kernel node doing ``flops`` FLOPs and moving ``memory_bytes`` bytes.

    ``max(flops / (achievable peak(dtype) * gemm_efficiency), rated_elements * the op's element rate,
    memory_bytes / achievable bandwidth) + kernel_floor_s`` (roofline, Williams et al. 2009, with the
    shape-dependent GEMM rate and the per-element rates of the module docstring), then the node's host dispatch
    under the profile's runtime mode (:func:`.runtime.node_time_s`). ``gemm_min_dim``: the smallest of the GEMM's
    local (m, n, k) when the op is a GEMM (:func:`gemm_dims`), else None. ``rated_elements``: the elements the
    op's arithmetic runs over (:func:`rated_elements`); ``rated_op``: its name (:func:`op_name`), whose own rate
    prices them where the profile measured one (``Hardware.element_rate_s``; a transcendental op without one at
    ``Hardware.transcendental_element_s``, a pooling op by its bytes). ``fixed``: the fixed costs the call pays
    on top, ``(name, times)`` (:func:`fixed_costs`; ``Hardware.op_fixed_s`` prices them, and the host's dispatch
    of a kernel node and of a view prices the :data:`HOST_CALLS` a Python-level loop makes). ``flops == 0 and
    memory_bytes == 0`` means no kernel: 0.0. The dtype's peak is only needed when ``flops > 0``.
    """
    if flops < 0 or memory_bytes < 0 or rated_elements < 0:
        raise ValueError(f"flops ({flops}), memory_bytes ({memory_bytes}) and rated_elements "
                         f"({rated_elements}) must be >= 0")
    if flops == 0 and memory_bytes == 0:
        return 0.0
    # With no arithmetic the dtype's peak does not matter (and may be absent, e.g. int64 copies).
    flops_per_s = achievable_flops_per_s(dtype, hardware) if flops > 0 else math.inf
    if flops > 0 and gemm_min_dim is not None:
        flops_per_s *= gemm_efficiency(max(gemm_min_dim, 1), hardware)
    device_s = roofline_time_s(
        flops,
        memory_bytes,
        flops_per_s,
        achievable_memory_bytes_per_s(hardware, matrix_vector=is_matrix_vector(gemm_min_dim)
                                      and hardware.runtime_mode == "eager"),
        hardware.kernel_floor_s,
    )
    if rated_elements:
        default = None if rated_op is None or rated_op in _TRANSCENDENTAL_NAMES else 0.0
        arithmetic_s = rated_elements * hardware.element_rate_s(rated_op, default)
        device_s = max(device_s, arithmetic_s + hardware.kernel_floor_s)
    fixed = tuple(fixed)
    calls = dict.fromkeys(HOST_CALLS, 0.0)
    for name, times in fixed:
        if name in calls:
            calls[name] += times
    inner_host_s = python_loop_host_s(hardware, calls["kernel_call"], calls["view_call"])
    return float(node_time_s(device_s + hardware.fixed_costs_s(fixed), hardware, inner_host_s=inner_host_s))


def tensor_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``: numel * itemsize."""
    numel = 1
    for size in shape:
        numel *= _concrete_size(size)
    return numel * dtype.itemsize


def _concrete_size(size: Any) -> int:
    """An int size; a dynamic ``torch.SymInt`` counts at its hint (the example size it was traced
    with) rather than through int(), which would add a guard to the caller's ShapeEnv."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise ValueError(
                f"size {size} has no example value to count at; use autotp.cost_model.symbolic "
                f"for costs as expressions of symbolic sizes"
            )
        return int(hint)
    return int(size)


# --------------------------------------------------------------------------------------------
# FLOP counts
# --------------------------------------------------------------------------------------------

_FlopFormula = Callable[[Sequence[Any], dict[str, Any], Any], int]
_COMPOSITE_FLOP_FORMULAS: dict[Any, _FlopFormula] = {}


def _register(*packets: Any) -> Callable[[_FlopFormula], _FlopFormula]:
    def decorate(formula: _FlopFormula) -> _FlopFormula:
        for packet in packets:
            _COMPOSITE_FLOP_FORMULAS[packet] = formula
        return formula

    return decorate


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _shape(value: Any) -> tuple[Any, ...]:
    """Shape of a tensor argument: a (Fake/meta) tensor's ``.shape``, or a shape given directly."""
    shape = getattr(value, "shape", value)
    return tuple(shape)


def _prod(sizes: Iterable[Any]) -> Any:
    result: Any = 1
    for size in sizes:
        result = result * size
    return result


@_register(aten.linear)
def _linear_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    # input (..., in_features) @ weight.T (in_features, out_features); the bias add is not counted,
    # as FlopCounterMode counts the addmm it decomposes into as mm FLOPs.
    x_shape, w_shape = _shape(_arg(args, kwargs, 0, "input")), _shape(_arg(args, kwargs, 1, "weight"))
    out_features = w_shape[0] if len(w_shape) == 2 else 1
    in_features = w_shape[-1]
    return 2 * _prod(x_shape[:-1]) * out_features * in_features


def _broadcast_shapes(a_shape: tuple[Any, ...], b_shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """Broadcast two batch shapes (numpy rules); a size-1 dim takes the other's size."""
    ndim = max(len(a_shape), len(b_shape))
    a_padded = (1,) * (ndim - len(a_shape)) + tuple(a_shape)
    b_padded = (1,) * (ndim - len(b_shape)) + tuple(b_shape)
    return tuple(b if _is_one(a) else a for a, b in zip(a_padded, b_padded))


def _is_one(size: Any) -> bool:
    # Only a literal 1 broadcasts; a symbolic size is taken as the full size.
    return isinstance(size, int) and size == 1


@_register(aten.matmul)
def _matmul_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    # torch.matmul semantics: 1-D operands are promoted and their dim removed; batch dims broadcast.
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    a_shape, b_shape = _shape(a), _shape(b)
    inner = a_shape[-1]
    if len(a_shape) == 1 and len(b_shape) == 1:
        out_shape: tuple[Any, ...] = ()
    elif len(b_shape) == 1:
        out_shape = a_shape[:-1]
    elif len(a_shape) == 1:
        out_shape = b_shape[:-2] + b_shape[-1:]
    else:
        out_shape = _broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1])
    return 2 * _prod(out_shape) * inner


def _sdpa_flops_from_shapes(
    query_shape: Sequence[Any], key_shape: Sequence[Any], value_shape: Sequence[Any]
) -> int:
    # query (..., Sq, E), key (..., Sk, E), value (..., Sk, Ev): Q @ K^T then P @ V, each a batched
    # GEMM: 2 * batch * Sq * Sk * E + 2 * batch * Sq * Sk * Ev = 4 * B * H * Sq * Sk * D when
    # E == Ev == D; batch = prod of the query's leading dims (GQA broadcasts K/V heads to them).
    # Causal masking is not discounted, as in torch.utils.flop_counter.sdpa_flop_count.
    batch = _prod(query_shape[:-2])
    seq_q, head_dim = query_shape[-2], query_shape[-1]
    seq_k, value_dim = key_shape[-2], value_shape[-1]
    return 2 * batch * seq_q * seq_k * head_dim + 2 * batch * seq_q * seq_k * value_dim


_GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})
"""Grouped GEMMs (one product per group of rows: mixture-of-experts layers), by qualified name, so that the custom
op of ``transformers`` is known without importing it."""


def _is_grouped_mm(packet: Any) -> bool:
    return getattr(packet, "_qualified_op_name", None) in _GROUPED_MM_OPS


def _grouped_mm_shapes(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    a, b = _arg(args, kwargs, 0, "mat_a"), _arg(args, kwargs, 1, "mat_b")
    if a is None:
        a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    if a is None or b is None:
        return None
    return tuple(_shape(a)), tuple(_shape(b))


HOST_CALLS = ("kernel_call", "view_call")
"""Fixed costs that are calls an op makes on the host inside its one call (a Python-level loop), beyond the node's
own dispatch: priced at the profile's dispatch of a kernel node and of a view (:func:`.runtime.python_loop_host_s`:
in eager and compiled mode, not when a CUDA graph replays), not at ``Hardware.op_fixed_s``."""

_PYTHON_LOOP_GROUPED_MM = "transformers::grouped_mm_fallback"



def _grouped_mm_loop_calls(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The host calls of ``transformers::grouped_mm_fallback`` (a Python loop, ``transformers.integrations.moe``):
    it zero-fills its output, reads the groups' offsets to the host, and for each group with rows calls
    ``torch.mm`` on three views (the group's rows of the input and of the output, its weight). Which groups have
    rows is data a trace does not hold: every group counts, up to the number of rows."""
    shapes = _grouped_mm_shapes(args, kwargs)
    if shapes is None or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return ()
    called = min(_concrete_size(shapes[0][0]), _concrete_size(shapes[1][0]))
    return (("kernel_call", called + 1), ("view_call", 3 * called + 1))


def _grouped_mm_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Any:
    """``x (S, K)`` by ``w (E, K, N)``, each row by its group's weight: ``2 S K N``; a batch of ``E`` products
    ``(E, M, K) @ (E, K, N)``: ``2 E M K N``; ``(M, K) @ (K, N)`` with the groups splitting ``K``: ``2 M K N``;
    0 for any other form (priced by its bytes)."""
    shapes = _grouped_mm_shapes(args, kwargs)
    if shapes is None:
        return 0
    a, b = shapes
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 0


@_register(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    query = _arg(args, kwargs, 0, "query")
    key = _arg(args, kwargs, 1, "key")
    value = _arg(args, kwargs, 2, "value")
    return _sdpa_flops_from_shapes(_shape(query), _shape(key), _shape(value))


def _conv_out_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
) -> list[int]:
    ndim = len(in_spatial)

    def per_dim(value: Any, default: int) -> list[int]:
        if value is None:
            return [default] * ndim
        if isinstance(value, int):
            return [value] * ndim
        values = list(value)
        return values * ndim if len(values) == 1 else values

    strides, dilations = per_dim(stride, 1), per_dim(dilation, 1)
    if padding == "same":
        return list(in_spatial)
    pads = per_dim(0 if padding == "valid" else padding, 0)
    if transposed:
        extra = per_dim(output_padding, 0)
        return [
            (size - 1) * s - 2 * p + d * (k - 1) + e + 1
            for size, k, s, p, d, e in zip(in_spatial, kernel, strides, pads, dilations, extra)
        ]
    return [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(in_spatial, kernel, strides, pads, dilations)
    ]


def _conv_flops(
    x: Any,
    weight: Any,
    out: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
) -> int:
    x_shape, w_shape = list(_shape(x)), list(_shape(weight))
    if len(x_shape) == len(w_shape) - 1:  # unbatched input: (C, *spatial)
        x_shape = [1, *x_shape]
    if out is not None:
        out_shape = list(_shape(out))
        if len(out_shape) == len(w_shape) - 1:
            out_shape = [1, *out_shape]
    else:
        spatial = _conv_out_spatial(
            x_shape[2:], w_shape[2:], stride, padding, dilation, transposed, output_padding
        )
        out_shape = [x_shape[0], 0, *spatial]  # channel count is not used by the formula
    return conv_flop_count(x_shape, w_shape, out_shape, transposed=transposed)


@_register(aten.conv1d, aten.conv2d, aten.conv3d)
def _convnd_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    # conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)
    return _conv_flops(
        _arg(args, kwargs, 0, "input"),
        _arg(args, kwargs, 1, "weight"),
        out,
        _arg(args, kwargs, 3, "stride", 1),
        _arg(args, kwargs, 4, "padding", 0),
        _arg(args, kwargs, 5, "dilation", 1),
        False,
        0,
    )


@_register(aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d)
def _conv_transpose_nd_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    # conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
    # dilation=1); weight is (C_in, C_out / groups, *k), as conv_flop_count expects when transposed.
    return _conv_flops(
        _arg(args, kwargs, 0, "input"),
        _arg(args, kwargs, 1, "weight"),
        out,
        _arg(args, kwargs, 3, "stride", 1),
        _arg(args, kwargs, 4, "padding", 0),
        _arg(args, kwargs, 7, "dilation", 1),
        True,
        _arg(args, kwargs, 5, "output_padding", 0),
    )


@_register(aten.convolution)
def _convolution_flops(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    # Same formula as flop_registry[aten.convolution]; handled here so that `out` may be None.
    return _conv_flops(
        _arg(args, kwargs, 0, "input"),
        _arg(args, kwargs, 1, "weight"),
        out,
        _arg(args, kwargs, 3, "stride", 1),
        _arg(args, kwargs, 4, "padding", 0),
        _arg(args, kwargs, 5, "dilation", 1),
        bool(_arg(args, kwargs, 6, "transposed", False)),
        _arg(args, kwargs, 7, "output_padding", 0),
    )


def _packet_of(op: Any) -> Any:
    """``aten.mm.default`` -> ``aten.mm``; packets and other callables pass through."""
    return getattr(op, "_overloadpacket", op)


def aten_flops(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, out: Any = None) -> int:
    """FLOPs of one ATen op call: ``op(*args, **kwargs) -> out``.

    Tensor arguments may be FakeTensors or meta tensors: only ``.shape`` is read. ``out`` (the
    op's output, e.g. an FX node's ``meta["val"]``) may be None for every op this module covers
    except a few private attention kernels of ``flop_registry`` that read it.

    A multiply-add counts 2 FLOPs: ``mm`` of (M, K) @ (K, N) is 2*M*N*K, ``linear`` likewise with
    M = prod(input.shape[:-1]) (bias add not counted), ``scaled_dot_product_attention`` is
    4*B*H*Sq*Sk*D. Covered: everything in ``torch.utils.flop_counter.flop_registry`` (mm, addmm,
    bmm, baddbmm, convolution, fused attention kernels, ...) plus the composite ops ``linear``,
    ``matmul``, ``scaled_dot_product_attention``, ``conv{1,2,3}d``, ``conv_transpose{1,2,3}d``, and the
    grouped GEMMs of mixture-of-experts layers (``aten._grouped_mm``, ``transformers::grouped_mm_fallback``).
    Anything else is 0 (memory bound: its cost is its bytes).
    """
    kwargs = kwargs or {}
    if _has_symbolic_size((args, kwargs, out)):
        # Dynamic shapes: count at each SymInt's hint (the example size it was traced with)
        # instead of calling int() on it, which would add a guard to the caller's ShapeEnv.
        args, kwargs, out = tree_map(_hinted_shape, (tuple(args), dict(kwargs), out))
    return int(flops_formula(op, args, kwargs, out))


def _has_symbolic_size(tree: Any) -> bool:
    leaves, _ = tree_flatten(tree)
    return any(
        isinstance(leaf, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in leaf.shape)
        for leaf in leaves
    )


def _hinted_shape(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return tuple(_concrete_size(size) for size in value.shape)


def flops_formula(op: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Any:
    """The FLOP formula of ``op`` applied to whatever sizes the arguments carry (ints, SymInts or
    sympy expressions); :func:`aten_flops` and ``symbolic.symbolic_aten_flops`` share it."""
    packet = _packet_of(op)
    if _is_grouped_mm(packet):
        return _grouped_mm_flops(args, kwargs, out)
    composite = _COMPOSITE_FLOP_FORMULAS.get(packet)
    if composite is not None:
        return composite(args, kwargs, out)
    registry_formula = flop_registry.get(packet)
    if registry_formula is not None:
        return registry_formula(*args, **kwargs, out_val=out)
    return 0


# Ops that launch no kernel and move no data: views, metadata queries, and ops that return their
# input (detach, lift_fresh, dropout outside training). By overload packet, so every overload
# counts. Listed, not read from the schema: ``reshape``, ``contiguous`` and ``to`` may alias
# their input by schema but copy whenever the layout or dtype changes.
NO_KERNEL_OPS = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.transpose,
        aten.permute,
        aten.t,
        aten.unsqueeze,
        aten.squeeze,
        aten.expand,
        aten.slice,
        aten.select,
        aten.narrow,
        aten.movedim,
        aten.unflatten,
        aten.alias,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
        aten.dropout,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.size,
        aten.stride,
        aten.numel,
        aten.dim,
        aten.detach,
        aten.lift_fresh,
        aten._assert_async,
        aten._assert_scalar,
        aten.sym_constrain_range_for_size,
        aten._local_scalar_dense,
        operator.getitem,  # picks one output of a multi-output op
    }
)


def launches_no_kernel(op: Any) -> bool:
    """True for ops that launch no kernel and move no data (:data:`NO_KERNEL_OPS`): the planner's
    cost pass prices them at the host's dispatch time only, reports treat them as aliases."""
    return _packet_of(op) in NO_KERNEL_OPS


def aten_memory_bytes(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, out: Any = None
) -> int:
    """Device-memory bytes one ATen op call moves: every tensor it reads plus every tensor it writes.

    Views (``view``, ``permute``, ``t``, ``expand``, ``slice``, ... : ops whose schema says the
    output aliases an input) and shape queries move nothing and return 0. This is the ideal
    traffic of one unfused kernel (each operand read once, each output written once); it is the
    ``memory_bytes`` that :func:`compute_time_s` expects. A lookup (:data:`GATHER_OPS`: embedding,
    index_select, gather, index) reads only the rows it returns from its table; a fill shaped like its
    input (:data:`FILL_LIKE_OPS`: zeros_like, ...) writes its output and reads nothing.
    """
    if launches_no_kernel(op):
        return 0
    if _packet_of(op) in GATHER_OPS and out is not None and args and isinstance(args[0], torch.Tensor) \
            and isinstance(out, torch.Tensor):
        # a lookup reads only the rows it returns from its table (args[0]), not the whole table:
        # the output's bytes read, the indices read, the output written
        indices = tree_flatten((list(args[1:]), dict(kwargs or {})))[0]
        index_bytes = sum(tensor_bytes(leaf.shape, leaf.dtype) for leaf in indices if isinstance(leaf, torch.Tensor))
        return 2 * tensor_bytes(out.shape, out.dtype) + index_bytes
    if _packet_of(op) in FILL_LIKE_OPS:  # reads only its input's shape: the output written
        args = ()
    leaves, _ = tree_flatten((list(args), dict(kwargs or {}), out))
    return sum(tensor_bytes(leaf.shape, leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor))


# Fills of a tensor shaped like their input, which they do not read, by packet.
FILL_LIKE_OPS = frozenset({aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like})

# Lookups whose first argument is a table they read only at the rows or elements they return
# (an embedding reads batch x tokens rows of its vocabulary, not the vocabulary), by packet.
GATHER_OPS = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index})


def is_lookup(op: Any) -> bool:
    """True for a lookup that reads only the rows it returns from its table (:data:`GATHER_OPS`)."""
    return _packet_of(op) in GATHER_OPS


# --------------------------------------------------------------------------------------------
# GEMM shapes and transcendental ops
# --------------------------------------------------------------------------------------------

_GEMM_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul})


def gemm_dims(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple[int, int, int] | None:
    """``(m, n, k)`` of a GEMM-like op call (tensors or shapes as arguments), None for other ops.

    ``m`` counts every row of the left operand (batch dims of ``bmm``/``matmul`` multiply it, as
    the kernel runs them as one batched GEMM), ``n`` the output features, ``k`` the contracted
    dim: ``linear(x (..., k), w (n, k))``, ``mm(a (m, k), b (k, n))``, ``addmm(bias, a, b)``,
    ``bmm(a (b, m, k), b (b, k, n))``. Attention (``scaled_dot_product_attention``) runs its two
    products head by head, ``(Sq, E) @ (E, Sk)`` then ``(Sq, Sk) @ (Sk, Ev)``: ``(Sq, Sk, E)``, so
    short sequences and small heads run it as far below peak as any small GEMM. A convolution is
    the implicit GEMM its kernels run (cuDNN and oneDNN lower it so): ``m`` the batch times the
    output's positions, ``n`` the output channels of a group, ``k`` a group's input channels times
    the kernel's positions; a depthwise convolution (one channel per group) has ``n = 1`` and is
    priced by its bytes, as a matrix-vector product is.
    """
    packet = _packet_of(op)
    kwargs = kwargs or {}
    if packet in _ATTENTION_OPS:
        return _attention_gemm_dims(args, kwargs)
    if packet in _CONV_GROUPS_ARG:
        return _conv_gemm_dims(packet, args, kwargs)
    if _is_grouped_mm(packet):
        return _grouped_mm_gemm_dims(args, kwargs)
    if packet not in _GEMM_OPS:
        return None
    offset = 1 if packet in (aten.addmm, aten.baddbmm) else 0
    a = _arg(args, kwargs, offset, "input" if packet in (aten.linear, aten.matmul) else "mat1")
    b = _arg(args, kwargs, offset + 1, "weight" if packet is aten.linear else "mat2")
    if a is None or b is None:
        return None
    a_shape = tuple(_concrete_size(size) for size in _shape(a))
    b_shape = tuple(_concrete_size(size) for size in _shape(b))
    if not a_shape or not b_shape:
        return None
    k = a_shape[-1]
    m = max(1, math.prod(a_shape[:-1]))
    # linear's weight is (n, k); the other ops' right operand is (..., k, n); a 1-D one has n = 1
    n_dim = 0 if packet is aten.linear else -1
    n = b_shape[n_dim] if len(b_shape) >= 2 else 1
    return m, n, k


_ATTENTION_OPS = frozenset({aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu})

# convolutions, by the position of their ``groups`` argument
_CONV_GROUPS_ARG = {aten.conv1d: 6, aten.conv2d: 6, aten.conv3d: 6, aten.convolution: 8}


def _conv_gemm_dims(packet: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, int, int] | None:
    x, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    if x is None or weight is None:
        return None
    transposed = packet is aten.convolution and bool(_arg(args, kwargs, 6, "transposed", False))
    if transposed:  # a transposed convolution's GEMM is a convolution's backward: leave it to its FLOPs
        return None
    x_shape = [_concrete_size(size) for size in _shape(x)]
    w_shape = [_concrete_size(size) for size in _shape(weight)]
    if len(x_shape) == len(w_shape) - 1:  # unbatched input: (C, *spatial)
        x_shape = [1, *x_shape]
    if len(w_shape) < 3 or len(x_shape) != len(w_shape):
        return None
    groups = int(_arg(args, kwargs, _CONV_GROUPS_ARG[packet], "groups", 1) or 1)
    spatial = _conv_out_spatial(x_shape[2:], w_shape[2:], _arg(args, kwargs, 3, "stride", 1),
                                _arg(args, kwargs, 4, "padding", 0), _arg(args, kwargs, 5, "dilation", 1), False, 0)
    m = x_shape[0] * math.prod(spatial)
    n = max(1, w_shape[0] // groups)
    k = w_shape[1] * math.prod(w_shape[2:])
    return max(1, m), n, max(1, k)


def _grouped_mm_gemm_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, int, int] | None:
    """The (m, n, k) of one group's product: rows shared evenly by the groups (``x (S, K)`` by ``w (E, K, N)``:
    ``S / E`` rows each), so many experts over few tokens run as small GEMMs."""
    shapes = _grouped_mm_shapes(args, kwargs)
    if shapes is None:
        return None
    a, b = (tuple(_concrete_size(size) for size in shape) for shape in shapes)
    if len(a) == 2 and len(b) == 3:
        return max(1, a[0] // max(1, b[0])), b[2], a[1]
    if len(a) == 3 and len(b) == 3:
        return a[1], b[2], a[2]
    if len(a) == 2 and len(b) == 2:
        return a[0], b[1], a[1]
    return None


def _attention_gemm_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, int, int] | None:
    query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    if query is None or key is None:
        return None
    q_shape = tuple(_concrete_size(size) for size in _shape(query))
    k_shape = tuple(_concrete_size(size) for size in _shape(key))
    if len(q_shape) < 2 or len(k_shape) < 2:
        return None
    return q_shape[-2], k_shape[-2], q_shape[-1]


# Elementwise ops whose arithmetic is a transcendental function (special-function units on a GPU,
# polynomial approximations on a CPU), by overload packet.
TRANSCENDENTAL_OPS = frozenset(
    {
        aten.exp, aten.exp2, aten.expm1, aten.log, aten.log1p, aten.log2, aten.tanh, aten.sigmoid,
        aten.silu, aten.gelu, aten.erf, aten.rsqrt, aten.sqrt, aten.sin, aten.cos, aten.pow,
        aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax, aten.mish, aten.softplus,
    }
)


_TRANSCENDENTAL_NAMES = frozenset(str(packet.__name__) for packet in TRANSCENDENTAL_OPS)

_ADAPTIVE_POOLING_OPS = frozenset({aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d,
                                   aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d, aten.adaptive_max_pool1d,
                                   aten.adaptive_max_pool2d, aten.adaptive_max_pool3d})
_POOLING_OPS = frozenset({aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.max_pool2d_with_indices,
                          aten.max_pool3d_with_indices, aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d,
                          *_ADAPTIVE_POOLING_OPS})

_FAMILY_OF = {
    **dict.fromkeys((aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution, aten._convolution), "convolution"),
    **dict.fromkeys(_POOLING_OPS, "pooling"),
    **dict.fromkeys((aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
                     aten._native_batch_norm_legit_no_training), "batch_norm"),
    **dict.fromkeys(_ATTENTION_OPS, "attention"),
}


ATTENTION_BLOCK_QUERIES = ((768, 256), (192, 64), (0, 32))
"""``(from query length, queries per block)``: how PyTorch's CPU flash attention splits the queries of one
(batch, head) into blocks (``qSplitSize`` in ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``: 256 from
768 queries, 64 from 192, else 32); each block sets up its own buffers and GEMMs."""


def attention_blocks(query_shape: Sequence[int]) -> int:
    """Blocks of queries an attention call with a ``(..., Sq, E)`` query runs: every batch and head dim times
    ``ceil(Sq / block)`` (:data:`ATTENTION_BLOCK_QUERIES`)."""
    if len(query_shape) < 2:
        return 1
    queries = int(query_shape[-2])
    block = next(size for start, size in ATTENTION_BLOCK_QUERIES if queries >= start)
    return max(1, math.prod(int(d) for d in query_shape[:-2]) * math.ceil(queries / block))


def fixed_costs(op: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[tuple[str, int], ...]:
    """The fixed costs (``Hardware.op_fixed_s``, :data:`~.hardware.OP_FIXED_COSTS`) one call of ``op`` pays, as
    ``(name, times)`` pairs, from its local arguments (tensors, or their shapes): an attention call PyTorch runs
    in its flash kernel pays ``"attention"`` once per block of queries (:func:`attention_blocks` of its query's
    shape) and ``"attention_call"`` once, one it runs in its math kernel (:func:`attention_runs_math`) pays
    ``"attention_math"`` once; a convolution pays its family's cost once when PyTorch runs it through oneDNN and
    not at all otherwise (:func:`convolution_sets_up_primitive`); an op of another family pays its family's once;
    an op of no family pays none. On a 2-core VM, one thread: a (2, 8, 16, 32) attention with a boolean mask
    took 89 us in a loop, one of one block (1, 1, 4, 16) 33 us, about 20 us for the call and 3.5 more per
    block; a Falcon-shaped one (keys and values of one head) took 250 us in the math kernel, where the flash
    kernel ran the same queries with eight heads of keys in 132. A Python-level loop pays the
    :data:`HOST_CALLS` it makes (``transformers::grouped_mm_fallback``: one kernel and three views per group of rows;
    on the same VM, one of a Mixtral at tp 2 took 168 us back to back where its GEMMs alone were priced 135)."""
    if makes_host_calls(op):
        return _grouped_mm_loop_calls(args, kwargs or {})
    family = op_family(op)
    if family is None:
        return ()
    kwargs = kwargs or {}
    packet = _packet_of(op)
    if packet in _ATTENTION_OPS:
        if attention_runs_math(op, args, kwargs, dtype):
            return (("attention_math", 1),)
        query = _arg(args, kwargs, 0, "query")
        return (("attention", attention_blocks(_shape(query)) if query is not None else 1), ("attention_call", 1))
    if packet in _CONV_GROUPS_ARG:
        return ((family, int(convolution_sets_up_primitive(op, args, kwargs, dtype))),)
    return ((family, 1),)


def attention_runs_math(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                        dtype: torch.dtype = torch.float32) -> bool:
    """Whether PyTorch runs this CPU ``scaled_dot_product_attention`` call in its composite math kernel (scores
    written out, about twenty ATen ops) rather than its flash kernel, as its own choice says
    (``torch._fused_sdp_choice``, asked with stand-ins of one token of every head of the arguments, their dtype
    and the mask's (the query's where the mask is given by its shape); ``use_flash_attention_cpp`` in PyTorch's
    ``sdp_utils_cpp.cpp``): keys and values with fewer
    heads than the queries and no ``enable_gqa`` (a multi-query Falcon), dropout, a head size the kernel does not
    take. False where torch cannot be asked (no such function, shapes of fewer than four dims, arguments it
    refuses): the calibration's attention is a flash one."""
    if _packet_of(op) is not aten.scaled_dot_product_attention:
        return False
    kwargs = kwargs or {}
    shapes = [_arg(args, kwargs, index, name) for index, name in enumerate(("query", "key", "value"))]
    if any(shape is None for shape in shapes):
        return False
    shapes = [tuple(_concrete_size(size) for size in _shape(shape)) for shape in shapes]
    if any(len(shape) != 4 for shape in shapes):
        return False
    mask = _arg(args, kwargs, 3, "attn_mask")
    mask_dtype = getattr(mask, "dtype", dtype) if mask is not None else None
    options = (float(_arg(args, kwargs, 4, "dropout_p", 0.0) or 0.0), bool(_arg(args, kwargs, 5, "is_causal", False)),
               bool(kwargs.get("enable_gqa", False)))
    heads = tuple((shape[1], shape[3]) for shape in shapes)
    return _math_kernel_chosen(heads, dtype, mask_dtype, *options)


@functools.lru_cache(maxsize=1024)
def _math_kernel_chosen(heads: tuple[tuple[int, int], ...], dtype: torch.dtype, mask_dtype: torch.dtype | None,
                        dropout_p: float, is_causal: bool, enable_gqa: bool) -> bool:
    """PyTorch's choice for stand-ins of ``(heads, head size)`` of the query, key and value (one batch, one token)."""
    choose = fused_sdp_choice
    if choose is None:
        return False
    try:
        query, key, value = (torch.zeros(1, count, 1, size, dtype=dtype) for count, size in heads)
        mask = torch.zeros(1, 1, 1, 1, dtype=mask_dtype) if mask_dtype is not None else None
        backend = choose(query, key, value, mask, dropout_p, is_causal, enable_gqa=enable_gqa)
    except (RuntimeError, TypeError, ValueError):
        return False
    return int(backend) == int(SDPBackend.MATH)


def convolution_sets_up_primitive(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                                  dtype: torch.dtype = torch.float32) -> bool:
    """Whether PyTorch runs this CPU convolution through oneDNN, which sets up a primitive on every call (the
    ``convolution`` family's fixed cost), as its own backend choice says (``torch._C._select_conv_backend``,
    asked with stand-ins of the arguments' shapes; PyTorch's ``use_mkldnn`` rule in ``Convolution.cpp``). On this
    project's 2-core VM, one thread: a 1 x 1 convolution of 64 channels on 2 x 4 x 4 runs in PyTorch's own
    im2col-and-GEMM kernel (``Slow2d``) in 9 us, a 3 x 3 one of 8 channels on 2 x 8 x 8 in oneDNN in 44 us.
    True where torch cannot be asked (no such function, a padding given by name, arguments it refuses): the
    calibration's instance is a oneDNN convolution. The groups are read off the local shapes (input channels over
    the weight's channels per group), so a depthwise convolution split over ranks is asked as each rank runs it."""
    kwargs = kwargs or {}
    select = select_conv_backend
    x, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    if select is None or x is None or weight is None:
        return True
    packet = _packet_of(op)
    general = packet is aten.convolution
    padding = _arg(args, kwargs, 4, "padding", 0)
    if isinstance(padding, str):
        return True
    x_shape = tuple(_concrete_size(size) for size in _shape(x))
    w_shape = tuple(_concrete_size(size) for size in _shape(weight))
    dims = len(w_shape) - 2

    def per_dim(value: Any) -> tuple[int, ...]:
        values = tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
        return values * dims if len(values) == 1 else values

    transposed = bool(_arg(args, kwargs, 6, "transposed", False)) if general else False
    output_padding = per_dim(_arg(args, kwargs, 7, "output_padding", 0)) if general else (0,) * dims
    groups = int(_arg(args, kwargs, _CONV_GROUPS_ARG[packet], "groups", 1) or 1)
    if not transposed and len(x_shape) == len(w_shape) and w_shape[1] > 0:
        # from the local shapes: a split depthwise convolution runs half its groups on each of two ranks
        groups = max(1, x_shape[1] // w_shape[1])
    return _onednn_backend(x_shape, w_shape, per_dim(_arg(args, kwargs, 3, "stride", 1)), per_dim(padding),
                           per_dim(_arg(args, kwargs, 5, "dilation", 1)), transposed, output_padding, groups, dtype,
                           torch.get_num_threads())


@functools.lru_cache(maxsize=4096)
def _onednn_backend(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: tuple[int, ...],
                    padding: tuple[int, ...], dilation: tuple[int, ...], transposed: bool,
                    output_padding: tuple[int, ...], groups: int, dtype: torch.dtype, threads: int) -> bool:
    """:func:`convolution_sets_up_primitive`'s question to torch, once per shape (``threads``: part of the key,
    as PyTorch's rule reads the thread count)."""
    def stand_in(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(1, dtype=dtype).expand(*shape)  # no storage of the shape: the rule reads sizes only

    try:
        backend = select_conv_backend(stand_in(x_shape), stand_in(w_shape), None, list(stride), list(padding),
                                      list(dilation), transposed, list(output_padding), groups, None)
    except (RuntimeError, TypeError):  # shapes torch refuses (its own checks, or a changed signature): as measured
        return True
    return backend.name.startswith("Mkldnn")


def first_call_key(op: Any) -> str:
    """What a kernel's first call in a call of a graph is counted by (``Hardware.first_call_s``): its op family
    (the convolutions of a graph count as one), else its ATen name (:func:`op_name`)."""
    return op_family(op) or op_name(op)


def makes_host_calls(op: Any) -> bool:
    """Whether one call of ``op`` runs a Python loop of kernels, whose :data:`HOST_CALLS` :func:`fixed_costs`
    counts (transformers' ``grouped_mm_fallback``)."""
    return getattr(_packet_of(op), "_qualified_op_name", None) == _PYTHON_LOOP_GROUPED_MM


def op_family(op: Any) -> str | None:
    """The :data:`~.hardware.OP_FAMILIES` entry ``op`` (an overload or packet) belongs to, None for any other op."""
    return _FAMILY_OF.get(_packet_of(op))


def op_name(op: Any) -> str:
    """The ATen name of ``op`` without its overload (``aten.tanh.default`` -> ``"tanh"``): the key of an op's
    own rate in ``Hardware.op_element_s``."""
    packet = _packet_of(op)
    return str(getattr(packet, "__name__", packet))


def is_transcendental(op: Any) -> bool:
    """True for elementwise ops priced per element when compute bound (:data:`TRANSCENDENTAL_OPS`)."""
    return _packet_of(op) in TRANSCENDENTAL_OPS


def has_element_rate(op: Any) -> bool:
    """True for ops priced by :func:`rated_elements` where their arithmetic bounds them (transcendental, pooling)."""
    return _packet_of(op) in TRANSCENDENTAL_OPS or _packet_of(op) in _POOLING_OPS


def rated_elements(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, out_numel: int,
                   in_numel: int | None = None) -> int:
    """How many elements the arithmetic of one call of ``op`` runs over, priced at the op's measured rate
    (``Hardware.element_rate_s``) where that bounds it: a transcendental op's output elements; a pooling op's
    window elements, its output elements times its window (``kernel_size``; an adaptive pool's input elements,
    ``in_numel``); 0 for every other op. ``args`` are the call's (a kernel size is read from them)."""
    packet = _packet_of(op)
    if packet in TRANSCENDENTAL_OPS:
        return out_numel
    if packet not in _POOLING_OPS:
        return 0
    if packet in _ADAPTIVE_POOLING_OPS:
        return in_numel if in_numel is not None else out_numel
    kernel = _arg(args, kwargs or {}, 1, "kernel_size", 1)
    dims = 3 if "3d" in op_name(op) else 2 if "2d" in op_name(op) else 1
    sizes = [int(k) for k in kernel] if isinstance(kernel, (list, tuple)) else [int(kernel)]
    return out_numel * math.prod(sizes * dims if len(sizes) == 1 else sizes)


