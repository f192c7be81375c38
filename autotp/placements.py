"""Placements: how one tensor is laid out across the ranks of one mesh axis.

autotp speaks PyTorch's language: ``Shard(dim)``, ``Replicate()`` and ``Partial()`` are the
frozen, hashable placement values of ``torch.distributed.tensor`` (printed ``S(0)``, ``R``,
``P(sum)``). This module adds only the helpers the planner needs to treat them as data: a
stable text form for plans saved as JSON, and a parser for it.

Semantics on a mesh axis of size N:

- ``Replicate()``: every rank holds the whole tensor.
- ``Shard(d)``: rank r holds a contiguous block of dimension ``d``. Blocks may be uneven
  (e.g. 8 heads over 3 ranks gives 3, 3, 2 heads); the rewrite pass decides the sizes so that
  every view of the tensor splits on the same boundaries (see ``passes/partition.py``).
- ``Partial("sum")``: every rank holds a full-shaped tensor; the true value is their sum.
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Partial", "Placement", "Replicate", "Shard", "placement_to_str", "placement_from_str", "shard_dim"]

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")


def shard_dim(placement: Placement) -> int | None:
    """The tensor dimension a ``Shard`` placement splits, or ``None`` for any other placement."""
    if isinstance(placement, Shard):
        return placement.dim
    return None


def placement_to_str(placement: Placement) -> str:
    """Short stable text form: ``R``, ``P``, ``S(1)``."""
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    raise TypeError(f"unsupported placement {placement!r}; autotp uses Shard(dim), Replicate() and Partial()")


def placement_from_str(text: str) -> Placement:
    """Parse the text form written by :func:`placement_to_str`."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text in ("P", "P(sum)"):
        return Partial()
    match = _SHARD_RE.match(text)
    if match:
        return Shard(int(match.group(1)))
    raise ValueError(f"cannot parse placement {text!r}; expected 'R', 'P' or 'S(<dim>)', e.g. 'S(0)'")
