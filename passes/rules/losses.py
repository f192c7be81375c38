"""Losses: a vocabulary-parallel cross-entropy (the logits stay split over the classes).

``aten.cross_entropy_loss`` (what ``torch.nn.functional.cross_entropy`` and every Hugging Face
causal-LM / masked-LM loss capture as: capture decomposes nothing, so it stays one op) reads the
logits ``(rows, classes)`` (or ``(N, C, d1, ...)``) and the class ids. Replicated, it needs the
whole logits on every rank: the lm_head's vocabulary-split output is all-gathered first
(``rows x vocab`` values, the largest activation of a language model).

The strategy added here, ``logits S(1), target R -> loss R``, is the vocabulary-parallel
cross-entropy of Megatron-LM (and torchtitan's ``loss_parallel``): the logits never leave their
rank. Each rank holds classes ``[offset, offset + n)`` of every row; with ``x`` its block,

1. ``lse_k = log sum_local exp(x)`` (stabilised by the local max) and ``t_k = x[target]`` where
   the target is in this rank's range, else 0: two values per row;
2. one all-gather of ``(lse_k, t_k)`` over the ranks (``world x rows x 2`` values): then
   ``lse = logsumexp_k lse_k`` (the global log-sum-exp, numerically stable) and ``t = sum_k t_k``.
   Megatron does this with two all-reduces (max, then sum of exp); one all-gather of two values
   per row moves as little and pays the latency once;
3. ``loss_row = lse - t``, zero where ``target == ignore_index``, then the reduction (``mean``:
   divided by the count of rows not ignored, from the replicated target).

The loss is whole on every rank (``Replicate``). Its backward needs no collective: the gradient of
this rank's block is ``(exp(x - lse) - onehot_local(target)) * g_row`` with the saved global
``lse`` (:class:`VocabParallelCrossEntropy`). Offered when the call has no class ``weight`` and no
``label_smoothing`` (such calls run replicated, correct as before).

The strategy's price carries its all-gather (:func:`_cross_entropy_collectives`, which the cost
pass adds to the strategy's time, so the solver, the plan's figures and ``evaluate_choice`` all
see it). It runs inside the op, so the plan's list of resharding collectives does not name it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from autotp.base.errors import PlanMismatchError
from autotp.base.placements import Shard
from autotp.base.shapes import concrete_shape
from autotp.base.strategy import Strategy
from autotp.passes.rules.args import arg, shape, tensor_inputs
from autotp.passes.rules.builders import R
from autotp.passes.rules.registry import (
    LocalGraph,
    RuleContext,
    register_local_form,
    register_op_collectives,
    register_rule,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["VocabParallelCrossEntropy"]

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_CLASS_DIM = 1


def _plain_call(node: fx.Node) -> bool:
    """True when ``node`` is a cross-entropy without class weights or label smoothing over >= 2 dims."""
    weight = arg(node, 2, "weight")
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    return weight is None and not smoothing and len(shape(node.args[0])) >= 2


@register_rule(aten.cross_entropy_loss.default)
def _cross_entropy(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``logits S(1) (classes), target R -> loss R``: vocabulary-parallel (see module docstring).

    Offered when every rank can hold at least one class.
    """
    if not _plain_call(node) or shape(node.args[0])[_CLASS_DIM] < ctx.world_size:
        return []
    rest = tuple(R for _ in tensor_inputs(node)[1:])
    return [Strategy((Shard(_CLASS_DIM), *rest), R)]


@register_op_collectives(aten.cross_entropy_loss.default)
def _cross_entropy_collectives(node: fx.Node, strategy: Strategy, world_size: int) -> tuple[tuple[str, int], ...]:
    """The vocabulary-parallel strategy's one all-gather of (local log-sum-exp, target logit) per row
    and rank; ``(kind, bytes of the gathered tensor)``, at the example's row count."""
    if strategy.inputs[0] != Shard(_CLASS_DIM):
        return ()
    logits = node.args[0].meta["val"]
    rows = math.prod(size for d, size in enumerate(concrete_shape(logits)) if d != _CLASS_DIM)
    itemsize = logits.element_size()
    return (("all_gather", 2 * rows * itemsize * world_size),)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the rank-local cross-entropy needs beside its tensors."""

    offset: int  # first class this rank holds
    classes: int  # how many it holds
    reduction: str  # "none" | "mean" | "sum"
    ignore_index: int
    world_size: int
    group_name: str


def _local_terms(b: Any, x: Any, target: Any, spec: _Spec) -> tuple[Any, Any, Any, Any]:
    """``(loss, lse, picked-index, inside-mask)`` of the vocabulary-parallel cross-entropy.

    ``b.call(op, *args)`` emits (rewrite builder) or runs (:class:`EagerSteps`) each op, so the
    inference graph and the training node share this one piece of arithmetic.
    """
    local = b.call(aten.sub.Tensor, target, spec.offset)
    inside = b.call(aten.bitwise_and.Tensor, b.call(aten.ge.Scalar, local, 0),
                    b.call(aten.lt.Scalar, local, spec.classes))
    safe = b.call(aten.unsqueeze.default, b.call(aten.where.ScalarOther, inside, local, 0), _CLASS_DIM)
    picked = b.call(aten.gather.default, x, _CLASS_DIM, safe)
    picked = b.call(aten.masked_fill.Scalar, picked,
                    b.call(aten.logical_not.default, b.call(aten.unsqueeze.default, inside, _CLASS_DIM)), 0.0)
    row_max = b.call(aten.amax.default, b.call(aten.detach.default, x), [_CLASS_DIM], True)
    summed = b.call(aten.sum.dim_IntList, b.call(aten.exp.default, b.call(aten.sub.Tensor, x, row_max)),
                    [_CLASS_DIM], True)
    local_lse = b.call(aten.add.Tensor, row_max, b.call(aten.log.default, summed))
    both = b.call(aten.unsqueeze.default, b.call(aten.cat.default, [local_lse, picked], _CLASS_DIM), 0)
    gathered = b.call(c10d.wait_tensor.default,
                      b.call(c10d.all_gather_into_tensor.default, both, spec.world_size, spec.group_name))
    lse = b.call(aten.logsumexp.default, b.call(aten.slice.Tensor, gathered, _CLASS_DIM + 1, 0, 1), [0], False)
    target_logit = b.call(aten.sum.dim_IntList, b.call(aten.slice.Tensor, gathered, _CLASS_DIM + 1, 1, 2), [0])
    rows = b.call(aten.squeeze.dim, b.call(aten.sub.Tensor, lse, target_logit), _CLASS_DIM)
    valid = b.call(aten.ne.Scalar, target, spec.ignore_index)
    rows = b.call(aten.where.ScalarOther, valid, rows, 0.0)
    if spec.reduction == "none":
        return rows, lse, safe, inside
    loss = b.call(aten.sum.default, rows)
    if spec.reduction == "mean":
        count = b.call(aten.sum.default, b.call(aten.where.Scalar, valid, 1.0, 0.0))
        loss = b.call(aten.div.Tensor, loss, count)
    return loss, lse, safe, inside


class _Eager:
    """Runs each op (the :class:`EagerSteps` convention, with keyword-free calls)."""

    @staticmethod
    def call(target: Any, *args: Any) -> Any:
        return target(*args)


class _CrossEntropy(torch.autograd.Function):
    """Forward: :func:`_local_terms` run eagerly; backward: ``(softmax_local - onehot_local) * g_row``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, spec: _Spec) -> torch.Tensor:  # type: ignore[override]
        with torch.no_grad():
            loss, lse, safe, inside = _local_terms(_Eager, x, target, spec)
        ctx.spec = spec
        ctx.save_for_backward(x, target, lse, safe, inside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        x, target, lse, safe, inside = ctx.saved_tensors
        spec: _Spec = ctx.spec
        valid = (target != spec.ignore_index).to(x.dtype)
        if spec.reduction == "none":
            per_row = grad * valid
        elif spec.reduction == "mean":
            per_row = grad * valid / valid.sum()
        else:
            per_row = grad * valid
        # in place: one buffer the size of this rank's logits (the softmax), then minus the one-hot
        grad_x = torch.sub(x, lse).exp_()
        grad_x.scatter_add_(_CLASS_DIM, safe, inside.unsqueeze(_CLASS_DIM).to(x.dtype).neg_())
        return grad_x.mul_(per_row.unsqueeze(_CLASS_DIM)), None, None


class VocabParallelCrossEntropy:
    """The target of a training graph's vocabulary-parallel cross-entropy node (autograd-correct).

    Called with this rank's block of the logits (classes ``[offset, offset + classes)``) and the
    whole target; returns the whole loss on every rank.
    """

    __module__ = "autotp.passes.rules.losses"

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec
        self.__name__ = "autotp_vocab_parallel_cross_entropy"

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _CrossEntropy.apply(x, target, self.spec)

    def __repr__(self) -> str:
        return f"{self.__name__}(classes {self.spec.offset}+{self.spec.classes}, {self.spec.reduction})"


@register_local_form(aten.cross_entropy_loss.default)
def _local_cross_entropy(builder: LocalGraph, node: fx.Node, args: tuple, kwargs: dict,
                         strategy: Strategy) -> fx.Node | None:
    """Vocabulary-parallel cross-entropy on this rank's classes (see module docstring)."""
    if strategy.inputs[0] != Shard(_CLASS_DIM):
        return None
    logits = node.args[0]
    offset, classes = builder.parts.local(logits.name, _CLASS_DIM, builder.rank)
    if classes == 0:
        raise PlanMismatchError(
            f"{node.name}: rank {builder.rank} holds none of the {shape(logits)[_CLASS_DIM]} classes of a vocabulary-"
            f"parallel cross-entropy; plan with fewer ranks or keep the loss replicated (edit the plan's strategy)")
    reduction = _REDUCTIONS[int(arg(node, 3, "reduction", 1))]  # type: ignore[arg-type]
    ignore_index = int(arg(node, 4, "ignore_index", -100))  # type: ignore[arg-type]
    spec = _Spec(offset, classes, reduction, ignore_index, builder.world_size, builder.group_name)
    x, target = args[0], args[1]
    if getattr(builder, "eager", None) is not None:  # training: one autograd node
        return builder.call(VocabParallelCrossEntropy(spec), x, target, meta_from=node)

    class Emit:
        @staticmethod
        def call(target_op: Any, *call_args: Any) -> Any:
            return builder.call(target_op, *call_args, meta_from=node)

    return _local_terms(Emit, x, target, spec)[0]
