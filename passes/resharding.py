"""Resharding steps: one table from each step kind to its price, its rewrite and its name.

:data:`RESHARD_TABLE` maps every :class:`~autotp.base.reshard.ReshardKind` to a
:class:`StepSpec`:

- ``collective``: the collective kind the cost model prices (``collective_time_s``), or
  ``None`` for a local step (a slice, a zero-fill), and ``exchanged``: the bytes it is priced on;
- ``layout``: the local ops the rewrite emits around the collective (moving a dim to the front and
  back, laying a tensor out, padding uneven parts and cutting them out again), each with the
  bytes it moves. :func:`step_time_terms` prices each as the cost pass prices a graph's node (a
  view's dispatch, or a memory-bound kernel), so the price counts every node the rewrite emits;
  ``tests/test_resharding.py`` checks the two against each other. Not priced here: the first
  call of a layout kernel in a graph (``Hardware.first_call_s``), which the cost pass counts
  once per graph for the model's own nodes;
- ``emit``: the function that inserts the step into a rank-local graph (functional
  collectives, ``torch.ops._c10d_functional.*`` followed by ``wait_tensor``, or local ops);
- ``label`` and ``short``: how reports print it;
- ``adjoint``: the steps that carry the gradient back through the step in a training graph
  (:mod:`autotp.passes.adjoints`; all-reduce <-> identity, all-gather <-> slice,
  reduce-scatter <-> all-gather, all-to-all <-> all-to-all).

The route from one placement to another (which steps, on which dims) is
:func:`autotp.base.reshard.reshard_steps`. Adding a collective: a kind there, a row here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import sympy
import torch
import torch.fx as fx

from autotp.base.placements import Placement, Replicate, Shard
from autotp.base.reshard import ReshardKind, ReshardStep, reshard_steps
from autotp.base.shapes import concrete_shape, concrete_size
from autotp.cost_model import Hardware, collective_time_s, compute_time_s, group_spans_nodes
from autotp.cost_model.compute import launches_no_kernel
from autotp.cost_model.runtime import view_time_s
from autotp.cost_model.symbolic import symbolic_collective_time_s, symbolic_compute_time_s
from autotp.passes.rules import LocalGraph
from autotp.passes.uneven import largest_shard_nbytes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = [
    "NUMERIC",
    "RESHARD_TABLE",
    "SYMBOLIC",
    "Formulas",
    "Layout",
    "LayoutOp",
    "PartBytes",
    "StepSpec",
    "is_collective_step",
    "is_local_reshard",
    "layout_node_s",
    "route_label",
    "step_label",
    "step_time_terms",
    "tensor_route_time_s",
]

Emit = Callable[[LocalGraph, fx.Node, fx.Node, ReshardStep], fx.Node]
"""``emit(builder, x, producer, step)``: the node holding ``x`` (the value of ``producer`` on this
rank) after ``step``."""

LayoutOp = tuple[object, Any, Any]
"""``(op, bytes, count)``: ``count`` nodes of ``op``, each reading and writing ``bytes`` in all (0: a view, or a
call that returns its input). ``bytes`` and ``count`` are sympy expressions where the sizes are."""

Layout = Callable[[ReshardStep, "PartBytes"], tuple[LayoutOp, ...]]
"""``layout(step, parts)``: the local ops the step's rewrite emits on the busiest rank (rank 0; a zero-fill's
other ranks) besides its collective and the collective's wait, in the order it emits them."""


@dataclasses.dataclass(frozen=True)
class Formulas:
    """The cost-model functions a step's price calls, on numbers or on sympy expressions."""

    compute_time_s: Callable[[Any, Any, torch.dtype, Hardware], Any]
    collective_time_s: Callable[..., Any]  # (kind, nbytes, group_size, hardware, *, spans_nodes, dtype)


NUMERIC = Formulas(compute_time_s, collective_time_s)
"""Seconds as floats: :func:`autotp.cost_model.compute_time_s`, :func:`autotp.cost_model.collective_time_s`."""

SYMBOLIC = Formulas(symbolic_compute_time_s, symbolic_collective_time_s)
"""Seconds as sympy expressions: the same formulas in :mod:`autotp.cost_model.symbolic`."""


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One row of :data:`RESHARD_TABLE` (see the module docstring)."""

    collective: str | None
    exchanged: Callable[[PartBytes], Any]
    """The bytes the collective is priced on, from the tensor's :class:`PartBytes` (unused by a local step)."""
    layout: Layout
    emit: Emit
    label: str
    short: str
    adjoint: Callable[[ReshardStep], tuple[ReshardStep, ...]]
    """The steps that carry a gradient back through this step in a training graph (empty: the
    identity), under the gradient convention of :mod:`autotp.passes.adjoints`."""


# --------------------------------------------------------------------------- prices

@dataclasses.dataclass(frozen=True)
class PartBytes:
    """Bytes of one tensor and of its ranks' parts under a step's split, by ``largest_shard_nbytes``'s rule for
    a tensor alone: each block's ``size`` elements dealt out so that the first ``size % world_size`` ranks hold
    one more (rank 0 the largest part).

    ``whole``: the tensor; ``big`` and ``small``: the largest and a smaller rank's part; ``smaller_ranks``: how
    many ranks hold the smaller (0: an even split); ``uneven``: 1 where any does, else 0; ``to_big``: the largest
    part of an all-to-all's ``to_dim``. A symbolic split size gives expressions (``Mod`` in a ``Piecewise``).
    """

    whole: Any
    big: Any
    small: Any
    smaller_ranks: Any
    uneven: Any
    to_big: Any
    world_size: int

    @classmethod
    def of(cls, step: ReshardStep, shape: Sequence[Any], itemsize: int, world_size: int) -> PartBytes:
        """The parts of a tensor of ``shape`` (ints, ``torch.SymInt`` at their example size, or sympy sizes)."""
        sizes = [size if isinstance(size, sympy.Basic) else concrete_size(size) for size in shape]
        whole = largest_shard_nbytes(sizes, itemsize, Replicate(), world_size)
        if step.dim is None or not sizes:
            return cls(whole, whole, whole, 0, 0, whole, world_size)
        dim = step.dim % len(sizes)
        big = largest_shard_nbytes(sizes, itemsize, step.split, world_size)
        to_big = big if step.to_dim is None else largest_shard_nbytes(sizes, itemsize, Shard(step.to_dim), world_size)
        row = itemsize * math.prod(size for i, size in enumerate(sizes) if i != dim)  # bytes per element of dim
        small = big - row * step.blocks
        if isinstance(sizes[dim], sympy.Basic) and not sizes[dim].is_Integer:
            extra = sympy.Mod(sympy.floor(sizes[dim] / step.blocks), world_size)
            uneven = sympy.Piecewise((1, sympy.Ne(extra, 0)), (0, True))
            return cls(whole, big, small, uneven * (world_size - extra), uneven, to_big, world_size)
        extra = (int(sizes[dim]) // step.blocks) % world_size
        if extra == 0:
            return cls(whole, big, big, 0, 0, to_big, world_size)
        return cls(whole, big, small, world_size - extra, 1, to_big, world_size)


def _exchanged_whole(parts: PartBytes) -> Any:
    """An all-reduce's tensor."""
    return parts.whole


def _exchanged_padded(parts: PartBytes) -> Any:
    """An all-gather's or reduce-scatter's tensor, every rank's part padded to the largest."""
    return parts.world_size * parts.big


def _exchanged_part(parts: PartBytes) -> Any:
    """What one rank sends in an all-to-all: its part, padded to the largest."""
    return parts.big


_VIEW: Any = 0
"""The bytes of a view (or of a call that returns its input)."""


def _slice_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    """A narrow; of every block with ``blocks`` > 1, the pieces then put side by side (a copy of the part)."""
    if step.blocks == 1:
        return ((aten.narrow.default, _VIEW, 1),)
    return ((aten.narrow.default, _VIEW, step.blocks), (aten.cat.default, 2 * parts.big, 1))


def _zero_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    """The zeros the ranks other than 0 write in place of the value."""
    return ((aten.zeros_like.default, parts.whole, 1),)


def _no_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    return ()


def _all_gather_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    """:func:`_emit_all_gather` on rank 0, whose part needs no padding: the dim moved to the front and the part
    laid out (a dim-0 part is already, and the call returns it); the gathered parts cut out of their padding and
    put in block order when they are uneven or blocked; the dim moved back and the whole tensor laid out."""
    front = step.dim != 0
    ops: tuple[LayoutOp, ...] = ((aten.movedim.int, _VIEW, 1),) if front else ()
    ops += ((aten.contiguous.default, 2 * parts.big if front else _VIEW, 1),)
    pieces = 1 if step.blocks > 1 else parts.uneven
    ops += ((aten.narrow.default, _VIEW, pieces * step.blocks * parts.world_size),
            (aten.cat.default, 2 * parts.whole, pieces))
    if front:
        ops += ((aten.movedim.int, _VIEW, 1), (aten.contiguous.default, 2 * parts.whole, 1))
    return ops


def _reduce_scatter_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    """:func:`_emit_reduce_scatter` on rank 0: the dim moved to the front; uneven parts cut apart, the smaller
    padded to the largest and put together (laid out by that copy), else the tensor laid out; after the
    reduce-scatter the dim moved back and rank 0's part laid out."""
    front = step.dim != 0
    ops: tuple[LayoutOp, ...] = ((aten.movedim.int, _VIEW, 1),) if front else ()
    even = 1 - parts.uneven
    ops += ((aten.narrow.default, _VIEW, parts.uneven * parts.world_size),
            (aten.constant_pad_nd.default, parts.small + parts.big, parts.smaller_ranks),
            (aten.cat.default, 2 * parts.world_size * parts.big, parts.uneven),
            (aten.contiguous.default, _VIEW, parts.uneven),
            (aten.contiguous.default, 2 * parts.whole if front else _VIEW, even))
    if front:
        ops += ((aten.movedim.int, _VIEW, 1), (aten.contiguous.default, 2 * parts.big, 1))
    return ops


def _all_to_all_layout(step: ReshardStep, parts: PartBytes) -> tuple[LayoutOp, ...]:
    """:func:`_emit_all_to_all` on rank 0, whose ``dim`` part needs no padding: ``to_dim`` moved to the front and
    the part laid out (already, when ``to_dim`` is 0); parts of one width put in place by one copy
    (:func:`_put_pieces_in_place`; where the permuted pieces happen to be laid out already, one row per source and
    nothing between ``to_dim`` and ``dim``, its copy costs nothing and is priced as one); uneven ones cut out (once
    more where a source's part was padded) and put side by side, ``to_dim`` moved back and the new part laid out."""
    front = step.to_dim != 0
    uneven, even = parts.uneven, 1 - parts.uneven
    return ((aten.movedim.int, _VIEW, 1),
            (aten.contiguous.default, 2 * parts.big if front else _VIEW, 1),
            (aten.unflatten.int, _VIEW, even),
            (aten.permute.default, _VIEW, even),
            (aten.contiguous.default, 2 * parts.to_big, even),
            (aten.flatten.using_ints, _VIEW, even),
            (aten.narrow.default, _VIEW, uneven * (parts.world_size + parts.smaller_ranks)),
            (aten.cat.default, 2 * parts.to_big, uneven),
            (aten.movedim.int, _VIEW, uneven),
            (aten.contiguous.default, 2 * parts.to_big if front else _VIEW, uneven))


def layout_node_s(op: object, nbytes: Any, dtype: torch.dtype, hardware: Hardware, formulas: Formulas = NUMERIC
                  ) -> Any:
    """One node that moves data and does no arithmetic (a step's layout, the ops an op's rank-local form adds),
    priced as the cost pass prices a graph's node: a view's dispatch for a view (or a call that moves nothing),
    else a memory-bound kernel moving ``nbytes``."""
    if launches_no_kernel(op) or (not isinstance(nbytes, sympy.Basic) and nbytes == 0):
        return view_time_s(hardware)
    return formulas.compute_time_s(0, nbytes, dtype, hardware)


def _collective_s(formulas: Formulas, kind: str, nbytes: Any, world_size: int, hardware: Hardware,
                  dtype: torch.dtype) -> Any:
    """A collective of ``dtype`` over the tensor-parallel group of ``world_size`` consecutive ranks: on the
    inter-node link (or hierarchically) when the group is bigger than a node."""
    spans = group_spans_nodes(world_size, hardware.devices_per_node)
    return formulas.collective_time_s(kind, nbytes, world_size, hardware, spans_nodes=spans, dtype=dtype)


def step_time_terms(step: ReshardStep, shape: Sequence[Any], dtype: torch.dtype, world_size: int,
                    hardware: Hardware, *, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    """Predicted seconds of ``step`` on a tensor of ``shape``, term by term: its collective (if any), then each
    node of its layout (:data:`Layout`) priced as the cost pass prices a graph's node. A collective step at world
    size 1 costs nothing (the rewrite leaves a one-rank graph as traced)."""
    spec = RESHARD_TABLE[step.kind]
    if spec.collective is not None and world_size == 1:
        return ()
    parts = PartBytes.of(step, shape, dtype.itemsize, world_size)
    terms: tuple[Any, ...] = ()
    if spec.collective is not None:
        terms += (_collective_s(formulas, spec.collective, spec.exchanged(parts), world_size, hardware, dtype),)
    for op, nbytes, count in spec.layout(step, parts):
        if isinstance(count, sympy.Basic) or count:
            terms += (count * layout_node_s(op, nbytes, dtype, hardware, formulas),)
    return terms


# --------------------------------------------------------------------------- rewrite

def _emit_slice(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    """Keep this rank's part of dim ``step.dim`` (of every block, with ``step.blocks`` > 1)."""
    dim, blocks = step.dim, step.blocks
    offset, length = b.parts.local(producer.name, dim, b.rank, blocks)
    if blocks == 1:
        return b.call(aten.narrow.default, x, dim, offset, length, meta_from=producer)
    block = concrete_shape(producer.meta["val"])[dim] // blocks
    pieces = [b.call(aten.narrow.default, x, dim, k * block + offset, length, meta_from=producer) for k in range(blocks)]
    return b.call(aten.cat.default, pieces, dim, meta_from=producer)


def _emit_zero(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    """Rank 0 keeps the value, the others hold zeros: the ranks' sum is the value."""
    return x if b.rank == 0 else b.call(aten.zeros_like.default, x, meta_from=producer)


def _emit_all_reduce(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    reduced = b.call(c10d.all_reduce.default, x, "sum", b.group_name, meta_from=producer)
    return b.call(c10d.wait_tensor.default, reduced, meta_from=producer)


def _emit_all_gather(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    """Gather along ``dim``: pad each rank's part to the largest, gather on dim 0, cut out the padding.

    With ``blocks`` > 1 each rank's part holds its slice of every block; the pieces are
    put back in block order.
    """
    dim, blocks = step.dim, step.blocks
    ndim = producer.meta["val"].dim()
    sizes = b.parts.sizes(producer.name, dim, blocks)
    chunk = blocks * max(sizes)
    if dim != 0:
        x = b.call(aten.movedim.int, x, dim, 0, meta_from=producer)
    x = b.call(aten.contiguous.default, x, meta_from=producer)
    mine = blocks * sizes[b.rank]
    if mine != chunk:
        x = b.call(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1) + [0, chunk - mine], 0.0, meta_from=producer)
    gathered = b.call(c10d.all_gather_into_tensor.default, x, b.world_size, b.group_name, meta_from=producer)
    x = b.call(c10d.wait_tensor.default, gathered, meta_from=producer)
    if len(set(sizes)) > 1 or blocks > 1:
        pieces = [
            b.call(aten.narrow.default, x, 0, r * chunk + k * sizes[r], sizes[r], meta_from=producer)
            for k in range(blocks) for r in range(b.world_size)
        ]
        x = b.call(aten.cat.default, pieces, 0, meta_from=producer)
    if dim != 0:
        # back in place, and contiguous: a consumer's view() needs the layout it was traced with
        x = b.call(aten.movedim.int, x, 0, dim, meta_from=producer)
        x = b.call(aten.contiguous.default, x, meta_from=producer)
    return x


def _emit_reduce_scatter(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    """Sum and keep this rank's part of ``dim``: parts padded to the largest, scattered on dim 0."""
    dim = step.dim
    ndim = producer.meta["val"].dim()
    sizes = b.parts.sizes(producer.name, dim)
    block = max(sizes)
    if dim != 0:
        x = b.call(aten.movedim.int, x, dim, 0, meta_from=producer)
    if len(set(sizes)) > 1:
        padded = []
        for r in range(b.world_size):
            piece = b.call(aten.narrow.default, x, 0, sum(sizes[:r]), sizes[r], meta_from=producer)
            if sizes[r] != block:
                piece = b.call(aten.constant_pad_nd.default, piece, [0, 0] * (ndim - 1) + [0, block - sizes[r]], 0.0,
                               meta_from=producer)
            padded.append(piece)
        x = b.call(aten.cat.default, padded, 0, meta_from=producer)
    x = b.call(aten.contiguous.default, x, meta_from=producer)
    scattered = b.call(c10d.reduce_scatter_tensor.default, x, "sum", b.world_size, b.group_name, meta_from=producer)
    x = b.call(c10d.wait_tensor.default, scattered, meta_from=producer)
    if sizes[b.rank] != block:
        x = b.call(aten.narrow.default, x, 0, 0, sizes[b.rank], meta_from=producer)
    if dim != 0:
        # back in place, and contiguous: a consumer's view() needs the layout it was traced with
        x = b.call(aten.movedim.int, x, 0, dim, meta_from=producer)
        x = b.call(aten.contiguous.default, x, meta_from=producer)
    return x


def _put_pieces_in_place(b: LocalGraph, x: fx.Node, producer: fx.Node, i: int, j: int, ndim: int, mine: int
                         ) -> fx.Node:
    """The received ``(p * mine, ...)`` (``j`` in front, every source's ``i``-slice one width) as the tensor in its
    dims' order with ``j`` this rank's ``mine`` and ``i`` whole: the sources split off ``j``'s rows as a dim of
    their own, every dim put in place with the sources just before ``i`` and laid out (the one copy, contiguous:
    a consumer's view() needs the layout it was traced with), the two merged (a view)."""
    y = b.call(aten.unflatten.int, x, 0, [b.world_size, mine], meta_from=producer)
    # y's dims: the source, this rank's rows of j, then the other dims in order
    position = {d: 1 if d == j else 2 + (d if d < j else d - 1) for d in range(ndim)}
    order = [axis for d in range(ndim) for axis in ((0, position[d]) if d == i else (position[d],))]
    y = b.call(aten.permute.default, y, order, meta_from=producer)
    y = b.call(aten.contiguous.default, y, meta_from=producer)
    return b.call(aten.flatten.using_ints, y, i, i + 1, meta_from=producer)


def _pad_dim(b: LocalGraph, x: fx.Node, producer: fx.Node, dim: int, ndim: int, amount: int) -> fx.Node:
    """Append ``amount`` zeros to the end of ``dim`` (of ``ndim`` dims)."""
    if amount == 0:
        return x
    return b.call(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1 - dim) + [0, amount], 0.0, meta_from=producer)


def _emit_all_to_all(b: LocalGraph, x: fx.Node, producer: fx.Node, step: ReshardStep) -> fx.Node:
    """``S(i) -> S(j)``: rank r sends rank q the part of its ``i``-slice that lies in q's ``j``-slice.

    The ``j`` dim goes to the front, so the pieces to send are consecutive rows (split sizes: the
    ``j`` partition, uneven included); the ``i`` dim is padded to the largest rank's part so that
    every received piece has one shape. Rank r receives ``p`` pieces of ``sizes_j[r]`` rows, one
    per source rank q, which hold q's ``i``-slice: they are cut to ``sizes_i[q]`` and put side by
    side along ``i``, and ``j`` goes back in place.
    """
    i, j = step.dim, step.to_dim
    ndim = producer.meta["val"].dim()
    sizes_i = b.parts.sizes(producer.name, i)
    sizes_j = b.parts.sizes(producer.name, j)
    widest = max(sizes_i)
    i_front = i + 1 if i < j else i  # where dim i is once dim j is moved to the front
    # (batch, ..., local i, ..., whole j, ...) -> (whole j, ..., padded i, ...)
    x = b.call(aten.movedim.int, x, j, 0, meta_from=producer)
    x = _pad_dim(b, x, producer, i_front, ndim, widest - sizes_i[b.rank])
    x = b.call(aten.contiguous.default, x, meta_from=producer)
    mine = sizes_j[b.rank]
    exchanged = b.call(c10d.all_to_all_single.default, x, [mine] * b.world_size, list(sizes_j), b.group_name,
                       meta_from=producer)
    x = b.call(c10d.wait_tensor.default, exchanged, meta_from=producer)
    # (p * local j, ..., padded i, ...): source q's piece is rows q*mine.. of q's i-slice
    if len(set(sizes_i)) == 1:  # parts of one width: the pieces go in place by one copy
        return _put_pieces_in_place(b, x, producer, i, j, ndim, mine)
    pieces = []
    for q in range(b.world_size):
        piece = b.call(aten.narrow.default, x, 0, q * mine, mine, meta_from=producer)
        if sizes_i[q] != widest:
            piece = b.call(aten.narrow.default, piece, i_front, 0, sizes_i[q], meta_from=producer)
        pieces.append(piece)
    x = b.call(aten.cat.default, pieces, i_front, meta_from=producer)
    # back in place, and contiguous: a consumer's view() needs the layout it was traced with
    x = b.call(aten.movedim.int, x, 0, j, meta_from=producer)
    return b.call(aten.contiguous.default, x, meta_from=producer)


# --------------------------------------------------------------------------- adjoints (training)

def _identity_back(step: ReshardStep) -> tuple[ReshardStep, ...]:
    """An all-reduce (P -> R) or a zero-fill (R -> P): the gradient of the sum is every part's gradient."""
    return ()


def _gather_back(step: ReshardStep) -> tuple[ReshardStep, ...]:
    """A slice (R -> S) or a reduce-scatter (P -> S): the block gradients are gathered back whole."""
    return (ReshardStep(ReshardKind.ALL_GATHER, step.dim, step.blocks),)


def _slice_back(step: ReshardStep) -> tuple[ReshardStep, ...]:
    """An all-gather (S -> R): every rank holds the whole gradient and keeps its block."""
    return (ReshardStep(ReshardKind.SLICE, step.dim, step.blocks),)


def _all_to_all_back(step: ReshardStep) -> tuple[ReshardStep, ...]:
    """``S(i) -> S(j)``: the gradient goes ``S(j) -> S(i)``."""
    return (ReshardStep(ReshardKind.ALL_TO_ALL, step.to_dim, step.blocks, step.dim),)


# --------------------------------------------------------------------------- the table

RESHARD_TABLE: Mapping[ReshardKind, StepSpec] = MappingProxyType({
    ReshardKind.SLICE: StepSpec(None, _exchanged_whole, _slice_layout, _emit_slice, "slice", "slice", _gather_back),
    ReshardKind.ZERO: StepSpec(None, _exchanged_whole, _zero_layout, _emit_zero, "zero", "zero", _identity_back),
    ReshardKind.ALL_REDUCE: StepSpec("all_reduce", _exchanged_whole, _no_layout, _emit_all_reduce, "all_reduce", "AR",
                                     _identity_back),
    ReshardKind.ALL_GATHER: StepSpec("all_gather", _exchanged_padded, _all_gather_layout, _emit_all_gather,
                                     "all_gather", "AG", _slice_back),
    ReshardKind.REDUCE_SCATTER: StepSpec("reduce_scatter", _exchanged_padded, _reduce_scatter_layout,
                                         _emit_reduce_scatter, "reduce_scatter", "RS", _gather_back),
    ReshardKind.ALL_TO_ALL: StepSpec("all_to_all", _exchanged_part, _all_to_all_layout, _emit_all_to_all,
                                     "all_to_all", "A2A", _all_to_all_back),
})


def is_collective_step(kind: ReshardKind | str) -> bool:
    """True for a step that talks to other ranks; False for a local slice or zero-fill."""
    return RESHARD_TABLE[ReshardKind(kind)].collective is not None


def step_label(kind: ReshardKind | str, *, short: bool = False) -> str:
    """How reports print a step kind (``short``: ``AR``, ``AG``, ``RS``, ``A2A``)."""
    spec = RESHARD_TABLE[ReshardKind(kind)]
    return spec.short if short else spec.label


def route_label(kinds: Iterable[ReshardKind | str]) -> str:
    """How reports print a route: its steps' labels joined by ``+`` (``"none"`` for no step)."""
    return "+".join(step_label(kind) for kind in kinds) or "none"


def is_local_reshard(src: Placement, dst: Placement) -> bool:
    """True when ``src -> dst`` needs no communication (a local slice or zero-fill)."""
    return not any(is_collective_step(step.kind) for step in reshard_steps(src, dst))


def tensor_route_time_s(route: Iterable[ReshardStep], shape: Sequence[Any], dtype: torch.dtype, world_size: int,
                        hardware: Hardware, *, formulas: Formulas = NUMERIC) -> Any:
    """Predicted seconds of ``route`` on one tensor of ``shape``: the sum of its steps' terms
    (:func:`step_time_terms`).

    ``shape`` may hold sympy sizes (with ``formulas=SYMBOLIC`` the result is an expression); the cost pass prices
    a traced value's route by this same function (:func:`autotp.passes.costing.route_time_s`).
    """
    total: Any = 0
    for step in route:
        for term in step_time_terms(step, shape, dtype, world_size, hardware, formulas=formulas):
            total += term
    return total
