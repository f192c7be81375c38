"""autotp: automatic tensor parallelism for PyTorch.

``autotp.compile(model, world_size=N, example_inputs=...)`` traces the model, plans how to split
every heavy op across ranks with a cost model and an exact MILP solver, and returns this rank's
tensor-parallel module. ``autotp.plan(...)`` only decides (no process group, meta weights fine).
Over a ``DeviceMesh`` (data x pipeline x tensor parallel): ``autotp.plan_mesh`` and
``autotp.compile_mesh``. Knobs beyond the common keywords travel in ``autotp.PlanOptions``
(``options=``) and ``autotp.RuntimeOptions`` (``runtime=``).
``torch.compile(model, backend=autotp.backend(...))`` (or ``backend="autotp"``) does the same
for every graph Dynamo captures. ``autotp.plan_graph(captured, autotp.PlanOptions(...))`` is the
one planner behind all three (see ``autotp.planning.planner``). For models bigger than one
device, ``autotp.from_pretrained(path, world_size)`` and ``autotp.compile(meta_model, ...,
checkpoint=path)`` read only each rank's blocks from safetensors; ``tp.save(dir)`` and
``autotp.load(dir, meta_model, world_size)`` save and reload at any world size. ``print(plan)`` shows
a plan; the reports read one: ``autotp.explain(plan, name)``, ``autotp.estimate(plan)``,
``autotp.diff(plan, other)``, ``autotp.to_html(plan, path)``, ``autotp.to_dot(plan)``,
``autotp.to_svg(plan, path)``, ``autotp.to_parallelize_plan(plan)`` (see ``autotp.inspect``).

State of the graph after each step (see ``autotp.api``):

1. capture: ATen FX graph from ``torch.export``; parameters are placeholders; shapes on nodes.
2. strategies: unchanged graph + candidate placements per node (``autotp.passes.strategies``).
3. cost: + predicted seconds/bytes per candidate (``autotp.passes.costing``, ``autotp.cost_model``).
4. solve: one strategy per node (``autotp.passes.solver``) -> :class:`Plan` (data).
5. rewrite: a new rank-local graph with local shapes and functional collectives
   (``autotp.passes.rewrite``); the captured graph is never mutated.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public names and the module each lives in. They load on first use (PEP 562), so the command
# line (``autotp --help``) and ``import autotp.cost_model`` do not import torch's whole stack.
_EXPORTS = {
    "compile": "autotp.api",
    "compile_mesh": "autotp.api",
    "plan": "autotp.api",
    "plan_mesh": "autotp.api",
    "from_pretrained": "autotp.pretrained",
    "load": "autotp.pretrained",
    "backend": "autotp.dynamo_backend",
    "diff": "autotp.inspect",
    "estimate": "autotp.inspect",
    "explain": "autotp.inspect",
    "to_dot": "autotp.inspect",
    "to_html": "autotp.inspect",
    "to_parallelize_plan": "autotp.inspect",
    "to_svg": "autotp.inspect",
    "AgreementError": "autotp.base.errors",
    "AutoTPError": "autotp.base.errors",
    "CaptureError": "autotp.base.errors",
    "CheckpointError": "autotp.base.errors",
    "InputShapeError": "autotp.base.errors",
    "PlanError": "autotp.base.errors",
    "PeerFailedError": "autotp.base.errors",
    "PlanMismatchError": "autotp.base.errors",
    "RankTimeoutError": "autotp.base.errors",
    "RuntimeModeError": "autotp.base.errors",
    "TracedValueError": "autotp.base.errors",
    "UnsupportedOpError": "autotp.base.errors",
    "UnsupportedModelError": "autotp.base.errors",
    "UnsupportedQuantizationError": "autotp.base.errors",
    "UnsupportedReleaseError": "autotp.base.errors",
    "Partial": "autotp.base.placements",
    "Replicate": "autotp.base.placements",
    "Shard": "autotp.base.placements",
    "Plan": "autotp.planning.plan",
    "MeshShape": "autotp.planning.mesh_plan",
    "ParallelPlan": "autotp.planning.mesh_plan",
    "PlanOptions": "autotp.planning.options",
    "plan_graph": "autotp.planning.planner",
    "ExpertLoad": "autotp.planning.expert_load",
    "measure_expert_load": "autotp.calibration.expert_load",
    "TensorParallelModule": "autotp.runtime.execution.module",
    "MeshParallelModule": "autotp.runtime.mesh.mesh_module",
    "MeshGenerationModule": "autotp.runtime.mesh.mesh_generate",
    "RuntimeOptions": "autotp.runtime.execution.options",
}

if TYPE_CHECKING:
    from autotp.api import compile, compile_mesh, plan, plan_mesh
    from autotp.base.errors import (
        AgreementError,
        AutoTPError,
        CaptureError,
        CheckpointError,
        InputShapeError,
        PeerFailedError,
        PlanError,
        PlanMismatchError,
        RankTimeoutError,
        RuntimeModeError,
        TracedValueError,
        UnsupportedModelError,
        UnsupportedOpError,
        UnsupportedQuantizationError,
        UnsupportedReleaseError,
    )
    from autotp.base.placements import Partial, Replicate, Shard
    from autotp.calibration.expert_load import measure_expert_load
    from autotp.dynamo_backend import backend
    from autotp.inspect import diff, estimate, explain, to_dot, to_html, to_parallelize_plan, to_svg
    from autotp.planning.expert_load import ExpertLoad
    from autotp.planning.mesh_plan import MeshShape, ParallelPlan
    from autotp.planning.options import PlanOptions
    from autotp.planning.plan import Plan
    from autotp.planning.planner import plan_graph
    from autotp.pretrained import from_pretrained, load
    from autotp.runtime.execution.module import TensorParallelModule
    from autotp.runtime.execution.options import RuntimeOptions
    from autotp.runtime.mesh.mesh_generate import MeshGenerationModule
    from autotp.runtime.mesh.mesh_module import MeshParallelModule


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "AgreementError",
    "AutoTPError",
    "CaptureError",
    "CheckpointError",
    "ExpertLoad",
    "InputShapeError",
    "MeshGenerationModule",
    "MeshParallelModule",
    "MeshShape",
    "ParallelPlan",
    "Partial",
    "PeerFailedError",
    "Plan",
    "PlanError",
    "PlanOptions",
    "PlanMismatchError",
    "RankTimeoutError",
    "Replicate",
    "RuntimeModeError",
    "RuntimeOptions",
    "Shard",
    "TensorParallelModule",
    "TracedValueError",
    "UnsupportedModelError",
    "UnsupportedOpError",
    "UnsupportedQuantizationError",
    "UnsupportedReleaseError",
    "backend",
    "compile",
    "compile_mesh",
    "diff",
    "estimate",
    "explain",
    "from_pretrained",
    "load",
    "measure_expert_load",
    "plan",
    "plan_graph",
    "plan_mesh",
    "to_dot",
    "to_html",
    "to_parallelize_plan",
    "to_svg",
]
__version__ = "0.1.0"
