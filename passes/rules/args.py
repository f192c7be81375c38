"""Reading a node: its arguments, its tensor input slots and the shapes recorded at capture.

Every rule, and the rewrite, reads an ATen call the same way: an argument sits either at its
position in ``node.args`` or under its name in ``node.kwargs`` (:func:`arg`); the tensor
inputs are the fx.Node arguments in (args, kwargs) order (:func:`tensor_inputs`, the slots a
:class:`~autotp.base.strategy.Strategy` places); shapes come from ``node.meta["val"]``, the
FakeTensor capture recorded.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.shapes import concrete_shape

__all__ = ["arg", "holds_tensor", "is_float", "is_tensor", "norm_dim", "shape", "tensor_inputs", "val"]


def arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    """Argument ``name`` of an op call: positional ``index`` if given there, else the keyword, else ``default``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def holds_tensor(node: fx.Node) -> bool:
    """True unless ``node`` computes a scalar (a symbolic size ``sym_size``, ``s0 * 4``, an assert):
    such nodes are no input slots, they carry no placement."""
    value = node.meta.get("val")
    if value is None and "val" not in node.meta:
        return True
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued fx.Node arguments, flattened in (args, kwargs) order: its input slots."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and holds_tensor(a)]


def val(node: fx.Node) -> object:
    """The value capture recorded for ``node`` (a FakeTensor, a tuple of them, a SymInt...)."""
    return node.meta.get("val")


def shape(node: fx.Node) -> tuple[int, ...]:
    """Shape of the node's tensor value (``()`` when it is not a tensor)."""
    value = val(node)
    if isinstance(value, torch.Tensor):
        return concrete_shape(value)  # example sizes where dims are symbolic
    return ()


def is_tensor(node: fx.Node) -> bool:
    """True when the node's value is one tensor."""
    return isinstance(val(node), torch.Tensor)


def is_float(node: fx.Node) -> bool:
    """True when the node's value is one floating-point tensor (a Partial sum needs one)."""
    value = val(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def norm_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim index as a non-negative one."""
    return dim + ndim if dim < 0 else dim
