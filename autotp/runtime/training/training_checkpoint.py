"""Save and resume a training run: model shards and optimizer state with ``torch.distributed.checkpoint``.

:func:`save_training_state` writes, from every rank of the tensor-parallel group, the model's
shards and the optimizer's state of each shard (AdamW's ``exp_avg``/``exp_avg_sq``: one value per
element of the shard, laid out like it) as chunks with their global offsets (the layout and
the DCP planners of :mod:`autotp.runtime.checkpoints.saving`: uneven and block splits exact), the per-parameter
scalars (``step``) and the optimizer's hyperparameters (``param_groups`` without the parameters)
once. :func:`load_training_state` reads them back in place into a model compiled with the same
plan and an optimizer over its ``parameters()`` (fresh or not): the next step's loss is the one
the saved run would have had.

Keys: ``model.<FQN>``, ``optim.<FQN>.<state name>``, ``optim.param_groups.<group>.<name>`` (numbers and
tuples of numbers, as float64 tensors; other hyperparameters keep the new optimizer's values). The model part is the
layout ``tp.save`` writes, so ``autotp.load``/``compile(checkpoint=...)`` read the weights of a
training checkpoint at any world size; resuming the optimizer state needs the same plan.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from autotp.runtime.checkpoints.saving import ChunkLoadPlanner, Chunks, ChunkSavePlanner, chunk_extents, split_local

if TYPE_CHECKING:
    from autotp.runtime.execution.module import TensorParallelModule

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


class _TrainingState:
    """The DCP view of a training state: plain tensors and objects (``state``), and this rank's
    chunks of each split tensor with their global offsets (``chunks``, ``shapes``), as
    :mod:`autotp.runtime.checkpoints.saving` writes a model; ``targets``: the local tensor each came from."""

    def __init__(self, tp: TensorParallelModule, optimizer: torch.optim.Optimizer) -> None:
        self.state: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.chunks: dict[str, Chunks] = {}
        self.targets: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (local tensor, split dim)
        names = _parameter_names(tp, optimizer)
        for fqn, tensor in tp.local_state().items():
            if tp.layout.get(fqn, (None, None))[0] is None and fqn in tp.plan.parameters:
                continue  # the second name of a tied weight: the graph never reads it
            self._put(tp, f"model.{fqn}", fqn, tensor.detach())
        for group in optimizer.param_groups:
            for param in group["params"]:
                fqn = names[id(param)]
                for name, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                        self._put(tp, f"optim.{fqn}.{name}", fqn, value)
                    elif isinstance(value, torch.Tensor):
                        self.state[f"optim.{fqn}.{name}"] = value  # e.g. AdamW's step: the same on every rank
                    elif _numeric(value):
                        self.state[f"optim.{fqn}.{name}"] = torch.tensor(value, dtype=torch.float64)
        for index, group in enumerate(optimizer.param_groups):  # hyperparameters, as tensors: DCP restores
            for name, value in group.items():                   # tensors in place (not plain objects, here)
                if name != "params" and _numeric(value):
                    self.state[f"{_HYPERPARAMETERS}.{index}.{name}"] = torch.tensor(value, dtype=torch.float64)

    def _put(self, tp: TensorParallelModule, key: str, fqn: str, tensor: torch.Tensor) -> None:
        """``tensor``, laid out like parameter ``fqn``: whole when it is replicated, else this rank's chunks."""
        shape, blocks = tp.layout.get(fqn, (None, None))
        if shape is None or blocks is None or blocks[tp.rank] is None:
            self.state[key] = tensor
            return
        block = blocks[tp.rank]
        offsets = [o for o, _ in chunk_extents(shape, block)]
        self.shapes[key] = tuple(shape)
        self.chunks[key] = list(zip(offsets, split_local(tensor, block), strict=True))
        self.targets[key] = (tensor, block[0])


def save_training_state(tp: TensorParallelModule, optimizer: torch.optim.Optimizer,
                        directory: str | os.PathLike[str], group: Any = None) -> None:
    """Write ``tp``'s shards and ``optimizer``'s state to ``directory`` (collective: every rank of
    ``group``, the model's tensor-parallel group; default: the whole world)."""
    view = _TrainingState(tp, optimizer)
    dcp.save(view.state, checkpoint_id=str(directory), process_group=group,
             planner=ChunkSavePlanner(view.shapes, view.chunks))


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
    view = _TrainingState(tp, optimizer)
    dcp.load(view.state, checkpoint_id=str(directory), process_group=group, planner=ChunkLoadPlanner(view.chunks))
    names = _parameter_names(tp, optimizer)
    with torch.no_grad():
        for key, pieces in view.chunks.items():  # pieces that are copies (several ranges) go back in place
            target, dim = view.targets[key]
            tensors = [tensor for _, tensor in pieces]
            if tensors:
                target.copy_(torch.cat(tensors, dim) if len(tensors) > 1 else tensors[0])
    for key, value in view.state.items():  # numbers saved as tensors go back to what they were
        if key.startswith(_HYPERPARAMETERS + "."):
            index, name = key[len(_HYPERPARAMETERS) + 1:].split(".", 1)
            group = optimizer.param_groups[int(index)]
            group[name] = _like(value, group[name])
        elif key.startswith("optim."):
            fqn, name = key[len("optim."):].rsplit(".", 1)
            state = optimizer.state[_param_of(optimizer, names, fqn)]
            if not isinstance(state.get(name), torch.Tensor):
                state[name] = _like(value, state.get(name))


def _numeric(value: object) -> bool:
    """A number, or a tuple of numbers (AdamW's betas): saved as a float64 tensor."""
    items = value if isinstance(value, tuple) else (value,)
    return bool(items) and all(isinstance(v, (bool, int, float)) for v in items)


def _like(tensor: torch.Tensor, like: object) -> object:
    """``tensor`` (a number saved by :func:`_numeric`) as the kind of value ``like`` is."""
    if isinstance(like, tuple):
        return tuple(type(old)(new) for old, new in zip(like, tensor.tolist(), strict=True))
    if isinstance(like, (bool, int, float)):
        return type(like)(tensor.item())
    return tensor.item()


def _param_of(optimizer: torch.optim.Optimizer, names: dict[int, str], fqn: str) -> torch.Tensor:
    return next(p for g in optimizer.param_groups for p in g["params"] if names[id(p)] == fqn)
