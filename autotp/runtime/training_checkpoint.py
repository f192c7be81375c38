"""Save and resume a training run: model shards and optimizer state with ``torch.distributed.checkpoint``.

:func:`save_training_state` writes, from every rank of the tensor-parallel group, the model's
shards and the optimizer's state of each shard (AdamW's ``exp_avg``/``exp_avg_sq``: one value per
element of the shard, laid out like it) as ``ShardedTensor``s with their global offsets (the
layout :mod:`autotp.runtime.saving` writes: uneven and block splits exact), the per-parameter
scalars (``step``) and the optimizer's hyperparameters (``param_groups`` without the parameters)
once. :func:`load_training_state` reads them back in place into a model compiled with the same
plan and an optimizer over its ``parameters()`` (fresh or not): the next step's loss is the one
the saved run would have had.

Keys: ``model.<FQN>``, ``optim.<FQN>.<state name>``, ``optim.param_groups``. The model part is the
layout ``tp.save`` writes, so ``autotp.load``/``compile(checkpoint=...)`` read the weights of a
training checkpoint at any world size; resuming the optimizer state needs the same plan.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from autotp.runtime.saving import _sharded, _split_local

if TYPE_CHECKING:
    from autotp.runtime.module import TensorParallelModule

__all__ = ["load_training_state", "save_training_state"]

_HYPERPARAMETERS = "optim.param_groups"


def _parameter_names(tp: TensorParallelModule, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(parameter)`` -> FQN for every parameter ``optimizer`` updates; a clear error for foreign ones."""
    names = {id(tensor): fqn for fqn, tensor in tp.local_state().items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"the optimizer updates a tensor of shape {tuple(param.shape)} that is not a parameter of this "
                    "TensorParallelModule; build it over tp.parameters() (compiled with training=True)")
    return names


def _like_parameter(tp: TensorParallelModule, fqn: str, tensor: torch.Tensor, group: Any) -> Any:
    """``tensor`` (this rank's value of something laid out like parameter ``fqn``) as DCP should see it."""
    shape, blocks = tp.layout.get(fqn, (None, None))
    if blocks is None or shape is None:
        return tensor
    return _sharded(_split_local(tensor, blocks[tp.rank]), shape, blocks, tp.rank, group, tensor.dtype, tensor.device)


def _training_state(tp: TensorParallelModule, optimizer: torch.optim.Optimizer, group: Any) -> dict[str, Any]:
    names = _parameter_names(tp, optimizer)
    state: dict[str, Any] = {}
    for fqn, tensor in tp.local_state().items():
        if tp.layout.get(fqn, (None, None))[0] is None and fqn in tp.plan.parameters:
            continue  # the second name of a tied weight: the graph never reads it
        state[f"model.{fqn}"] = _like_parameter(tp, fqn, tensor.detach(), group)
    for group_ in optimizer.param_groups:
        for param in group_["params"]:
            fqn = names[id(param)]
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                    state[f"optim.{fqn}.{key}"] = _like_parameter(tp, fqn, value, group)
                else:
                    state[f"optim.{fqn}.{key}"] = value
    state[_HYPERPARAMETERS] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state


def save_training_state(tp: TensorParallelModule, optimizer: torch.optim.Optimizer,
                        directory: str | os.PathLike[str], group: Any = None) -> None:
    """Write ``tp``'s shards and ``optimizer``'s state to ``directory`` (collective: every rank of ``group``)."""
    dcp.save(_training_state(tp, optimizer, group), checkpoint_id=str(directory), process_group=group)


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (zeros), as its first ``step()`` would, without
    changing the parameters: one step with zero gradients and a learning rate of 0."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [(p, p.grad) for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    optimizer.step()
    for g, rate in zip(optimizer.param_groups, rates):
        g["lr"] = rate
    for p, grad in saved:
        p.grad = grad


def load_training_state(tp: TensorParallelModule, optimizer: torch.optim.Optimizer,
                        directory: str | os.PathLike[str], group: Any = None) -> None:
    """Read what :func:`save_training_state` wrote into ``tp``'s shards and ``optimizer``, in place
    (collective: every rank of ``group``; ``tp`` compiled with the plan of the saved run)."""
    _initialise_state(optimizer)
    state = _training_state(tp, optimizer, group)
    dcp.load(state, checkpoint_id=str(directory), process_group=group)
    names = _parameter_names(tp, optimizer)
    local = tp.local_state()
    with torch.no_grad():
        for key, value in state.items():
            if not isinstance(value, ShardedTensor):
                continue
            fqn = key[len("model."):] if key.startswith("model.") else key[len("optim."):].rsplit(".", 1)[0]
            pieces = [shard.tensor for shard in value.local_shards()]
            if not pieces:
                continue  # an uneven split left this rank nothing of this tensor
            target = local[fqn] if key.startswith("model.") else optimizer.state[_param_of(optimizer, names, fqn)][key.rsplit(".", 1)[1]]
            _, blocks = tp.layout[fqn]
            if blocks is None or blocks[tp.rank] is None:
                continue  # not split: DCP loaded it in place
            dim = blocks[tp.rank][0]
            target.copy_(torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0])
        for key, value in state.items():  # scalars such as AdamW's step
            if key.startswith("optim.") and key != _HYPERPARAMETERS and not isinstance(value, ShardedTensor):
                fqn, name = key[len("optim."):].rsplit(".", 1)
                current = optimizer.state[_param_of(optimizer, names, fqn)]
                if isinstance(current.get(name), torch.Tensor) and isinstance(value, torch.Tensor):
                    current[name].copy_(value)
                else:
                    current[name] = value
    for g, saved in zip(optimizer.param_groups, state[_HYPERPARAMETERS]):
        g.update(saved)


def _param_of(optimizer: torch.optim.Optimizer, names: dict[int, str], fqn: str) -> torch.Tensor:
    return next(p for g in optimizer.param_groups for p in g["params"] if names[id(p)] == fqn)
