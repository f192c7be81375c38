"""Training graphs: every resharding step with its adjoint, as one autograd-correct node.

The inference rewrite inserts ``torch.ops._c10d_functional.*`` collectives, which have no
autograd formula. For training (``autotp.compile(..., training=True)``) the rewrite instead emits
each resharding route as one node that runs the same steps forward (the rows of
:data:`autotp.passes.resharding.RESHARD_TABLE`, executed eagerly) and their *adjoint* route
backward (the table's ``adjoint`` column, run in reverse order).

**The gradient convention** that makes the adjoints local facts about one step: on every rank,

- the gradient of a ``Replicate`` tensor is the whole true gradient (the same on every rank);
- the gradient of a ``Partial`` tensor is the whole true gradient too (``d(sum of parts)/d part``
  is the gradient of the sum);
- the gradient of a ``Shard`` tensor is this rank's block of the true gradient.

Under it: all-reduce (P -> R) and zero-fill (R -> P) have the identity as adjoint (Megatron's
``g``); all-gather (S -> R) has a local slice, a slice (R -> S) an all-gather; reduce-scatter
(P -> S) an all-gather; all-to-all ``S(i) -> S(j)`` the all-to-all ``S(j) -> S(i)``.

One case is no resharding step: a ``Replicate`` value read by rank-divergent work (an op whose
output is split or partial: a column-split matmul, ``P * R``). Such a consumer's backward gives
only this rank's share of the gradient (a ``Partial`` sum), which breaks the convention. The
rewrite reads such values through :func:`replicated_input` (Megatron's ``f``: identity forward,
all-reduce backward), once per value, shared by all its divergent consumers, so the shares are
summed before they meet the gradients of the replicated consumers. A replicated parameter is
read the same way, so it ends with the full, identical gradient on every rank.

Order: the backward's collectives run in the order autograd's engine reaches these nodes, which
follows their creation order in the forward; every rank's graph has the same nodes in the same
order (only local arithmetic such as an uneven slice differs), so the ranks issue them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autotp.base.reshard import ReshardKind, ReshardStep
from autotp.passes.uneven import Partitions

__all__ = ["REPLICATED_INPUT_ADJOINT", "EagerSteps", "ReshardNode", "adjoint_route"]

REPLICATED_INPUT_ADJOINT: tuple[ReshardStep, ...] = (ReshardStep(ReshardKind.ALL_REDUCE),)
"""Backward of Megatron's ``f`` (a replicated value read by rank-divergent work): sum the ranks' shares."""


def adjoint_route(route: Sequence[ReshardStep]) -> tuple[ReshardStep, ...]:
    """The steps that carry a gradient back through ``route``: each step's adjoint, last step first."""
    from autotp.passes.resharding import RESHARD_TABLE

    out: list[ReshardStep] = []
    for step in reversed(route):
        out.extend(RESHARD_TABLE[step.kind].adjoint(step))
    return tuple(out)


class EagerSteps:
    """The :class:`~autotp.passes.rules.LocalGraph` of one rank that *runs* each op instead of emitting it.

    A row's ``emit(builder, x, producer, step)`` called with this builder and a tensor ``x``
    returns the step's result on this rank, so the forward and the adjoint of a step run the
    table's own code (one place for each step's arithmetic: padding, uneven parts, blocks).
    """

    graph: Any = None

    def __init__(self, parts: Partitions, rank: int, group_name: str) -> None:
        self.parts = parts
        self.rank = rank
        self.world_size = parts.world_size
        self.group_name = group_name

    def call(self, target: Any, *args: Any, meta_from: fx.Node | None = None) -> Any:
        return target(*args)


def _run(steps: Sequence[ReshardStep], x: torch.Tensor, builder: EagerSteps, producer: fx.Node) -> torch.Tensor:
    from autotp.passes.resharding import RESHARD_TABLE

    for step in steps:
        x = RESHARD_TABLE[step.kind].emit(builder, x, producer, step)  # type: ignore[arg-type]
    return x


class _Reshard(torch.autograd.Function):
    """``forward`` runs ``node.forward_steps``, ``backward`` runs ``node.backward_steps`` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, node: ReshardNode) -> torch.Tensor:  # type: ignore[override]
        ctx.node = node
        out = _run(node.forward_steps, x, node.builder, node.producer)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        node: ReshardNode = ctx.node
        return _run(node.backward_steps, grad.contiguous(), node.builder, node.producer), None


class ReshardNode:
    """The target of one training-graph node: a resharding route of one producer with its adjoint.

    Called with the producer's tensor on this rank; returns it after ``forward_steps``, and its
    gradient flows back through ``backward_steps`` (:func:`adjoint_route`, or
    :data:`REPLICATED_INPUT_ADJOINT` for Megatron's ``f``). Non-float tensors (ids, masks) take
    the forward steps only: they have no gradient.
    """

    __module__ = "autotp.passes.adjoints"

    def __init__(self, builder: EagerSteps, producer: fx.Node, forward_steps: Sequence[ReshardStep],
                 backward_steps: Sequence[ReshardStep]) -> None:
        self.builder = builder
        self.producer = producer
        self.forward_steps = tuple(forward_steps)
        self.backward_steps = tuple(backward_steps)
        kinds = "+".join(str(s.kind) for s in self.forward_steps) or "replicated_input"
        self.__name__ = f"autotp_{kinds}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _Reshard.apply(x, self)
        return _run(self.forward_steps, x, self.builder, self.producer)

    def __repr__(self) -> str:
        back = "+".join(str(s.kind) for s in self.backward_steps) or "identity"
        return f"{self.__name__}({self.producer.name}; backward {back})"

