"""Structural keys of FX nodes: equal keys mean a per-node pass computes the same thing for both nodes.

A decoder's layers repeat the same ops on tensors of the same shapes, so the strategy rules and
the cost formulas, which read only a node's op, its arguments' recorded values
(``node.meta["val"]``) and its constant arguments, give every layer's copy of a node the same
answer. :func:`node_key` describes exactly that input: the node's kind and target; its
arguments, flattened, each constant as it is and each FX node as the position of its first
occurrence (``mul(x, x)`` and ``mul(x, y)`` differ) with the key of its value; and its own
value. A value's key is, per tensor, the shape (symbolic sizes by their expression), strides,
dtype, device and ``requires_grad``; per symbolic scalar, its expression. Two documented ``node.meta`` keys that
rules read join it: an in-place state update (:data:`autotp.passes.state.WRITES_IN_PLACE`) and a node's part in a
mixture-of-experts block (:data:`autotp.passes.rules.experts.EXPERT_ROLE`). A node holding
anything else that cannot be compared by value (an unhashable constant, an object) has no key
(None): callers then compute it directly.

Used to compute strategies (:func:`autotp.passes.strategies.build_strategy_graph`) and compute
costs (:func:`autotp.passes.costing.cost_strategy_graph`) once per distinct key; 16 layers of a
decoder then cost about what one does (the results are the same, tested node by node).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch
import torch.fx as fx

from autotp.passes.rules.experts import EXPERT_ROLE
from autotp.passes.state import WRITES_IN_PLACE

__all__ = ["node_key", "node_keys", "once_per_key", "value_key"]

_NO_KEY = object()
_T = TypeVar("_T")
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _size_key(size: object) -> object:
    """An int, or a symbolic size's expression (the same symbol in every layer)."""
    return (type(size).__name__, size.node.expr) if isinstance(size, _SYMBOLIC) else size


def _value_key(value: object) -> object:
    """:func:`value_key`, with ``_NO_KEY`` for a value that has none."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(_size_key, value.shape)), tuple(map(_size_key, value.stride())),
                value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, _SYMBOLIC):
        return _size_key(value)
    if value is None or isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        keys = tuple(_value_key(v) for v in value)
        return _NO_KEY if any(k is _NO_KEY for k in keys) else (type(value).__name__, keys)
    return _NO_KEY


def value_key(value: object) -> Hashable | None:
    """The key of a recorded value (a tensor, a tuple of them, a symbolic size...); None if it has none."""
    key = _value_key(value)
    return None if key is _NO_KEY else key


def node_keys(nodes: Iterable[fx.Node]) -> dict[fx.Node, Hashable | None]:
    """:func:`node_key` of each of ``nodes`` (in graph order), each value's key made once."""
    values: dict[fx.Node, object] = {}
    keys: dict[fx.Node, Hashable | None] = {}
    for node in nodes:
        keys[node] = _node_key(node, values)
    return keys


def once_per_key(made: dict[Hashable, list[_T]], key: Hashable | None, make: Callable[[], list[_T]]) -> list[_T]:
    """``make()``, called once per ``key`` (kept in ``made``) and copied for every node with that key; called
    every time for a node without a key (None)."""
    if key is None:
        return make()
    if key not in made:
        made[key] = make()
    return list(made[key])


def node_key(node: fx.Node) -> Hashable | None:
    """The key of ``node`` (see the module docstring), or None when a part of it has no key."""
    return _node_key(node, {})


def _node_key(node: fx.Node, values: dict[fx.Node, object]) -> Hashable | None:
    first: dict[fx.Node, int] = {}

    def of_node(arg: fx.Node) -> object:
        if arg not in values:
            values[arg] = _value_key(arg.meta["val"]) if "val" in arg.meta else ("no val",)
        return values[arg]

    def walk(arg: object) -> object:
        if isinstance(arg, fx.Node):
            key = of_node(arg)
            return _NO_KEY if key is _NO_KEY else ("node", first.setdefault(arg, len(first)), key)
        if isinstance(arg, (tuple, list)):
            keys = tuple(walk(a) for a in arg)
            return _NO_KEY if any(k is _NO_KEY for k in keys) else (type(arg).__name__, keys)
        if isinstance(arg, dict):
            keys = tuple((k, walk(v)) for k, v in arg.items())
            return _NO_KEY if any(v is _NO_KEY for _, v in keys) else ("dict", keys)
        return _value_key(arg)

    key = (node.op, node.target, walk(node.args), walk(node.kwargs), of_node(node), bool(node.meta.get(WRITES_IN_PLACE)),
           node.meta.get(EXPERT_ROLE))
    return None if any(part is _NO_KEY for part in key) else key
