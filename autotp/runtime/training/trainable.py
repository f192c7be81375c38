"""Training with a :class:`~autotp.runtime.execution.module.TensorParallelModule` (``autotp.compile(..., options=PlanOptions(training=True))``).

The graph itself is made differentiable by the rewrite (:mod:`autotp.passes.adjoints`); this module
holds what the runtime adds around it:

- :func:`full_state_dict`: the full tensors, gathered from every rank's shards, under the original
  model's ``state_dict`` keys (tied names included);
- :class:`OriginalParameterCheck`: catches an optimizer built over the *original* model's parameters
  (whose gradients stay ``None``: the gradients go to ``tp.parameters()``), at its first ``step()``;
- :func:`refuse_backward`: gives the loss of a model compiled for inference a backward that raises
  an error naming the fix, instead of autograd's "does not require grad".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autotp.runtime.execution.rank_local import RankLocalModel

__all__ = ["OriginalParameterCheck", "full_state_dict", "refuse_backward", "state_dict_aliases"]


def state_dict_aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each key of ``model.state_dict()`` -> every key of the same tensor (itself, and the other names of a tied weight)."""
    names: dict[int, list[str]] = {}
    keys = model.state_dict(keep_vars=True)
    for key, tensor in keys.items():
        names.setdefault(id(tensor), []).append(key)
    return {key: tuple(names[id(tensor)]) for key, tensor in keys.items()}


def full_state_dict(tp: RankLocalModel, group: Any = None) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict`` keys -> full tensors (collective: call on every rank of ``group``).

    A split parameter is put together from every rank's blocks (each rank writes its blocks into
    zeros, the ranks' tensors are summed), so uneven and block splits come back exactly. Replicated
    parameters and buffers are this rank's copies (the same on every rank). Detached copies: editing
    them does not change ``tp``.
    """
    local = tp.local_state()
    aliases = tp.state_dict_aliases or {key: (key,) for key in local}

    def held(key: str) -> bool:  # the graph reads it (the second name of a tied weight holds nothing)
        return key in tp.layout or (key in local and key not in tp.plan.parameters)

    sources = {key: next((name for name in names if held(name)), None) for key, names in aliases.items()}
    rank = tp.rank
    gathered: dict[str, torch.Tensor] = {}
    for source in dict.fromkeys(s for s in sources.values() if s is not None):  # the same order on every rank
        tensor = local[source].detach()
        shape, blocks = tp.layout.get(source, (None, None))
        if blocks is None:
            gathered[source] = tensor.clone()
            continue
        full = tensor.new_zeros(shape)
        dim, ranges = blocks[rank]
        lengths = [stop - start for start, stop in ranges]
        for (start, stop), piece in zip(ranges, tensor.split(lengths, dim), strict=True):
            full.narrow(dim, start, stop - start).copy_(piece)
        dist.all_reduce(full, group=group)
        gathered[source] = full
    return {key: gathered[source] for key, source in sources.items() if source is not None}


class _RefusedBackward(torch.autograd.Function):
    """Identity forward; backward raises: the model was compiled for inference."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        raise RuntimeError(
            "backward() through a tensor-parallel model compiled for inference: its parameters do not require "
            "grad and its collectives have no backward. Compile it with autotp.compile(..., options=autotp.PlanOptions(training=True)) "
            "and build the optimizer over tp.parameters()."
        )


def refuse_backward(outputs: Iterable[Any], anchor: torch.Tensor) -> list[Any]:
    """``outputs`` with every scalar float tensor (a loss) given a backward that raises an error naming the fix.

    ``anchor``: a scalar that requires grad (so the result has a ``grad_fn``). Other outputs are
    left as they are: they do not require grad, like any output computed under ``torch.no_grad()``.
    """
    return [_RefusedBackward.apply(value, anchor)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() else value
            for value in outputs]


class OriginalParameterCheck:
    """Raises at ``optimizer.step()`` when the optimizer holds the original model's parameters.

    After ``autotp.compile(model, ..., options=PlanOptions(training=True))``, ``loss.backward()`` writes gradients into
    ``tp.parameters()``; an optimizer over ``model.parameters()`` would find no gradients there and
    silently do nothing. An optimizer step pre-hook (registered for ``tp``'s lifetime, removed when
    ``tp`` is garbage collected) sees every optimizer's parameters: when it holds some of ``model``'s,
    none of them has a gradient, and ``tp``'s parameters do, it raises an error naming the fix. An
    optimizer that trains ``model`` itself (its parameters have gradients) is left alone.
    """

    def __init__(self, tp: RankLocalModel, original: torch.nn.Module) -> None:
        self._originals = {id(p): weakref.ref(p) for p in original.parameters()}
        self._tp = weakref.ref(tp)
        self._what = type(original).__name__
        handle = register_optimizer_step_pre_hook(self)
        weakref.finalize(tp, handle.remove)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tp = self._tp()
        if tp is None:
            return
        held = [p for group in optimizer.param_groups for p in group["params"]
                if (ref := self._originals.get(id(p))) is not None and ref() is p]
        if not held or any(p.grad is not None for p in held):
            return
        if any(p.grad is not None for p in tp.parameters()):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() over the original {self._what}'s parameters, which autotp does "
                "not train: the gradients of loss.backward() are in the tensor-parallel model's parameters (this "
                "rank's shards). Build the optimizer over them: torch.optim.AdamW(tp.parameters(), ...)."
            )
