"""Repeated blocks (layers): the one notion of "block" autotp uses, for paths and for modules.

A *block* is a child of a numbered container (``nn.ModuleList`` or ``nn.Sequential``), whatever
the model calls it. Three questions, each answered here once:

- **Which block a path lies in** (:func:`block_of`, :func:`block_name`): the module or parameter
  path up to its first all-digit segment. Tying identical layers in the solver
  (``passes/tying.py``), folding identical layers in reports (``planning/blocks.py``), per-layer
  estimates, the mesh search's per-layer costs and activation checkpointing all cut paths here.
- **The model's layer blocks, in order** (:func:`layer_blocks`): the children of its longest
  numbered container (pipeline stages are cut between them); :func:`layer_lists`: the
  ``nn.ModuleList`` s of a given length (``config.num_hidden_layers``), outermost first.
- **Which layers are identical** (:func:`layer_signature`, :func:`differing_layer`): same module
  classes, plain attributes (layer-index attributes aside), parameter and buffer specs and hooks,
  so that a few of them stand for all (stamping a traced program, the mesh search's two-layer copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["block_name", "block_of", "block_path", "differing_layer", "layer_blocks", "layer_lists",
           "layer_signature", "within"]

_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""Plain attributes that say which layer a module is, and so differ between otherwise equal layers."""


def within(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or lies under it (``model.layers.1.mlp`` in ``model.layers.1``,
    not in ``model.layers.10``)."""
    return path == prefix or path.startswith(prefix + ".")


def block_of(path: str) -> tuple[str, int] | None:
    """``(container, index)`` of the block ``path`` (a module FQN or a parameter FQN) lies in.

    ``model.layers.3.mlp.up_proj`` -> ``("model.layers", 3)``; ``0.weight`` (a child of a
    top-level ``Sequential``) -> ``("", 0)``; ``lm_head`` and ``""`` -> ``None``.
    """
    parts = path.split(".") if path else []
    for position, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:position]), int(part)
    return None


def block_path(container: str, index: int) -> str:
    """The block's own path from :func:`block_of`'s pair: ``model.layers.3``; ``0`` at the top level."""
    return f"{container}.{index}" if container else str(index)


def block_name(path: str) -> str | None:
    """The block's own path: ``model.layers.3`` for ``model.layers.3.mlp.up_proj``, ``0`` for ``0.weight``."""
    block = block_of(path)
    return None if block is None else block_path(*block)


def layer_blocks(model: nn.Module) -> list[str]:
    """FQNs of the model's layer blocks, in order (``["model.layers.0", ...]``); ``[]`` without any.

    The blocks are the children of the ``nn.ModuleList`` / ``nn.Sequential`` with the most
    children (the first such container when two tie)."""
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = [f"{name}.{child}" if name else child for child, _ in module.named_children()]
            if len(children) > len(best):
                best = children
    return best


def layer_lists(model: nn.Module, count: int) -> list[str]:
    """FQNs of ``model``'s ``nn.ModuleList`` s of exactly ``count`` modules, outermost first."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and len(module) == count]


def _plain(value: Any) -> Any:
    """A comparable form of a plain attribute value, or None when it is not plain (a config, a module)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return repr(value)
    return None


def layer_signature(layer: nn.Module) -> list[Any]:
    """What must be equal between two layers for their graphs to be equal (up to names and layer index)."""
    signature = []
    for name, module in layer.named_modules():
        attributes = sorted((key, plain) for key, value in vars(module).items()
                            if not key.startswith("_") and key not in _INDEX_ATTRIBUTES
                            and (plain := _plain(value)) is not None)
        parameters = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters(recurse=False)]
        buffers = [(n, tuple(b.shape), b.dtype, n in module._non_persistent_buffers_set)
                   for n, b in module.named_buffers(recurse=False)]
        hooks = [len(module._forward_hooks), len(module._forward_pre_hooks)]
        signature.append([name, f"{type(module).__module__}.{type(module).__qualname__}", attributes, parameters,
                          buffers, hooks])
    return signature


def differing_layer(layers: nn.ModuleList) -> int | None:
    """Index of the first layer of ``layers`` whose :func:`layer_signature` is not the first layer's; None
    when all are identical."""
    if not len(layers):
        return None
    reference = layer_signature(layers[0])
    return next((index for index, layer in enumerate(layers) if layer_signature(layer) != reference), None)
