"""A :class:`ParallelPlan` made without a search: the model's layer blocks cut into equal stages.

What :func:`autotp.compile` uses when it is given a ``mesh=`` but no ``plan=``, and what tests
build by hand: every stage gets ``n_blocks // pp`` consecutive layer blocks (the first stages one
more when it does not divide), the first stage also runs what comes before the layers (the
embeddings), the last what comes after (final norm, head). Each stage's tensor-parallel plan is
left to the runtime (``tp_plan=None``: planned on the stage's own graph when it is built).

A *layer block* is a child of the model's longest numbered container (``model.layers``,
``transformer.h``): :func:`autotp.base.module_paths.layer_blocks`.
"""

from __future__ import annotations

from torch import nn

from autotp.base.module_paths import layer_blocks
from autotp.planning.mesh_plan import MeshShape, ParallelPlan, StagePlan

__all__ = ["SCHEDULES", "even_parallel_plan", "stage_bounds"]

SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules the mesh runtime runs (``torch.distributed.pipelining`` ScheduleGPipe, Schedule1F1B)."""


def stage_bounds(n_blocks: int, pp: int) -> list[tuple[int, int]]:
    """``[(first_block, stop_block), ...]`` of ``pp`` contiguous stages of ``n_blocks`` blocks, sizes
    differing by at most one (earlier stages the larger). ValueError says the fix when ``pp > n_blocks``."""
    if pp > n_blocks:
        raise ValueError(
            f"pp={pp} pipeline stages need at least {pp} layer blocks to cut between, but the model has "
            f"{n_blocks}; use a mesh with pp <= {max(n_blocks, 1)} (e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp')) "
            "with no 'pp' dim) and give the ranks to 'dp' or 'tp' instead"
        )
    size, extra = divmod(n_blocks, pp)
    bounds, start = [], 0
    for stage in range(pp):
        stop = start + size + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def even_parallel_plan(model: nn.Module, mesh: MeshShape, *, microbatches: int = 1,
                       schedule: str = "gpipe") -> ParallelPlan:
    """A :class:`ParallelPlan` for ``mesh`` cutting ``model``'s layer blocks into ``mesh.pp`` equal stages.

    With ``pp == 1`` the one stage holds every block (a model without layer blocks is fine then)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one the mesh runtime runs; pass one of {', '.join(SCHEDULES)}")
    blocks = layer_blocks(model)
    if mesh.pp == 1:
        stages: tuple[StagePlan, ...] = (StagePlan(0, len(blocks)),)
    else:
        stages = tuple(StagePlan(first, stop, begins_at=blocks[first] if index else "")
                       for index, (first, stop) in enumerate(stage_bounds(len(blocks), mesh.pp)))
    return ParallelPlan(mesh=mesh, stages=stages, microbatches=microbatches, schedule=schedule)
