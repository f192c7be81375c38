"""Resharding steps: what turns one placement of a tensor into another on one mesh axis.

A step is a small frozen value, :class:`ReshardStep`: its :class:`ReshardKind` and the dims it
acts on. :func:`reshard_steps` gives the route from ``src`` to ``dst``:

=================  ==================================  =====================================
src -> dst         steps                               why
=================  ==================================  =====================================
R -> S(d)          slice(d)                            each rank keeps its part (a view)
R -> P             zero                                rank 0 keeps the value, others zeros
P -> R             all_reduce                          sum the ranks' parts
P -> S(d)          reduce_scatter(d)                   sum, each rank keeps its part
P -> S(d)xk        all_reduce, slice(d, k)             (no block-wise reduce-scatter)
S(d) -> R          all_gather(d)                       (S(d)xk too: gathered block by block)
S(i) -> S(j)       all_to_all(i -> j)                  each rank sends every other rank its
                   (or all_gather(i), slice(j))        part of the other rank's j-slice
S(i)xk <-> S(j)    all_gather(i), slice(j)             blocks: gather, then cut locally
S -> P             all_gather, zero
P(experts) -> P    nothing                             an expert-placed sum is a sum
P(experts) -> *    as from P                           (all_reduce, reduce_scatter...)
* -> P(experts)    impossible                          only an expert-placed op makes one
P(experts), R      nothing                             their rows are right on every rank that
 -> L(experts)                                         holds their expert already
L(experts) -> *    impossible                          only an expert-placed op reads one
* -> L(experts)    impossible                          (from a split or a plain Partial)
S(local) <-> *     impossible                          rank-local values: only the token-local
S(routed) <-> *                                        ops of a routed block make and read them
=================  ==================================  =====================================

``S(i) -> S(j)`` between plain shards has two routes (:func:`reshard_routes`): the all-to-all
moves ``(p-1)/p`` of one rank's shard where the all-gather moves ``(p-1)/p`` of the whole
tensor and then drops most of it, but it needs a copy of the shard on each side (the pieces
laid out to send, the received ones put together), which can cost more than the saved bytes
for a small tensor gathered along dim 0. The cost pass prices both and takes the cheaper; the
plan records the chosen steps and the rewrite applies them (:func:`route_with_kinds`).

How each kind is priced, emitted in the rank-local graph and printed is one table,
:data:`autotp.passes.resharding.RESHARD_TABLE`. The kinds' values (``"all_reduce"``...) are
their names in saved plans.
"""

from __future__ import annotations

import dataclasses
import enum

from autotp.base.placements import (
    BlockShard,
    ExpertLocal,
    ExpertPartial,
    Partial,
    Placement,
    Replicate,
    Shard,
    is_rank_local,
    split_of,
)

__all__ = ["ReshardKind", "ReshardStep", "Route", "reshard_possible", "reshard_routes", "reshard_steps",
           "route_with_kinds"]


class ReshardKind(enum.StrEnum):
    """The kinds of resharding step; the value is the name saved in plan files (and what ``str`` and ``format``
    give)."""

    SLICE = "slice"
    ZERO = "zero"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"

    def __hash__(self) -> int:  # equal to its name, so hash like it: "all_reduce" and the kind are one key
        return hash(self.value)

    @classmethod
    def from_name(cls, name: str) -> ReshardKind:
        """The kind saved as ``name`` in a plan file (ValueError naming the valid names otherwise)."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(kind.value for kind in cls)
            raise ValueError(f"unknown resharding step {name!r}; valid steps: {valid}") from None


@dataclasses.dataclass(frozen=True)
class ReshardStep:
    """One step of a resharding route.

    ``dim`` and ``blocks``: the split dim the step gathers, scatters or slices (``blocks`` > 1 for
    a ``BlockShard``); for an all-to-all, the dim that is split before (``dim``) and the one split
    after (``to_dim``). ``None`` for all-reduce and zero-fill.
    """

    kind: ReshardKind
    dim: int | None = None
    blocks: int = 1
    to_dim: int | None = None

    @property
    def split(self) -> Placement | None:
        """The split placement the step gathers from, scatters to or slices to (``None`` if none)."""
        if self.dim is None:
            return None
        return Shard(self.dim) if self.blocks == 1 else BlockShard(self.dim, self.blocks)

    def __str__(self) -> str:
        return str(self.kind)


def _on(kind: ReshardKind, placement: Placement) -> ReshardStep:
    split = split_of(placement)
    if split is None:
        raise AssertionError(f"{kind} needs a split placement, got {placement}")
    return ReshardStep(kind, split[0], split[1])


Route = tuple[ReshardStep, ...]


def reshard_routes(src: Placement, dst: Placement) -> tuple[Route, ...]:
    """Every route from ``src`` to ``dst``, the default first (module table).

    ``S(i) -> S(j)`` has two: the all-to-all, and the all-gather then slice; the cost pass takes
    the cheaper (:func:`autotp.passes.costing.reshard_route`) and the plan records which.
    """
    first = reshard_steps(src, dst)
    if len(first) == 1 and first[0].kind is ReshardKind.ALL_TO_ALL:
        return first, (_on(ReshardKind.ALL_GATHER, src), _on(ReshardKind.SLICE, dst))
    return (first,)


def route_with_kinds(src: Placement, dst: Placement, kinds: tuple[ReshardKind | str, ...]) -> Route:
    """The route from ``src`` to ``dst`` whose steps are of ``kinds`` (as a plan records them).

    ValueError naming the possible routes when there is none (a plan edited by hand).
    """
    routes = reshard_routes(src, dst)
    wanted = tuple(ReshardKind.from_name(str(kind)) for kind in kinds)
    for route in routes:
        if tuple(step.kind for step in route) == wanted:
            return route
    possible = " or ".join("+".join(str(step.kind) for step in route) or "nothing" for route in routes)
    raise ValueError(f"no resharding {src} -> {dst} takes the steps {'+'.join(map(str, wanted)) or 'nothing'}; "
                     f"possible: {possible}")


def reshard_possible(src: Placement, dst: Placement) -> bool:
    """False where no steps turn ``src`` into ``dst``: into ``P(experts)`` from anything else (its rows lie on
    the ranks of their experts, which only the expert-placed op itself knows); out of ``L(experts)`` (its other
    rows are not known anywhere), and into it but from ``P(experts)`` or ``R``; into or out of ``S(local)`` and
    ``S(routed)`` (values of one rank's own tokens, in its own order: no block of the whole tensor)."""
    if src == dst:
        return True
    if is_rank_local(src) or is_rank_local(dst):
        return False
    if isinstance(dst, ExpertLocal):
        return isinstance(src, (ExpertPartial, Replicate))
    return not isinstance(dst, ExpertPartial) and not isinstance(src, ExpertLocal)


def reshard_steps(src: Placement, dst: Placement) -> Route:
    """The default steps that turn placement ``src`` into ``dst`` on one mesh axis (module table)."""
    if src == dst:
        return ()
    if not reshard_possible(src, dst):
        if is_rank_local(src) or is_rank_local(dst):
            raise ValueError(f"cannot reshard {src} -> {dst}: a rank-local value of a routed block is made and read only "
                             "by the block's token-local ops")
        if isinstance(src, ExpertLocal):
            raise ValueError(f"cannot reshard {src} -> {dst}: only an expert-placed op reads {src}")
        raise ValueError(f"cannot reshard {src} -> {dst}: only an expert-placed op makes {dst}")
    if isinstance(dst, ExpertLocal):  # from P(experts) or R: the rows are right where their experts are
        return ()
    if isinstance(src, ExpertPartial):
        if isinstance(dst, Partial):
            return ()
        src = Partial()
    src_split, dst_split = split_of(src), split_of(dst)
    if isinstance(src, Replicate):
        return (_on(ReshardKind.SLICE, dst),) if dst_split else (ReshardStep(ReshardKind.ZERO),)
    if isinstance(src, Partial):
        if dst_split and dst_split[1] == 1:
            return (_on(ReshardKind.REDUCE_SCATTER, dst),)
        all_reduce = ReshardStep(ReshardKind.ALL_REDUCE)
        return (all_reduce, _on(ReshardKind.SLICE, dst)) if dst_split else (all_reduce,)
    if src_split is None:
        raise ValueError(f"cannot reshard from {src}")
    gather = _on(ReshardKind.ALL_GATHER, src)
    if isinstance(dst, Replicate):
        return (gather,)
    if dst_split:
        if src_split[1] == 1 and dst_split[1] == 1:
            return (ReshardStep(ReshardKind.ALL_TO_ALL, src_split[0], 1, dst_split[0]),)
        return (gather, _on(ReshardKind.SLICE, dst))
    return (gather, ReshardStep(ReshardKind.ZERO))
