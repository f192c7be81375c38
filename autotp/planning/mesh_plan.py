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
import json
import os
from typing import Any

from autotp.base.errors import PlanMismatchError
from autotp.planning.plan import Plan

__all__ = ["MESH_DIM_NAMES", "PARALLEL_PLAN_FORMAT", "PARALLEL_PLAN_VERSION", "MeshShape", "ParallelPlan", "StagePlan",
           "as_parallel_plan"]

MESH_DIM_NAMES = ("dp", "pp", "tp")
PARALLEL_PLAN_FORMAT = "autotp.ParallelPlan"
PARALLEL_PLAN_VERSION = 1


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
        """Module FQNs where stages 1.. begin (where the mesh runtime cuts the traced graph)."""
        return tuple(stage.begins_at for stage in self.stages[1:])

    def __str__(self) -> str:
        return _parallel_plan_text(self)

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """Versioned JSON of every field; each stage's ``tp_plan`` as a :meth:`Plan.to_json` object."""
        data = {"format": PARALLEL_PLAN_FORMAT, "version": PARALLEL_PLAN_VERSION,
                "mesh": dataclasses.asdict(self.mesh),
                "stages": [{**{f.name: getattr(stage, f.name) for f in dataclasses.fields(stage) if f.name != "tp_plan"},
                            "tp_plan": None if stage.tp_plan is None else json.loads(stage.tp_plan.to_json())}
                           for stage in self.stages],
                "microbatches": self.microbatches, "schedule": self.schedule, "objective": self.objective,
                "hardware": self.hardware, "predicted": dict(self.predicted),
                "candidates": [{**row, "mesh": dataclasses.asdict(row["mesh"])} if isinstance(row.get("mesh"), MeshShape)
                               else dict(row) for row in self.candidates],
                "layer_blocks": list(self.layer_blocks), "tp_summary": self.tp_summary}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> ParallelPlan:
        """The plan :meth:`to_json` wrote; :class:`PlanMismatchError` naming ``source`` and the problem
        for anything else (not JSON, another format or version, a missing or malformed field)."""
        redo = "re-create it with autotp.plan(..., parallelism='auto').save(path)"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{source} is not a valid autotp ParallelPlan: not JSON ({exc}); {redo}") from exc
        if not isinstance(data, dict) or data.get("format") != PARALLEL_PLAN_FORMAT:
            what = (f"format {data.get('format')!r}" if isinstance(data, dict) and "format" in data
                    else "a tensor-parallel Plan (load it with autotp.Plan.load)" if isinstance(data, dict)
                    and "nodes" in data else f"a JSON {type(data).__name__} without format {PARALLEL_PLAN_FORMAT!r}")
            raise PlanMismatchError(f"{source} is not an autotp ParallelPlan: it is {what}; {redo}")
        if data.get("version") != PARALLEL_PLAN_VERSION:
            raise PlanMismatchError(f"{source} is a ParallelPlan of format version {data.get('version')!r}; this autotp "
                                    f"reads version {PARALLEL_PLAN_VERSION}; {redo}")
        try:
            stages = []
            for row in data["stages"]:
                tp_plan = row.pop("tp_plan", None)
                plan = None if tp_plan is None else Plan.from_json(json.dumps(tp_plan), source=f"{source} (a stage's tp_plan)")
                stages.append(StagePlan(**row, tp_plan=plan))
            candidates = tuple({**_tuples(row), "mesh": MeshShape(**row["mesh"])} if isinstance(row.get("mesh"), dict)
                               else _tuples(row) for row in data["candidates"])
            return cls(mesh=MeshShape(**data["mesh"]), stages=tuple(stages), microbatches=data["microbatches"],
                       schedule=data["schedule"], objective=data["objective"], hardware=data["hardware"],
                       predicted=dict(data["predicted"]), candidates=candidates,
                       layer_blocks=tuple(data["layer_blocks"]), tp_summary=data["tp_summary"])
        except PlanMismatchError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise PlanMismatchError(f"{source} is not a valid autotp ParallelPlan: {what}; {redo}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as versioned JSON (:meth:`load` reads it back)."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ParallelPlan:
        """Read a plan written by :meth:`save` (checked against the mesh and model when compiled)."""
        with open(path) as f:
            return cls.from_json(f.read(), source=str(path))

    def candidates_table(self) -> str:
        """Every factorization considered, one row each, the chosen one marked (``autotp plan`` prints it)."""
        return _candidates_table(self)


def _tuples(row: dict[str, Any]) -> dict[str, Any]:
    """A candidate row read from JSON with its lists as the tuples the search wrote."""
    def fix(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(fix(item) for item in value)
        if isinstance(value, dict):
            return {key: fix(item) for key, item in value.items()}
        return value

    return {key: fix(value) for key, value in row.items()}


def as_parallel_plan(plan: object) -> ParallelPlan | None:
    """``plan=`` as ``autotp.compile(mesh=...)`` takes it: a ParallelPlan, the path of a saved one (loaded), or None."""
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"plan={str(plan)!r}: no such file; pass the path of a ParallelPlan saved with "
                                    "plan.save(path), or a ParallelPlan object")
        return ParallelPlan.load(plan)
    return plan  # type: ignore[return-value]  # checked by check_plan_for_mesh


# ---------------------------------------------------------------- text: print(plan), candidates_table()

_GIB = 2**30


def _blocks_label(plan: ParallelPlan, first: int, stop: int) -> str:
    names = plan.layer_blocks
    if stop <= first:
        return "the whole model (no layer blocks)"
    if not names:
        return f"blocks {first}-{stop - 1}"
    if stop - first == 1:
        return names[first]
    return f"{names[first]}-{names[stop - 1].rsplit('.', 1)[-1]}"


def _parallel_plan_text(plan: ParallelPlan) -> str:
    """What ``print(parallel_plan)`` shows."""
    p = plan.predicted
    lines = [f"ParallelPlan: {plan.mesh} = {plan.mesh.world_size} x {plan.hardware or '?'}, "
             f"objective {plan.objective}, {plan.microbatches} microbatch(es), schedule {plan.schedule}"]
    last = len(plan.stages) - 1
    for k, stage in enumerate(plan.stages):
        extra = [what for what, yes in (("+ modules before the first layer", k == 0),
                                        ("+ modules after the last layer", k == last)) if yes]
        lines.append(f"  stage {k}: {_blocks_label(plan, stage.first_block, stage.stop_block)} "
                     f"{' '.join(extra)}".rstrip()
                     + f"  ({stage.predicted_s * 1e3:.3f} ms per microbatch, "
                       f"{stage.memory_bytes_per_device / _GIB:.1f} GiB per device)")
    if plan.tp_summary:
        lines.append(f"  tensor-parallel plan of every layer over tp={plan.mesh.tp}: {plan.tp_summary}")
    if p:
        lines.append(f"  predicted: latency {p.get('latency_s', 0.0) * 1e3:.3f} ms at batch 1; "
                     f"throughput {p.get('throughput_per_s', 0.0):.2f} requests/s at batch "
                     f"{int(p.get('throughput_batch', 0))}; memory {p.get('memory_bytes_per_device', 0.0) / _GIB:.1f} "
                     f"GiB per device")
    return "\n".join(lines)


def _cell(row: dict[str, Any], key: str, scale: float, fmt: str) -> str:
    value = row.get(key)
    width = int(fmt.split(".")[0])
    return format(value * scale, fmt) if value is not None else "-".rjust(width)


def _candidates_table(plan: ParallelPlan) -> str:
    """Every factorization considered: dp, pp, tp, microbatches, latency, throughput, memory; the
    chosen one marked ``*``, and why the runner-up lost."""
    header = (f"  {'dp':>3} {'pp':>3} {'tp':>3} {'micro':>5} {'latency ms':>11} {'throughput/s':>13} "
              f"{'GiB/device':>10}  note")
    memory_key = "latency_memory_bytes" if plan.objective == "latency" else "memory_bytes_per_device"
    lines = [f"factorizations of {plan.mesh.world_size} devices considered (objective {plan.objective}; throughput "
             f"at batch {int(plan.predicted.get('throughput_batch', 0))} with 'micro' microbatches per replica; "
             f"memory for the {plan.objective} run):", header]
    runner_up = None
    for row in plan.candidates:
        mesh = row["mesh"]
        mark = "*" if row.get("chosen") else " "
        note = row.get("note", "") or ("chosen" if row.get("chosen") else "runner-up" if row.get("runner_up") else "")
        if row.get("runner_up"):
            runner_up = row
        lines.append(f"{mark} {mesh.dp:>3} {mesh.pp:>3} {mesh.tp:>3} {row.get('microbatches', '-')!s:>5} "
                     f"{_cell(row, 'latency_s', 1e3, '11.3f')} {_cell(row, 'throughput_per_s', 1, '13.2f')} "
                     f"{_cell(row, memory_key, 1 / _GIB, '10.1f')}  {note}")
    if runner_up is not None:
        lines.append(f"runner-up {runner_up['mesh']} lost: {runner_up['why_lost']}")
    return "\n".join(lines)
