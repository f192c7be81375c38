"""The Plan: what autotp decided, as data.

A :class:`Plan` records the mesh, the chosen strategy of every graph node, the placement of
every parameter (by FQN), every collective the rewrite will insert, and the predicted cost
broken down per node. It is a frozen value: print it, save it as JSON, load it back, edit it
by hand and apply it with ``autotp.compile(model, plan=...)``. Loading re-checks the plan
against the model's graph and names exactly what does not match.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections import Counter
from collections.abc import Mapping

import torch
import torch.fx as fx

from autotp.base.errors import PlanMismatchError
from autotp.base.placements import Placement, placement_from_str
from autotp.base.reshard import ReshardKind
from autotp.base.shapes import concrete_shape
from autotp.base.strategy import Strategy
from autotp.passes.resharding import is_collective_step
from autotp.planning.plan_text import plan_summary

__all__ = ["Alternative", "CollectiveDecision", "NodeDecision", "Plan", "as_plan", "graph_fingerprint"]

PLAN_FORMAT_VERSION = 2
"""Version written by :meth:`Plan.save`. Version 1 plans (no graph edges, shapes or
alternatives on nodes) still load and apply; drawings and ``explain`` are poorer for them."""

_READABLE_VERSIONS = (1, 2)


def _describe(node: fx.Node) -> str:
    val = node.meta.get("val")
    shape = concrete_shape(val) if isinstance(val, torch.Tensor) else None
    target = node.target if node.op == "call_function" else node.op
    return f"{node.name}:{target}:{shape}"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of node names, ops and shapes: a plan applies only to the graph it was made for."""
    text = "\n".join(_describe(n) for n in gm.graph.nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_EXPORT_ADDED_NODE = "_empty_nn_module_stack_from_metadata_hook"


def module_path(node: fx.Node) -> str:
    """The FQN of the innermost module that produced ``node`` (``""`` at the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    # nodes export adds itself (e.g. the sym_size reads of dynamic dims) carry a placeholder entry
    paths = [path for key, (path, *_) in stack.items() if key != _EXPORT_ADDED_NODE]
    if not paths:
        return ""
    path = paths[-1]
    return path.replace("L['self'].", "").replace("L__self___", "")


@dataclasses.dataclass(frozen=True)
class Alternative:
    """Another strategy a node could have taken, priced with its neighbours' choices held fixed.

    ``delta_s`` = ``compute_delta_s`` + the sum of ``comm_delta_s``: predicted seconds per forward
    pass relative to the chosen strategy (positive: slower). ``comm_delta_s`` is split by
    resharding kind (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_gather+slice``...)
    on the node's input and output edges. ``delta_s`` is ``None`` when the strategy is not
    possible while the neighbours keep their choices (``note`` says why, e.g. a parameter would
    have to be gathered); ``memory_delta_bytes`` is the change in parameter bytes per rank (in a
    training plan: with their gradients and optimizer state). In a training plan the deltas are
    per training step, backward reshardings included (kinds prefixed ``backward``).
    """

    strategy: str
    delta_s: float | None
    compute_delta_s: float = 0.0
    comm_delta_s: tuple[tuple[str, float], ...] = ()
    memory_delta_bytes: int = 0
    note: str = ""


@dataclasses.dataclass(frozen=True)
class NodeDecision:
    """The chosen strategy of one node, with its predicted compute time on one rank.

    ``input_nodes`` names the producer of each input slot (the graph's edges); ``target`` is the
    FQN of a parameter/buffer/constant placeholder (``""`` otherwise); ``shape``/``dtype``
    describe the node's (first) output tensor; ``alternatives`` are the other candidate
    strategies, cheapest first (at most a handful; see :class:`Alternative`).
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    output: str
    compute_s: float
    module: str = ""
    fallback: bool = False
    input_nodes: tuple[str, ...] = ()
    target: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    alternatives: tuple[Alternative, ...] = ()

    def strategy(self) -> Strategy:
        return Strategy(tuple(placement_from_str(p) for p in self.inputs), placement_from_str(self.output))


@dataclasses.dataclass(frozen=True)
class CollectiveDecision:
    """One resharding the rewrite inserts: ``producer``'s output from ``src`` to ``dst``.

    ``steps``: the kinds of the route's steps (saved by name: ``"all_gather"``, ``"slice"``...).
    """

    producer: str
    src: str
    dst: str
    steps: tuple[ReshardKind, ...]
    nbytes: int
    time_s: float
    consumers: tuple[str, ...]
    module: str = ""


def _plain(value: object) -> object:
    """``dataclasses.asdict(value)`` for the plan's frozen values, without copying the leaves (which
    are immutable): dataclasses become dicts, tuples and lists lists, mappings dicts."""
    if isinstance(value, (str, int, float, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in _field_names(type(value))}
    return value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _node_from_json(data: dict) -> NodeDecision:
    alternatives = tuple(
        Alternative(**{**a, "comm_delta_s": tuple((str(k), float(v)) for k, v in a.get("comm_delta_s", ()))})
        for a in data.get("alternatives", ())
    )
    return NodeDecision(**{
        **data,
        "inputs": tuple(data["inputs"]),
        "input_nodes": tuple(data.get("input_nodes", ())),
        "shape": tuple(int(d) for d in data.get("shape", ())),
        "alternatives": alternatives,
    })


@dataclasses.dataclass(frozen=True)
class Plan:
    """A tensor-parallel plan for one model graph on a one-axis mesh of ``world_size`` ranks.

    ``parameters`` maps each parameter FQN to its placement text (``R``, ``S(0)``...);
    ``parameter_bytes_per_rank`` is the predicted bytes of the largest rank's shards;
    predicted times are seconds per forward pass on ``hardware``.
    """

    world_size: int
    hardware: str
    nodes: tuple[NodeDecision, ...]
    parameters: Mapping[str, str]
    collectives: tuple[CollectiveDecision, ...]
    parameter_bytes_total: int
    parameter_bytes_per_rank: int
    memory_budget_bytes: float | None
    predicted_compute_s: float
    predicted_comm_s: float
    fallback_ops: tuple[str, ...]
    fingerprint: str
    plan_time_s: float = 0.0
    solver_status: str = ""
    solver_gap: float = 0.0  # relative optimality gap HiGHS reports (0 when solved to optimality)
    version: int = PLAN_FORMAT_VERSION
    # a training plan (PlanOptions(training=True)): predicted times are per forward + backward step
    training: bool = False
    backward_collectives: tuple[CollectiveDecision, ...] = ()  # what autograd issues (nothing is inserted)
    predicted_backward_comm_s: float = 0.0  # the part of predicted_comm_s spent in the backward
    gradient_bytes_per_rank: int = 0
    optimizer_bytes_per_rank: int = 0
    activation_bytes_per_rank: int = 0  # kept for the backward, at the example's batch and sequence
    inference_differences: tuple[tuple[str, str, str], ...] = ()  # (FQN, inference placement, training placement)
    inference_time_s: float = 0.0  # predicted forward of the inference plan of the same graph and options
    # "blocks": activations and times count checkpointed blocks (PlanOptions.activation_checkpointing)
    activation_checkpointing: str = ""
    runtime_mode: str = "eager"  # how the priced rank-local graph runs (Hardware.runtime_mode): eager, compiled, cuda_graph

    # ---------------------------------------------------------------- lookups
    @property
    def mesh(self) -> dict[str, int]:
        return {"tp": self.world_size}

    @property
    def predicted_time_s(self) -> float:
        return self.predicted_compute_s + self.predicted_comm_s

    def decisions(self) -> dict[str, Strategy]:
        """Node name -> chosen :class:`Strategy` (what the rewrite applies)."""
        return {d.name: d.strategy() for d in self.nodes}

    def reshard_routes(self) -> dict[tuple[str, Placement], tuple[ReshardKind, ...]]:
        """(producer, placement a consumer needs) -> the kinds of the resharding steps chosen for it."""
        return {(c.producer, placement_from_str(c.dst)): c.steps for c in self.collectives}

    def collective_counts(self, *, backward: bool = False) -> dict[str, int]:
        """How many of each collective kind one forward pass issues (``backward``: one backward pass
        of a training plan)."""
        counts: Counter[str] = Counter()
        for c in self.backward_collectives if backward else self.collectives:
            for step in c.steps:
                if is_collective_step(step):
                    counts[str(step)] += 1
        return dict(counts)

    # ---------------------------------------------------------------- text
    def summary(self, max_rows: int = 40) -> str:
        """A compact per-layer table that fits 100 columns: placements, collectives, compute,
        communication and weight bytes per layer, identical layers folded (see
        :mod:`autotp.planning.plan_text`). The reports (``autotp.explain``, ``autotp.estimate``,
        ``autotp.diff``, ``autotp.to_html``...) are functions of :mod:`autotp.inspect` that read a plan."""
        return plan_summary(self, max_rows)

    def __str__(self) -> str:
        return self.summary()

    # ---------------------------------------------------------------- JSON
    def to_json(self, *, indent: int | None = 1) -> str:
        """The plan as JSON text (:meth:`from_json` reads it back). ``indent=None`` writes it on one line,
        about three times sooner (the plan cache's form; :meth:`save` keeps the indented one)."""
        return json.dumps(_plain(self), indent=indent)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{source} is not a valid autotp plan: not JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("version") not in _READABLE_VERSIONS:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise PlanMismatchError(
                f"{source} is not an autotp plan of a format version this autotp reads "
                f"({', '.join(map(str, _READABLE_VERSIONS))}; found version {found!r}); "
                "re-create it with autotp.plan(...).save(path)"
            )
        try:
            nodes = tuple(_node_from_json(n) for n in data.pop("nodes"))
            def collectives_of(rows: list[dict]) -> tuple[CollectiveDecision, ...]:
                return tuple(
                    CollectiveDecision(**{**c, "steps": tuple(ReshardKind.from_name(s) for s in c["steps"]),
                                           "consumers": tuple(c["consumers"])})
                    for c in rows
                )

            collectives = collectives_of(data.pop("collectives"))
            data["backward_collectives"] = collectives_of(data.pop("backward_collectives", []))
            data["inference_differences"] = tuple(tuple(d) for d in data.pop("inference_differences", []))
            for node in nodes:
                node.strategy()  # parses every placement: fail here, not during the rewrite
            return cls(nodes=nodes, collectives=collectives, fallback_ops=tuple(data.pop("fallback_ops")), **data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanMismatchError(f"{source} is not a valid autotp plan: {exc}") from exc

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as versioned JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by :meth:`save` (checked against a model when applied)."""
        with open(path) as f:
            return cls.from_json(f.read(), source=str(path))

    # ---------------------------------------------------------------- checks
    def check_matches(self, gm: fx.GraphModule, world_size: int) -> None:
        """Raise :class:`PlanMismatchError` naming every difference between this plan and ``gm``."""
        problems = []
        if world_size != self.world_size:
            problems.append(f"plan is for world_size={self.world_size}, asked for {world_size}")
        names = {n.name: n for n in gm.graph.nodes}
        planned = {d.name for d in self.nodes}
        missing = [n for n in names if n not in planned]
        extra = [n for n in planned if n not in names]
        if missing:
            problems.append(f"graph nodes with no decision: {', '.join(missing[:10])}")
        if extra:
            problems.append(f"decisions for nodes not in the graph: {', '.join(extra[:10])}")
        if not problems and graph_fingerprint(gm) != self.fingerprint:
            problems.append(
                "the graph's ops or shapes differ from the ones the plan was made for (fingerprint "
                f"{graph_fingerprint(gm)} != {self.fingerprint}); trace with the same example input shapes"
            )
        if problems:
            raise PlanMismatchError("plan does not match the model:\n  - " + "\n  - ".join(problems))


def as_plan(plan: object) -> Plan | None:
    """``plan=`` as given to ``autotp.compile``: a Plan, a path to a saved plan (loaded), or ``None``."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"plan={str(plan)!r}: no such file; pass the path of a plan saved with "
                                    "plan.save(path) or `autotp plan ... --json path`, or a Plan object")
        return Plan.load(plan)
    if isinstance(plan, Mapping):
        raise TypeError("plan= got a dict; pass a Plan: autotp.Plan.load(path) for a saved file (or the path itself), "
                        "or autotp.Plan.from_json(json.dumps(d)) for a dict read from JSON")
    raise TypeError(f"plan= must be a Plan, a path to a saved plan, or None; got {type(plan).__name__}")
