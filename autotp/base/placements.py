"""Placements: how one tensor is laid out across the ranks of one mesh axis.

autotp speaks PyTorch's language: ``Shard(dim)``, ``Replicate()`` and ``Partial()`` are the
frozen, hashable placement values of ``torch.distributed.tensor`` (printed ``S(0)``, ``R``,
``P(sum)``). This module adds only the helpers the planner needs to treat them as data: a
stable text form for plans saved as JSON, and a parser for it.

Semantics on a mesh axis of size N:

- ``Replicate()``: every rank holds the whole tensor.
- ``Shard(d)``: rank r holds a contiguous block of dimension ``d``. Blocks may be uneven
  (e.g. 8 heads over 3 ranks gives 3, 3, 2 heads); the rewrite pass decides the sizes so that
  every view of the tensor splits on the same boundaries (see ``passes/uneven.py``).
- ``Partial("sum")``: every rank holds a full-shaped tensor; the true value is their sum.
- ``BlockShard(d, k)`` (autotp's one addition): dimension ``d`` is ``k`` equal blocks laid
  end to end (e.g. a fused query/key/value projection) and *each block* is split as by
  ``Shard(d)``; rank r holds its part of every block, concatenated. A later ``split`` into the
  k blocks then yields plain ``Shard(d)`` pieces, so fused projections split by heads.
- ``ExpertPartial()`` (for experts placed whole on ranks): a ``Partial("sum")`` in which every
  element is nonzero on at most one rank, the rank holding the expert its row was routed to
  (zeros elsewhere). Unlike a plain Partial it passes through an elementwise op ``f`` with
  ``f(0) = 0`` (``silu``, ``gelu``, a product of two such values), so a whole expert MLP runs
  between one rank's rows and a single sum after it (:mod:`autotp.passes.rules.experts`).
  It is reduced like a Partial; nothing but an expert-placed op produces it.
- ``ExpertLocal()`` (experts placed, between their GEMMs): every element of a row routed to one of a rank's
  experts is right on that rank; the other rows hold anything. What an expert MLP computes row by row on
  ``P(experts)`` rows (a gate with a bias: ``sigmoid``, ``x + 1``, none of them zero at zero) is right on each
  row's own rank, and the next expert-placed GEMM reads only its own experts' rows. ``P(experts)`` and
  ``Replicate()`` are such values already (nothing to do); nothing turns it into anything else: only an
  expert-placed op reads it.
- ``LocalRows()`` and ``RoutedRows()`` (for experts reached by all-to-all, when the tokens are split
  across the ranks): ``LocalRows`` is a value computed by a rank from its own tokens alone (its rows
  sorted by expert, the positions of that sort, their inverse), in an order of the rank's own, so it is
  no block of the whole tensor; ``RoutedRows`` holds the rows routed to this rank's experts from every
  rank's tokens, grouped by expert. Neither is resharded to or from anything: only the token-local ops
  of a routed block (:mod:`autotp.passes.rules.experts`) make and read them.
"""

from __future__ import annotations

import dataclasses
import re

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "BlockShard", "ExpertLocal", "ExpertPartial", "LocalRows", "Partial", "Placement", "Replicate", "RoutedRows", "Shard",
    "is_partial", "is_rank_local", "placement_from_str", "placement_to_str", "share_of", "split_of",
]

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")
_BLOCK_RE = re.compile(r"^S\((-?\d+)\)x(\d+)$")


@dataclasses.dataclass(frozen=True)
class BlockShard:
    """Dimension ``dim`` is ``blocks`` equal blocks, each split across the ranks (see module doc)."""

    dim: int
    blocks: int

    def __post_init__(self) -> None:
        if self.blocks < 2:
            raise ValueError(f"BlockShard needs blocks >= 2 (got {self.blocks}); use Shard({self.dim}) for one block")

    def __str__(self) -> str:
        return f"S({self.dim})x{self.blocks}"


@dataclasses.dataclass(frozen=True)
class ExpertPartial:
    """A Partial sum whose ranks hold disjoint elements: each row on the rank of its expert (module doc)."""

    def __str__(self) -> str:
        return "P(experts)"


@dataclasses.dataclass(frozen=True)
class ExpertLocal:
    """Rows right on the rank of their expert, anything elsewhere; read only by an expert-placed op (module doc)."""

    def __str__(self) -> str:
        return "L(experts)"


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """A value a rank computed from its own tokens alone, in an order of its own (module doc)."""

    def __str__(self) -> str:
        return "S(local)"


@dataclasses.dataclass(frozen=True)
class RoutedRows:
    """The rows routed to this rank's experts from every rank's tokens, grouped by expert (module doc)."""

    def __str__(self) -> str:
        return "S(routed)"


def is_rank_local(placement: object) -> bool:
    """True for :class:`LocalRows` and :class:`RoutedRows`: values no resharding step can make or read."""
    return isinstance(placement, (LocalRows, RoutedRows))


def is_partial(placement: object) -> bool:
    """True for a pending sum over the ranks: ``Partial()`` or :class:`ExpertPartial`."""
    return isinstance(placement, (Partial, ExpertPartial))


def split_of(placement: object) -> tuple[int, int] | None:
    """``(dim, blocks)`` of a split placement (``Shard`` has one block), ``None`` otherwise."""
    if isinstance(placement, Shard):
        return placement.dim, 1
    if isinstance(placement, BlockShard):
        return placement.dim, placement.blocks
    return None


def share_of(placement: object) -> tuple[int, int] | None:
    """``(dim, blocks)`` of the dim a rank holds a share of, for sizes and work: a split's (:func:`split_of`), and
    dim 0 of rank-local rows (``S(local)``: its own tokens' rows; ``S(routed)``: the rows of its experts, as many in
    expectation under a balanced router), which no resharding step reads as a split."""
    return (0, 1) if is_rank_local(placement) else split_of(placement)


def placement_to_str(placement: Placement | BlockShard) -> str:
    """Short stable text form: ``R``, ``P``, ``S(1)``, ``S(2)x3``, ``P(experts)``, ``S(local)``, ``S(routed)``."""
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, (BlockShard, ExpertPartial, ExpertLocal, LocalRows, RoutedRows)):
        return str(placement)
    raise TypeError(f"unsupported placement {placement!r}; autotp uses Shard(dim), Replicate() and Partial()")


def placement_from_str(text: str) -> Placement | BlockShard:
    """Parse the text form written by :func:`placement_to_str`."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text in ("P", "P(sum)"):
        return Partial()
    if text == "P(experts)":
        return ExpertPartial()
    if text == "L(experts)":
        return ExpertLocal()
    if text == "S(local)":
        return LocalRows()
    if text == "S(routed)":
        return RoutedRows()
    match = _SHARD_RE.match(text)
    if match:
        return Shard(int(match.group(1)))
    match = _BLOCK_RE.match(text)
    if match:
        return BlockShard(int(match.group(1)), int(match.group(2)))
    raise ValueError(f"cannot parse placement {text!r}; expected 'R', 'P', 'P(experts)', 'L(experts)', 'S(local)', 'S(routed)', 'S(<dim>)' or 'S(<dim>)x<blocks>', e.g. 'S(0)'")
