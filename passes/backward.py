"""Backward: what a training step adds to a strategy's price, beside the forward pass.

A training plan (``PlanOptions(training=True)``) is priced for one forward *and* backward pass,
with the memory a training rank holds. This module decides *what* the backward asks of the
hardware, per node and per edge; the cost pass (``passes/costing.py``) and the one pricing
function (``passes/pricing.py``) add it in, so the solver, the plan's figures and its
alternatives all see the same price.

- **Which nodes carry a gradient** (:func:`requires_grad_nodes`): floating-point values that
  depend on a trainable parameter. Masks, positions and token ids have no backward.
- **Backward compute** (:func:`backward_flops_factor`): a matmul-like op (one the FLOP
  counter sizes) costs one forward GEMM per input that needs a gradient (grad input, grad
  weight: ~2x the forward), any other op about its forward again (elementwise: ~1x); a view's
  backward is a view. Same roofline as the forward (``compute_time_s``), same per-rank share.
- **Backward communication**, as the training runtime runs it (:mod:`autotp.passes.adjoints`,
  whose gradient convention this follows: the gradient of a ``Replicate`` or ``Partial`` value is
  the whole gradient on every rank, of a ``Shard`` value this rank's block):

  * every forward resharding route runs its *adjoint* route on the gradient, once per producer
    and placement like the forward (:func:`adjoint_steps`, the ``adjoint`` column of
    :data:`~autotp.passes.resharding.RESHARD_TABLE`: all-reduce <-> identity (Megatron's g),
    zero-fill <-> identity, all-gather <-> slice, slice and reduce-scatter <-> all-gather,
    all-to-all <-> all-to-all), priced by the same table rows as forward steps;
  * a replicated value read by rank-divergent work (a strategy whose output is split or
    partial: a column-split GEMM, ``P * R``) returns only this rank's share of its gradient:
    the runtime reads it through Megatron's f (identity forward, all-reduce backward), once per
    value (:func:`reads_through_f`), priced as an all-reduce of the whole value.

- **Memory**: every trainable parameter also holds its gradient (its dtype) and
  ``optimizer_states`` fp32 values per element (AdamW: 2); the activations autograd keeps for
  the backward are the tensor inputs of each op that carries a gradient (not parameters, not
  inputs of ops whose backward needs none: :data:`SAVES_NO_INPUT`), per rank at the placement
  the op reads them in, each tensor counted once per placement (:func:`saved_slots`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import Placement, Replicate
from autotp.base.reshard import ReshardStep
from autotp.base.strategy import Strategy
from autotp.cost_model import launches_no_kernel
from autotp.passes.adjoints import REPLICATED_INPUT_ADJOINT, adjoint_route
from autotp.passes.rules import tensor_inputs
from autotp.passes.strategies import StrategyGraph

aten = torch.ops.aten

__all__ = [
    "DEFAULT_OPTIMIZER_STATES",
    "CheckpointedBlocks",
    "REPLICATED_INPUT_BACKWARD",
    "SAVES_NO_INPUT",
    "Training",
    "adjoint_steps",
    "backward_flops_factor",
    "checkpointed_blocks_price",
    "reads_through_f",
    "requires_grad_nodes",
    "saved_slots",
    "trainable_bytes_factor",
]

DEFAULT_OPTIMIZER_STATES = 2
"""fp32 values the optimizer keeps per parameter element: AdamW's ``exp_avg`` and ``exp_avg_sq``
(Loshchilov & Hutter 2019; torch.optim.AdamW keeps them in the parameter's dtype, fp32 for the
fp32 master weights mixed-precision training keeps). SGD with momentum: 1; plain SGD: 0."""

SAVES_NO_INPUT = frozenset({
    aten.add, aten.sub, aten.neg, aten.cat, aten.clone, aten.contiguous, aten.sum, aten.mean,
    aten.to, aten._to_copy, aten.expand, aten.pad, aten.constant_pad_nd, aten.slice, aten.select,
    aten.index, aten.embedding, aten.split, aten.split_with_sizes, aten.chunk, aten.zeros_like,
    aten.ones_like, aten.full_like, aten.new_ones, aten.new_zeros, aten.detach, aten.alias, aten.copy,
})
"""Ops whose backward needs none of their tensor inputs' values, only shapes (sums, copies,
concatenations, casts, index selection): they keep no activation alive. The saved indices of
``index``/``embedding`` are integers, negligible beside the activations."""


@dataclasses.dataclass(frozen=True)
class Training:
    """What the cost pass needs to price a training step (see the module doc).

    ``requires_grad``: nodes whose value carries a gradient. ``saved``: ``(producer, consumer,
    slot)`` of every tensor input the backward keeps alive. ``optimizer_states``: fp32 values per
    trainable parameter element.
    """

    requires_grad: frozenset[str]
    saved: frozenset[tuple[str, str, int]]
    optimizer_states: int = DEFAULT_OPTIMIZER_STATES

    @classmethod
    def of(cls, graph: StrategyGraph, optimizer_states: int = DEFAULT_OPTIMIZER_STATES,
           frozen: frozenset[str] = frozenset()) -> Training:
        """The training facts of ``graph``; ``frozen``: parameter placeholders that do not train
        (``requires_grad=False`` in the model): no gradient, no optimizer state."""
        grads = requires_grad_nodes(graph, frozen)
        saved = frozenset((producer.name, name, slot) for name in graph.order if name in grads
                          for producer, slot in saved_slots(graph.nodes[name], graph.parameters))
        return cls(grads, saved, optimizer_states)

    def grad_flows(self, producer: str, consumer: str) -> bool:
        """True when the backward sends a gradient from ``consumer`` back to ``producer``."""
        return producer in self.requires_grad and consumer in self.requires_grad


def _is_float(value: object) -> bool:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return bool(leaves) and all(v.dtype.is_floating_point for v in leaves)


def requires_grad_nodes(graph: StrategyGraph, frozen: frozenset[str] = frozenset()) -> frozenset[str]:
    """Nodes whose value carries a gradient: floating-point parameters not in ``frozen``, and
    floating-point values computed from one (graph order is topological, so one pass suffices)."""
    grads: set[str] = set()
    for name in graph.order:
        node = graph.nodes[name]
        if not _is_float(node.meta.get("val")):
            continue
        if (name in graph.parameters and name not in frozen) or (node.op == "call_function"
                                        and any(p.name in grads for p in tensor_inputs(node))):
            grads.add(name)
    return frozenset(grads)


def backward_flops_factor(node: fx.Node, grads: frozenset[str], flops: float) -> float:
    """Backward time of ``node`` as a multiple of its forward (the module doc's rule).

    A matmul-like op (``flops`` > 0: one the FLOP counter sizes): one forward-sized GEMM per
    operand (a tensor input of 2 or more dims; a bias's gradient is a cheap sum) that needs a
    gradient, at most 2 (grad input and grad weight). Anything else: 1 (its backward reads and writes about what its
    forward does). No gradient: 0.
    """
    if node.name not in grads or node.op != "call_function":
        return 0.0
    if flops > 0:
        operands = [p for p in tensor_inputs(node) if p.name in grads and getattr(p.meta.get("val"), "ndim", 0) >= 2]
        return float(min(2, len(operands)))
    return 1.0


def saved_slots(node: fx.Node, parameters: dict[str, str]) -> list[tuple[fx.Node, int]]:
    """``(producer, slot)`` of the tensor inputs of ``node`` its backward keeps alive.

    Parameters are counted as weights, not activations; views keep nothing (their base is
    kept by whoever needs it); :data:`SAVES_NO_INPUT` ops keep nothing.
    """
    if node.op != "call_function" or launches_no_kernel(node.target):
        return []
    if getattr(node.target, "_overloadpacket", node.target) in SAVES_NO_INPUT:
        return []
    return [(p, slot) for slot, p in enumerate(tensor_inputs(node))
            if p.name not in parameters and isinstance(p.meta.get("val"), torch.Tensor)]


def reads_through_f(strategy: Strategy, slot: int) -> bool:
    """True when ``strategy`` reads input ``slot`` replicated while its work differs per rank (its
    output is split or partial): the gradient it returns for that input is a partial sum, which
    the runtime all-reduces (Megatron's f). The caller checks that a gradient flows at all."""
    return isinstance(strategy.inputs[slot], Replicate) and not isinstance(strategy.output, Replicate)


def adjoint_steps(route: Sequence[ReshardStep]) -> tuple[ReshardStep, ...]:
    """The steps that carry a gradient back through the forward ``route``: each step's adjoint
    (the ``adjoint`` column of :data:`~autotp.passes.resharding.RESHARD_TABLE`), last step first,
    exactly as the training runtime runs them (:func:`autotp.passes.adjoints.adjoint_route`)."""
    return adjoint_route(route)


REPLICATED_INPUT_BACKWARD: tuple[ReshardStep, ...] = REPLICATED_INPUT_ADJOINT
"""Backward of Megatron's f (:func:`reads_through_f`): the ranks' shares of the gradient summed."""


def trainable_bytes_factor(value: torch.Tensor, optimizer_states: int) -> float:
    """Bytes a trainable parameter holds per byte of its shard: itself, its gradient (same dtype)
    and ``optimizer_states`` fp32 values per element."""
    return 2.0 + optimizer_states * 4 / value.element_size()


@dataclasses.dataclass(frozen=True)
class CheckpointedBlocks:
    """What activation checkpointing of blocks changes in a training step's price (see
    :func:`checkpointed_blocks_price`): the activation bytes kept per rank, and the recomputation."""

    activation_bytes: float
    recompute_compute_s: float
    recompute_comm_s: float


def checkpointed_blocks_price(graph: StrategyGraph, saved: frozenset[tuple[str, str, int]],
                              strategy_of: Callable[[str], Strategy], activation_bytes: Callable[[str, Placement], float],
                              forward_s: Callable[[str], float], reshardings: Iterable[tuple[str, tuple[str, ...], float]],
                              block_of: Callable[[str], str | None]) -> CheckpointedBlocks:
    """The price of ``activation_checkpointing="blocks"`` (:mod:`autotp.runtime.training.checkpointing`).

    - **Activations kept**: what nodes outside every block save, as without checkpointing; for
      each block only its inputs (values produced outside it and read inside, once per placement
      read in); plus, while one block is recomputed for its backward, the tensors it saves of its
      own values: the largest block's (blocks are recomputed one at a time).
    - **Recomputation**: the forward compute of every node inside a block (``forward_s``) and the
      forward reshardings read only inside blocks (``reshardings``: ``(producer, consumers,
      seconds)``), run once more in the backward.

    ``saved``: ``(producer, consumer, slot)`` of every tensor the backward keeps
    (:attr:`Training.saved`); ``activation_bytes(producer, placement)``: its size on one rank;
    ``block_of(name)``: the block a node lies in (``None`` outside every block).
    """
    def kept_bytes(items: Iterable[tuple[str, Placement]]) -> float:
        return sum(activation_bytes(producer, placement) for producer, placement in set(items))

    outside = [(producer, strategy_of(consumer).inputs[slot]) for producer, consumer, slot in saved
               if block_of(consumer) is None]
    inputs: list[tuple[str, Placement]] = []
    inside: dict[str, list[tuple[str, Placement]]] = {}
    for name in graph.order:
        block = block_of(name)
        node = graph.nodes[name]
        if block is None or node.op != "call_function":
            continue
        for slot, producer in enumerate(tensor_inputs(node)):
            if block_of(producer.name) != block and producer.name not in graph.parameters:
                inputs.append((producer.name, strategy_of(name).inputs[slot]))
    for producer, consumer, slot in saved:  # a block's own values: its inputs are kept already
        if (block := block_of(consumer)) is not None and block_of(producer) == block:
            inside.setdefault(block, []).append((producer, strategy_of(consumer).inputs[slot]))
    largest = max((kept_bytes(items) for items in inside.values()), default=0.0)
    compute = sum(forward_s(name) for name in graph.order if block_of(name) is not None)
    comm = sum(seconds for _, consumers, seconds in reshardings
               if consumers and all(block_of(c) is not None for c in consumers))
    return CheckpointedBlocks(kept_bytes(outside) + kept_bytes(inputs) + largest, compute, comm)
