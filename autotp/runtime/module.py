"""Runtime: run one rank's rewritten graph with that rank's parameter shards.

:class:`TensorParallelModule` is what :func:`autotp.compile` returns. It holds the
rank-local ``torch.fx.GraphModule``, the local shards of split parameters (sliced once from
the full weights at compile time; the full tensors are not kept), the replicated parameters
and buffers, and the pytree specs that give outputs the original structure (tensors,
tuples, dicts, HuggingFace ``ModelOutput``).

Shapes: the graph was traced with dynamic batch and sequence dims (see :mod:`autotp.capture`),
so one module serves every size with no re-trace; each call's sizes are first checked against
the traced ones (:class:`~autotp.runtime.input_check.InputShapeCheck`), so a static dim called
at another size raises an error naming it instead of failing inside the graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.placements import placement_from_str, split_of
from autotp.capture import CapturedGraph
from autotp.passes.rewrite import COLLECTIVE_OPS, is_collective
from autotp.passes.uneven import Partitions
from autotp.planning.plan import Plan
from autotp.runtime.input_check import InputShapeCheck

__all__ = ["TensorParallelModule", "shard_tensor"]


def shard_tensor(full: torch.Tensor, placement_text: str, parts: Partitions, name: str, rank: int) -> torch.Tensor:
    """This rank's block of ``full`` under ``placement_text`` (a contiguous copy, so ``full`` can be freed)."""
    split = split_of(placement_from_str(placement_text))
    if split is None:
        return full.detach()
    dim, blocks = split
    offset, length = parts.local(name, dim, rank, blocks)
    block = full.shape[dim] // blocks
    pieces = [full.detach().narrow(dim, b * block + offset, length) for b in range(blocks)]
    return torch.cat(pieces, dim).clone() if blocks > 1 else pieces[0].clone()


class TensorParallelModule(torch.nn.Module):
    """One rank's tensor-parallel model: same call signature and outputs as the original.

    Attributes:
        plan: the :class:`~autotp.Plan` that was applied.
        graph_module: the rank-local ``torch.fx.GraphModule`` that runs.
        rank, world_size: this process's place in the tensor-parallel group.
    """

    def __init__(self, captured: CapturedGraph, graph_module: fx.GraphModule, plan: Plan,
                 local_values: dict[str, torch.Tensor], rank: int) -> None:
        super().__init__()
        self.plan = plan
        self.graph_module = graph_module
        self.rank = rank
        self.world_size = plan.world_size
        self._slots = captured.inputs
        self._in_spec = captured.in_spec
        self._out_spec = captured.out_spec
        self._check_shapes = InputShapeCheck(captured)  # static dims must keep their traced size
        self._fqn_of = {s.name: str(s.target) for s in captured.inputs if s.kind != "user"}
        self._param_names = {s.name for s in captured.inputs if s.kind == "parameter"}
        self._local = torch.nn.ParameterDict()
        self._buffers_local: dict[str, torch.Tensor] = {}
        for slot in captured.inputs:
            if slot.kind == "user":
                continue
            key = slot.name
            if slot.kind == "parameter":
                self._local[key] = torch.nn.Parameter(local_values[key], requires_grad=False)
            else:
                self.register_buffer(key, local_values[key], persistent=False)
                self._buffers_local[key] = local_values[key]

    def local_state(self) -> dict[str, torch.Tensor]:
        """FQN -> this rank's tensor (a shard for split parameters)."""
        out = {}
        for slot in self._slots:
            if slot.kind == "parameter":
                out[str(slot.target)] = self._local[slot.name]
            elif slot.kind != "user":
                out[str(slot.target)] = getattr(self, slot.name)
        return out

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (shards of split ones, whole replicated ones)."""
        return sum(p.numel() * p.element_size() for p in self._local.values())

    def collective_counts(self) -> dict[str, int]:
        """Collectives in the rank-local graph, by kind (one forward pass issues each once)."""
        counts: dict[str, int] = {}
        for node in self.graph_module.graph.nodes:
            if is_collective(node):
                kind = COLLECTIVE_OPS[node.target]
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        kw_spec = self._in_spec.child(1)
        expected = list(kw_spec.context) if kw_spec.context is not None else []
        if set(kwargs) != set(expected):
            raise TypeError(
                f"this tensor-parallel model was traced with keyword arguments {sorted(expected)}, "
                f"got {sorted(kwargs)}; call it the way it was traced or compile it again with these arguments"
            )
        ordered = {k: kwargs[k] for k in expected}
        flat, spec = pytree.tree_flatten((args, ordered))
        if spec != self._in_spec:
            raise TypeError(
                "inputs do not have the structure the model was traced with "
                f"(expected {self._in_spec}, got {spec}); pass the same kinds of arguments as example_inputs"
            )
        return flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._flatten_inputs(args, kwargs)
        self._check_shapes(flat)
        values = []
        for slot in self._slots:
            if slot.kind == "user":
                values.append(flat[int(slot.target)])
            elif slot.kind == "parameter":
                values.append(self._local[slot.name])
            else:
                values.append(getattr(self, slot.name))
        with torch.no_grad():
            outputs = self.graph_module(*values)
        return pytree.tree_unflatten(list(outputs), self._out_spec)
