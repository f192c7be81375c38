"""Resharding steps: one table from each step kind to its price, its rewrite and its name.

:data:`RESHARD_TABLE` maps every :class:`~autotp.base.reshard.ReshardKind` to a
:class:`StepSpec`:

- ``collective``: the collective kind the cost model prices (``collective_time_s``), or
  ``None`` for a local step (a slice, a zero-fill);
- ``time_terms``: the step's predicted seconds, term by term (the collective, the local copies
  the rewrite makes around it), each traceable to a formula of ``autotp.cost_model``;
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx

from autotp.base.placements import Placement, Replicate
from autotp.base.reshard import ReshardKind, ReshardStep, reshard_steps
from autotp.base.shapes import concrete_shape
from autotp.cost_model import Hardware, collective_time_s, compute_time_s, group_spans_nodes
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
    "StepSpec",
    "is_collective_step",
    "is_local_reshard",
    "route_label",
    "step_label",
    "tensor_route_time_s",
]

Emit = Callable[[LocalGraph, fx.Node, fx.Node, ReshardStep], fx.Node]
"""``emit(builder, x, producer, step)``: the node holding ``x`` (the value of ``producer`` on this
rank) after ``step``."""

TimeTerms = Callable[..., tuple[Any, ...]]
"""``time_terms(step, whole_nbytes, shard_nbytes, dtype, world_size, hardware, formulas=NUMERIC)``: the
step's predicted seconds, term by term. ``shard_nbytes``: bytes of the largest rank's part under
``step.split`` (the whole tensor when the step has no split). ``formulas`` says which functions of
the cost model price the terms: :data:`NUMERIC` (numbers, the planner) or :data:`SYMBOLIC` (sympy
expressions of batch and sequence, :mod:`autotp.cost_model.symbolic`), so the sizes may be sympy
expressions and one row serves both."""


@dataclasses.dataclass(frozen=True)
class Formulas:
    """The cost-model functions a row's time terms call, on numbers or on sympy expressions."""

    compute_time_s: Callable[[Any, Any, torch.dtype, Hardware], Any]
    collective_time_s: Callable[..., Any]  # (kind, nbytes, group_size, hardware, *, spans_nodes)


NUMERIC = Formulas(compute_time_s, collective_time_s)
"""Seconds as floats: :func:`autotp.cost_model.compute_time_s`, :func:`autotp.cost_model.collective_time_s`."""

SYMBOLIC = Formulas(symbolic_compute_time_s, symbolic_collective_time_s)
"""Seconds as sympy expressions: the same formulas in :mod:`autotp.cost_model.symbolic`."""


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One row of :data:`RESHARD_TABLE` (see the module docstring)."""

    collective: str | None
    time_terms: TimeTerms
    emit: Emit
    label: str
    short: str
    adjoint: Callable[[ReshardStep], tuple[ReshardStep, ...]]
    """The steps that carry a gradient back through this step in a training graph (empty: the
    identity), under the gradient convention of :mod:`autotp.passes.adjoints`."""


# --------------------------------------------------------------------------- prices

def _copy_s(nbytes: Any, dtype: torch.dtype, hardware: Hardware, formulas: Formulas) -> Any:
    """One copy of ``nbytes`` (read once, written once): a roofline memory term."""
    return formulas.compute_time_s(0, 2 * nbytes, dtype, hardware)


def _collective_s(formulas: Formulas, kind: str, nbytes: Any, world_size: int, hardware: Hardware) -> Any:
    """A collective over the tensor-parallel group of ``world_size`` consecutive ranks: on the
    inter-node link (or hierarchically) when the group is bigger than a node."""
    spans = group_spans_nodes(world_size, hardware.devices_per_node)
    return formulas.collective_time_s(kind, nbytes, world_size, hardware, spans_nodes=spans)


def _slice_terms(step: ReshardStep, whole: Any, shard: Any, dtype: torch.dtype, world_size: int,
                 hardware: Hardware, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    return (view_time_s(hardware),)  # a narrow: no data moves, only the host's dispatch (eager)


def _zero_terms(step: ReshardStep, whole: Any, shard: Any, dtype: torch.dtype, world_size: int,
                hardware: Hardware, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    return (formulas.compute_time_s(0, whole, dtype, hardware),)  # writing zeros on ranks != 0


def _all_reduce_terms(step: ReshardStep, whole: Any, shard: Any, dtype: torch.dtype, world_size: int,
                      hardware: Hardware, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    return (_collective_s(formulas, "all_reduce", whole, world_size, hardware),)


def _gather_scatter_terms(step: ReshardStep, whole: Any, shard: Any, dtype: torch.dtype, world_size: int,
                          hardware: Hardware, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    """The all-gather (reduce-scatter) of the whole tensor; along a dim other than 0 also the two
    copies the rewrite makes around it (the dim is moved to the front and made contiguous, then
    moved back and made contiguous again): the shard and the whole tensor, each copied once."""
    kind = RESHARD_TABLE[step.kind].collective
    terms: tuple[Any, ...] = (_collective_s(formulas, kind, whole, world_size, hardware),)  # type: ignore[arg-type]
    if world_size > 1 and step.dim not in (None, 0):
        terms += (_copy_s(shard, dtype, hardware, formulas), _copy_s(whole, dtype, hardware, formulas))
    return terms


def _all_to_all_terms(step: ReshardStep, whole: Any, shard: Any, dtype: torch.dtype, world_size: int,
                      hardware: Hardware, formulas: Formulas = NUMERIC) -> tuple[Any, ...]:
    """The all-to-all of one rank's shard (what each rank sends and receives), and the two copies
    of a shard around it (laying out the pieces to send, putting the received pieces together)."""
    if world_size == 1:
        return ()
    return (_collective_s(formulas, "all_to_all", shard, world_size, hardware),
            _copy_s(shard, dtype, hardware, formulas), _copy_s(shard, dtype, hardware, formulas))


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
    ReshardKind.SLICE: StepSpec(None, _slice_terms, _emit_slice, "slice", "slice", _gather_back),
    ReshardKind.ZERO: StepSpec(None, _zero_terms, _emit_zero, "zero", "zero", _identity_back),
    ReshardKind.ALL_REDUCE: StepSpec("all_reduce", _all_reduce_terms, _emit_all_reduce, "all_reduce", "AR", _identity_back),
    ReshardKind.ALL_GATHER: StepSpec("all_gather", _gather_scatter_terms, _emit_all_gather, "all_gather", "AG", _slice_back),
    ReshardKind.REDUCE_SCATTER: StepSpec("reduce_scatter", _gather_scatter_terms, _emit_reduce_scatter,
                                         "reduce_scatter", "RS", _gather_back),
    ReshardKind.ALL_TO_ALL: StepSpec("all_to_all", _all_to_all_terms, _emit_all_to_all, "all_to_all", "A2A", _all_to_all_back),
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
    """Predicted seconds of ``route`` on one tensor of ``shape``: the sum of its steps' table terms.

    ``shape`` may hold sympy sizes (with ``formulas=SYMBOLIC`` the result is an expression); the
    shard a step works on is sized by :func:`autotp.passes.uneven.largest_shard_nbytes`, as the
    cost pass sizes it (:func:`autotp.passes.costing.route_time_s`, for FakeTensor values).
    """
    whole = largest_shard_nbytes(shape, dtype.itemsize, Replicate(), world_size)
    total: Any = 0
    for step in route:
        split = step.split
        shard = largest_shard_nbytes(shape, dtype.itemsize, split, world_size) if split is not None else whole
        for term in RESHARD_TABLE[step.kind].time_terms(step, whole, shard, dtype, world_size, hardware, formulas):
            total += term
    return total
