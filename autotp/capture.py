"""Capture: ``nn.Module`` + example inputs -> ATen-level FX graph with shapes on every node.

``torch.export.export(strict=False)`` gives a graph in which parameters, buffers and constants
are lifted to placeholders; ``node.meta["val"]`` holds a FakeTensor (shape, dtype) for every
node. We keep that lifted form: the planner sees a parameter as an input it may split, and
the runtime feeds each rank its own shard in the parameter's place.

After capture the graph is *unchanged in meaning*; only ``_assert_tensor_metadata`` checks
(which export adds and which say nothing about layout) are removed.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autotp.errors import CaptureError

__all__ = ["CapturedGraph", "InputSlot", "capture", "from_exported"]

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class InputSlot:
    """One placeholder of the captured graph: where its value comes from at run time.

    ``kind`` is ``"parameter"``, ``"buffer"``, ``"constant"`` or ``"user"``; ``target`` is the
    FQN of a parameter/buffer/constant, or the index into the flattened user inputs.
    """

    name: str
    kind: str
    target: str | int


@dataclasses.dataclass
class CapturedGraph:
    """The traced model: graph, where each placeholder's value comes from, input/output specs."""

    graph_module: fx.GraphModule
    inputs: list[InputSlot]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    exported: ExportedProgram

    def parameter_fqns(self) -> dict[str, str]:
        """Placeholder name -> parameter FQN (e.g. ``model.layers.0.mlp.up_proj.weight``)."""
        return {s.name: str(s.target) for s in self.inputs if s.kind == "parameter"}


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch (the user's or a model library's code)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return None
    frame = frames[-1]
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}\n    {frame.line}'


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
) -> CapturedGraph:
    """Trace ``model(*example_inputs, **example_kwargs)`` with ``torch.export`` (non-strict).

    Raises :class:`CaptureError` naming the cause and the line of the model's code when the
    model cannot be exported (data-dependent control flow, unsupported Python, ...).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autotp needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}; "
            "for one input write example_inputs=(x,)"
        )
    try:
        with torch.no_grad():
            exported = torch.export.export(model, example_inputs, example_kwargs or {}, strict=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with the user's line
        where = _user_frame(exc)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            "autotp traces the model with torch.export (non-strict). Make the forward pass free of "
            "Python control flow that depends on tensor values (use torch.where / torch.cond), "
            "or pass example inputs that match what forward() expects."
        )
        location = f"\n  at {where}" if where else ""
        raise CaptureError(f"could not trace {type(model).__name__}: {type(exc).__name__}: {first_line}{location}\n{hint}") from exc

    return from_exported(exported, type(model).__name__)


def from_exported(exported: ExportedProgram, what: str) -> CapturedGraph:
    """The :class:`CapturedGraph` of an ``ExportedProgram`` (``what`` names the traced callable in errors).

    Shared by :func:`capture` and the ``torch.compile`` backend, which exports Dynamo's graph.
    """
    from torch.export.graph_signature import OutputKind

    mutated = [str(o.target) for o in exported.graph_signature.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if mutated:
        raise CaptureError(
            f"{what}.forward updates state in place: {', '.join(mutated)}. autotp plans "
            "inference graphs whose buffers do not change; call model.eval() (e.g. BatchNorm running stats) "
            "or move the update out of forward()."
        )
    gm = exported.graph_module
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = exported.graph_signature.input_specs
    if len(specs) != len(placeholders):
        raise CaptureError(f"export produced {len(placeholders)} placeholders but {len(specs)} input specs")
    kinds = {
        InputKind.PARAMETER: "parameter",
        InputKind.BUFFER: "buffer",
        InputKind.CONSTANT_TENSOR: "constant",
        InputKind.USER_INPUT: "user",
    }
    slots: list[InputSlot] = []
    user_index = 0
    for node, spec in zip(placeholders, specs):
        kind = kinds.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported export input kind {spec.kind} for {node.name}")
        if kind == "user":
            slots.append(InputSlot(node.name, kind, user_index))
            user_index += 1
        else:
            slots.append(InputSlot(node.name, kind, str(spec.target)))
    return CapturedGraph(gm, slots, exported.call_spec.in_spec, exported.call_spec.out_spec, exported)
