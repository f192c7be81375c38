"""A plan over a device mesh: data parallel x pipeline parallel x tensor parallel.

The data a mesh search produces (:mod:`autotp.planning`) and the mesh runtime consumes
(:mod:`autotp.runtime`): how many replicas, how many pipeline stages, how many ranks split each
stage's layers, where the stages begin, and each stage's tensor-parallel :class:`Plan`.

Ranks are laid out ``(dp, pp, tp)`` with ``tp`` fastest, as ``init_device_mesh(..., (dp, pp, tp),
mesh_dim_names=("dp", "pp", "tp"))`` lays them out: a tensor-parallel group is ``tp`` consecutive
ranks, so with ``tp`` dividing the devices per node it never spans nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotp.planning.plan import Plan

__all__ = ["MESH_DIM_NAMES", "MeshShape", "ParallelPlan", "StagePlan"]

MESH_DIM_NAMES = ("dp", "pp", "tp")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the three mesh dims; their product is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MeshShape.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the layer blocks ``[first_block, stop_block)`` it runs and their TP plan.

    ``begins_at``: the module FQN where the stage starts (``"model.layers.8"``), the split point
    the pipeline runtime cuts at; ``""`` for the first stage. ``tp_plan``: the tensor-parallel plan
    of the stage's graph over ``tp`` ranks (``None`` when ``tp == 1`` or not planned yet).
    """

    first_block: int
    stop_block: int
    begins_at: str = ""
    tp_plan: Plan | None = None
    predicted_s: float = 0.0
    memory_bytes_per_device: int = 0


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """The chosen mesh, its stages, the pipeline schedule, and the predictions that chose it.

    ``predicted``: named figures (``latency_s``, ``throughput_per_s``, ``memory_bytes_per_device``,
    ...). ``candidates``: every factorization considered, each a dict of the same figures plus
    ``mesh`` (a :class:`MeshShape`), for reports (the chosen one has ``chosen: True``; the
    runner-up ``runner_up: True`` and ``why_lost``). ``layer_blocks``: the module FQN of every
    layer block, in order (``stages[i].first_block`` indexes it). ``tp_summary``: how the search's
    tensor-parallel plan places one layer's weights (each stage's graph gets such a plan).
    """

    mesh: MeshShape
    stages: tuple[StagePlan, ...]
    microbatches: int = 1
    schedule: str = "gpipe"
    objective: str = "latency"
    hardware: str = ""
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    candidates: tuple[dict[str, Any], ...] = ()
    layer_blocks: tuple[str, ...] = ()
    tp_summary: str = ""

    def __post_init__(self) -> None:
        if len(self.stages) != self.mesh.pp:
            raise ValueError(f"a plan for {self.mesh} needs {self.mesh.pp} stages, got {len(self.stages)}")

    @property
    def split_points(self) -> tuple[str, ...]:
        """Module FQNs where stages 1.. begin (what ``torch.distributed.pipelining`` splits at)."""
        return tuple(stage.begins_at for stage in self.stages[1:])

    def __str__(self) -> str:
        from autotp.inspect.mesh_text import parallel_plan_text

        return parallel_plan_text(self)

    def candidates_table(self) -> str:
        """Every factorization considered, one row each, the chosen one marked (``autotp plan`` prints it)."""
        from autotp.inspect.mesh_text import candidates_table

        return candidates_table(self)
