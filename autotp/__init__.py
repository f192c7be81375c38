"""autotp: automatic tensor parallelism for PyTorch.

``autotp.compile(model, world_size, example_inputs=...)`` traces the model, plans how to split
every heavy op across ranks with a cost model and an exact MILP solver, and returns this rank's
tensor-parallel module. ``autotp.plan(...)`` only decides (no process group, meta weights fine).
``torch.compile(model, backend=autotp.backend(...))`` (or ``backend="autotp"``) does the same
for every graph Dynamo captures.

State of the graph after each step (see ``autotp.api``):

1. capture: ATen FX graph from ``torch.export``; parameters are placeholders; shapes on nodes.
2. strategies: unchanged graph + candidate placements per node (``autotp.passes.strategies``).
3. cost: + predicted seconds/bytes per candidate (``autotp.passes.costing``, ``autotp.cost_model``).
4. solve: one strategy per node (``autotp.passes.solver``) -> :class:`Plan` (data).
5. rewrite: a new rank-local graph with local shapes and functional collectives
   (``autotp.passes.rewrite``); the captured graph is never mutated.
"""

from autotp.api import compile, plan
from autotp.backend import backend
from autotp.errors import AutoTPError, CaptureError, PlanError, PlanMismatchError, UnsupportedOpError
from autotp.placements import Partial, Replicate, Shard
from autotp.plan import Plan
from autotp.runtime import TensorParallelModule

__all__ = [
    "AutoTPError",
    "CaptureError",
    "Partial",
    "Plan",
    "PlanError",
    "PlanMismatchError",
    "Replicate",
    "Shard",
    "TensorParallelModule",
    "UnsupportedOpError",
    "backend",
    "compile",
    "plan",
]
__version__ = "0.1.0"
