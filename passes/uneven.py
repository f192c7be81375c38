"""Partition: how many elements of each split dimension each rank holds (uneven splits).

A plan says *which* dims are split (``Shard(d)``); this analysis decides *where* the cuts
fall so that every tensor that shares a split is cut at the same boundaries:

- A *member* is one split dimension of one tensor: ``(node name, dim, blocks)``; for a
  ``BlockShard`` with k blocks the member is one block (``size / k`` elements), and every
  block is cut the same way.
- All ``Shard`` placements in one chosen strategy are the same split of the work (one mesh
  axis), so their members are joined into one *class* (union-find). E.g. the rows of a
  projection weight, the hidden dim of its output, the head dim after the view to
  ``(batch, seq, heads, head_dim)``, and the kv-head dim that grouped-query attention maps
  onto the same fraction of heads, all land in one class.
- Members of a class are proportional images of one interval, so a cut at fraction ``f`` of
  the interval is a cut at ``f * size`` in every member. A cut is valid in a member of size
  ``n`` only at multiples of ``1/n``, so the class is cut into ``U = gcd(member sizes)`` equal
  units, and the units are dealt out as evenly as possible (the first ``U mod N`` ranks get
  one more). For 8 heads (256 = 8 x 32 channels) over 3 ranks: U = 8, heads 3/3/2, channels
  96/96/64. When U < N some ranks hold an empty slice; results stay correct.
- Rank-local rows (``S(local)``, a routed block's tokens sorted by expert on their own rank) are cut like the
  token rows they are computed from: joined to the class of the split rows beside them (a sort, gather or
  un-sort), never to the expert weight a grouped GEMM reads beside them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch.fx as fx

from autotp.base.placements import LocalRows, Placement, share_of, split_of
from autotp.base.shapes import concrete_shape, concrete_size, first_tensor
from autotp.base.strategy import Strategy
from autotp.passes.rules import tensor_inputs

__all__ = ["Partitions", "build_partitions", "largest_shard_nbytes"]

Member = tuple[str, int, int]


def _dim_size(node: fx.Node, dim: int) -> int:
    leaf = first_tensor(node.meta.get("val"))
    return concrete_shape(leaf)[dim] if leaf is not None else 1


def largest_shard_nbytes(shape: Sequence[Any], itemsize: int, placement: Placement, world_size: int) -> Any:
    """Bytes of a tensor of ``shape`` held by the largest rank under ``placement`` over ``world_size`` ranks.

    ``Shard(d)``: ``ceil(size / N)`` of dim ``d``; ``S(d)xk`` (k blocks): ``ceil(size / k / N)``
    of each block; ``Replicate`` and ``Partial``: the whole tensor. This is the planner's one
    notion of a shard's size (parameter memory, bytes moved, the memory budget, reports); it
    looks at one tensor alone, so where a shared split is coarser (e.g. 8 heads of 32
    channels over 3 ranks: 96, 96, 64 channels, see the module docstring) the cuts
    :func:`build_partitions` makes can give the largest rank more than this.

    Sizes are ints (the result is an int) or sympy expressions of symbolic sizes such as
    :data:`autotp.cost_model.symbolic.SEQ` (the result is an expression, with ``ceiling`` where
    a symbolic dim is split), so symbolic estimates size shards by this same rule.
    """
    if any(isinstance(size, sympy.Basic) and not size.is_Integer for size in shape):
        return _symbolic_largest_shard_nbytes([sympy.sympify(size) for size in shape], itemsize, placement, world_size)
    sizes = [concrete_size(s) for s in shape]  # a dynamic (symbolic) size counts at its example size
    numel = math.prod(sizes)
    split = share_of(placement)
    if split is None or not sizes:
        return numel * itemsize
    dim, blocks = split
    size = sizes[dim]
    if size == 0:
        return 0
    return itemsize * (numel // size) * blocks * math.ceil(size // blocks / world_size)


def _symbolic_largest_shard_nbytes(sizes: list[sympy.Expr], itemsize: int, placement: Placement,
                                   world_size: int) -> sympy.Expr:
    """:func:`largest_shard_nbytes` of a shape with symbolic sizes (the same rule, in sympy)."""
    numel = sympy.Mul(*sizes)
    split = share_of(placement)
    if split is None or not sizes:
        return numel * itemsize
    dim, blocks = split
    size = sizes[dim]
    rest = sympy.Mul(*(s for i, s in enumerate(sizes) if i != dim % len(sizes)))
    return itemsize * rest * blocks * sympy.ceiling(sympy.floor(size / blocks) / world_size)


class Partitions:
    """Per-rank sizes and offsets of every split dimension of every tensor in a plan."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._parent: dict[Member, Member] = {}
        self._size: dict[Member, int] = {}
        self._units: dict[Member, int] = {}

    def _find(self, member: Member) -> Member:
        root = member
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[member] != root:  # path compression
            self._parent[member], member = root, self._parent[member]
        return root

    def add(self, member: Member, size: int) -> None:
        if member not in self._parent:
            self._parent[member] = member
            self._size[member] = size
            self._units[member] = size

    def union(self, a: Member, b: Member) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self._parent[rb] = ra
            self._units[ra] = math.gcd(self._units[ra], self._units[rb])

    def splits(self, node: str, dim: int, blocks: int = 1) -> bool:
        """Whether the plan splits ``dim`` (in ``blocks`` blocks) of tensor ``node``."""
        return (node, dim, blocks) in self._parent

    def sizes(self, node: str, dim: int, blocks: int = 1) -> list[int]:
        """Elements of ``dim`` (of one of its ``blocks`` blocks) of tensor ``node`` held by each rank."""
        member = (node, dim, blocks)
        if not self.splits(node, dim, blocks):
            raise KeyError(f"tensor {node} dim {dim} ({blocks} block(s)) is not split in this plan")
        units = self._units[self._find(member)]
        per_unit = self._size[member] // units if units else 0
        base, extra = divmod(units, self.world_size)
        return [(base + (1 if r < extra else 0)) * per_unit for r in range(self.world_size)]

    def local(self, node: str, dim: int, rank: int, blocks: int = 1) -> tuple[int, int]:
        """``(offset, length)`` of rank ``rank``'s part of ``dim`` (within each block) of tensor ``node``."""
        sizes = self.sizes(node, dim, blocks)
        return sum(sizes[:rank]), sizes[rank]


def build_partitions(gm: fx.GraphModule, decisions: dict[str, Strategy], world_size: int) -> Partitions:
    """Join the split dims of every chosen strategy into classes and fix their cuts."""
    parts = Partitions(world_size)
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        strategy = decisions[node.name]
        placed = [(node, strategy.output), *zip(tensor_inputs(node), strategy.inputs)]
        members: list[Member] = []
        rows: list[Member] = []  # rank-local rows (S(local)): cut like the token rows they come from
        for tensor, placement in placed:
            split = split_of(placement)
            if split is not None:
                members.append((tensor.name, *split))
            elif isinstance(placement, LocalRows):
                rows.append((tensor.name, 0, 1))
        for name, dim, blocks in (*members, *rows):
            parts.add((name, dim, blocks), _dim_size(by_name[name], dim) // blocks)
        for other in members[1:]:
            parts.union(members[0], other)
        for other in rows[1:]:
            parts.union(rows[0], other)
        if rows and members and all(_is_token_rows(by_name[name], dim, blocks) for name, dim, blocks in members):
            parts.union(rows[0], members[0])  # a sort, gather or un-sort of the token rows
    return parts


def _is_token_rows(node: fx.Node, dim: int, blocks: int) -> bool:
    """Whether a split member beside rank-local rows is a split of rows (dim 0 of a tensor of at most 2 dims), as
    the tokens of a routed block are; the 3-D expert weight of a grouped GEMM beside them is cut by experts."""
    return dim == 0 and blocks == 1 and len(concrete_shape(first_tensor(node.meta.get("val")))) <= 2
