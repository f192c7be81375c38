"""The Plan: what autotp decided, as data.

A :class:`Plan` records the mesh, the chosen strategy of every graph node, the placement of
every parameter (by FQN), every collective the rewrite will insert, and the predicted cost
broken down per node (the records of :mod:`autotp.planning.decisions`), and prints as a compact per-layer
report (:func:`plan_summary`). It is a frozen value: print it, save it as JSON, load it back, edit it
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

from autotp.adapters.torchao import weight_of
from autotp.base.errors import PlanMismatchError
from autotp.base.placements import Placement, placement_from_str
from autotp.base.reshard import ReshardKind
from autotp.base.shapes import concrete_shape
from autotp.base.strategy import Strategy
from autotp.base.units import format_bytes, format_seconds
from autotp.passes.resharding import is_collective_step, route_label, step_label
from autotp.planning.blocks import Block, BlockRun, block_runs, parameter_bytes_per_rank, placement_counts
from autotp.planning.decisions import Alternative, CollectiveDecision, NodeDecision
from autotp.planning.experts import expert_lines

__all__ = ["Plan", "as_plan", "graph_fingerprint", "graph_lines", "plan_summary"]

PLAN_FORMAT_VERSION = 2
"""Version written by :meth:`Plan.save`. Version 1 plans (no graph edges, shapes or
alternatives on nodes) still load and apply; drawings and ``explain`` are poorer for them."""

_READABLE_VERSIONS = (1, 2)


def _describe(node: fx.Node) -> str:
    val = node.meta.get("val")
    shape = concrete_shape(val) if isinstance(val, torch.Tensor) else None
    target = node.target if node.op == "call_function" else node.op
    return f"{node.name}:{target}:{shape}"


def graph_lines(gm: fx.GraphModule) -> list[str]:
    """One line per node (name, op, shape): what :func:`graph_fingerprint` hashes, readable where two graphs differ."""
    return [_describe(n) for n in gm.graph.nodes]


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of node names, ops and shapes: a plan applies only to the graph it was made for."""
    return hashlib.sha256("\n".join(graph_lines(gm)).encode()).hexdigest()[:16]


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
    # mixture of experts: (form, predicted time of the plan with every MoE block in that form), both forms
    expert_form_times: tuple[tuple[str, float], ...] = ()
    # blocks priced for a measured router load (PlanOptions.expert_load): (module, busiest expert's rows / mean)
    expert_load_imbalance: tuple[tuple[str, float], ...] = ()

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
        communication and weight bytes per layer, identical layers folded (:func:`plan_summary`). The reports (``autotp.explain``, ``autotp.estimate``,
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
            data["expert_form_times"] = tuple((str(f), float(t)) for f, t in data.pop("expert_form_times", []))
            data["expert_load_imbalance"] = tuple((str(m), float(r)) for m, r in data.pop("expert_load_imbalance", []))
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


# ------------------------------------------------------------------------------ text: print(plan)
#
# A compact per-layer report that fits a 100-column terminal:
#
#     header       world size, hardware, predicted time (compute + communication), memory per rank
#     blocks       one row per layer (identical consecutive layers folded: ``model.layers.1-79  x79``)
#                  with its weights' placements, collectives, compute, communication and weight
#                  bytes per rank -- each figure *per block*, the ``x`` column says how many
#     weights      the placement of every weight of each distinct block, by relative name
#     collectives  the collectives of each distinct block: kind, tensor, placements, bytes, time

WIDTH = 100
"""Columns the report fits in."""


def _short_kinds(collectives: list[CollectiveDecision]) -> str:
    counts: Counter[str] = Counter()
    for c in collectives:
        for step in c.steps:
            if is_collective_step(step):
                counts[step_label(step, short=True)] += 1
    return " ".join(f"{k}*{n}" if n > 1 else k for k, n in sorted(counts.items())) or "-"


def _clip(text: str, width: int) -> str:
    """Shorten from the middle: ``model.lay…mlp.up_proj``."""
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2):]


def _time(seconds: float) -> str:
    return format_seconds(seconds) if seconds else "-"


def _block_row(plan: Plan, run: BlockRun) -> str:
    block = run.first
    weights = block.weights(plan.parameters)
    nbytes = sum(parameter_bytes_per_rank(w, plan.world_size) for w in weights)
    placements = placement_counts(weights) or "-"
    placements = placements if len(placements) <= 18 else placements[:17] + "…"
    return (f"{_clip(run.label, 28):<28} {run.count:>3}  {placements:<18} "
            f"{_clip(_short_kinds(block.collectives), 13):<13} {_time(block.compute_s):>10} {_time(block.comm_s):>10} "
            f"{format_bytes(nbytes) if weights else '-':>10}")


def _one_per_weight(items: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A quantized weight's parts (``x.parametrizations.weight.original<i>``) shown as the one weight
    ``x.weight`` with its data's placement and ``q`` (its scales split with it, see passes/quantized.py)."""
    shown: dict[str, str] = {}
    for name, placement in items:
        part = weight_of(name)
        if part is None:
            shown[name] = placement
        elif part[1] == 0:
            shown[part[0]] = f"{placement}q"
    return tuple(shown.items())


def _weights_lines(plan: Plan, runs: list[BlockRun]) -> list[str]:
    """Placement of each weight, once per distinct pattern of relative names and placements."""
    lines = []
    seen: dict[tuple, list[str]] = {}
    patterns: list[tuple[tuple, Block]] = []
    for run in runs:
        weights = run.first.weights(plan.parameters)
        if not weights:
            continue
        key = _one_per_weight(tuple((run.first.relative(w.target), w.output) for w in weights))
        if key not in seen:
            seen[key] = []
            patterns.append((key, run.first))
        seen[key].append(run.label)
    for key, _block in patterns:
        where = seen[key]
        title = ", ".join(where) if len(", ".join(where)) <= 60 else f"{where[0]} ... {where[-1]} ({len(where)} rows)"
        if len(key) == 1 and "." not in key[0][0] and len(where) == 1:
            lines.append(f"  {_clip(title + '.' + key[0][0], 80):<80} {key[0][1]}")
            continue
        lines.append(f"  {title}:")
        items = [f"{_clip(name, 36)} {placement}" for name, placement in key]
        width = max(len(i) for i in items) + 2
        per_line = max(1, (WIDTH - 4) // width)
        for i in range(0, len(items), per_line):
            lines.append("    " + "".join(f"{item:<{width}}" for item in items[i:i + per_line]).rstrip())
    return lines


def _collective_lines(runs: list[BlockRun], max_rows: int) -> list[str]:
    """Collectives of each distinct block, under the block's name; modules relative to the block."""
    rows = []
    for run in runs:
        if not run.first.collectives:
            continue
        rows.append(f"  {run.label}" + (f" (each of {run.count})" if run.count > 1 else "") + ":")
        for c in run.first.collectives:
            kinds = route_label([s for s in c.steps if is_collective_step(s)] or c.steps)
            rows.append(f"    {kinds:<16} {_clip(c.producer, 16):<16} {_clip(c.src + '->' + c.dst, 11):<11} "
                        f"{format_bytes(c.nbytes):>10} {format_seconds(c.time_s):>10}  "
                        f"{_clip(run.first.relative(c.module), 26)}")
    if len(rows) > max_rows:
        rows = [*rows[:max_rows], f"  ... {len(rows) - max_rows} more"]
    return rows


def _training_memory_line(plan: Plan) -> str:
    """Training memory per rank: weights, their gradients, optimizer state, saved activations."""
    parts = [plan.parameter_bytes_per_rank, plan.gradient_bytes_per_rank, plan.optimizer_bytes_per_rank,
             plan.activation_bytes_per_rank]
    checkpointed = " (blocks checkpointed: their inputs + one block's, recomputed)" if plan.activation_checkpointing else ""
    return (f"training memory per rank: {format_bytes(sum(parts))} = weights {format_bytes(parts[0])} + gradients "
            f"{format_bytes(parts[1])} + optimizer {format_bytes(parts[2])} + activations {format_bytes(parts[3])}"
            f"{checkpointed}")


def _training_backward_line(plan: Plan) -> str:
    counts = plan.collective_counts(backward=True)
    if not counts:
        return "collectives per backward: none"
    return ("collectives per backward: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
            + f" ({format_seconds(plan.predicted_backward_comm_s)})")


def _inference_difference_lines(plan: Plan, max_rows: int) -> list[str]:
    """How the training plan differs from the inference plan of the same model: one line per parameter."""
    versus = f"; the inference plan's forward: {format_seconds(plan.inference_time_s)}" if plan.inference_time_s else ""
    if not plan.inference_differences:
        return [f"same parameter placements as the inference plan{versus}"]
    lines = [f"differs from the inference plan in {len(plan.inference_differences)} parameter(s){versus}:"]
    for fqn, inference, training in plan.inference_differences[:max_rows]:
        lines.append(f"  {_clip(fqn, 60):<60} inference {inference:<7} training {training}")
    if len(plan.inference_differences) > max_rows:
        lines.append(f"  ... {len(plan.inference_differences) - max_rows} more")
    return lines


def plan_summary(plan: Plan, max_rows: int = 40) -> str:
    """The text report (see module doc); tables are cut after ``max_rows`` rows."""
    budget = f", budget {format_bytes(plan.memory_budget_bytes)}" if plan.memory_budget_bytes else ", no budget"
    share = plan.predicted_comm_s / plan.predicted_time_s if plan.predicted_time_s else 0.0
    counts = plan.collective_counts()
    solved = f", planned in {plan.plan_time_s:.1f} s" if plan.plan_time_s else ""
    kind = "training plan" if plan.training else "plan"
    what = "training step (forward + backward)" if plan.training else "forward"
    lines = [
        (f"autotp {kind}: tp={plan.world_size} on {plan.hardware} ({plan.runtime_mode}, format v{plan.version}, "
         f"graph {plan.fingerprint}{solved})"),
        (f"predicted {what}: {format_seconds(plan.predicted_time_s)} = compute {format_seconds(plan.predicted_compute_s)}"
        f" + communication {format_seconds(plan.predicted_comm_s)} ({share:.0%})"),
        (f"parameters per rank: {format_bytes(plan.parameter_bytes_per_rank)} of {format_bytes(plan.parameter_bytes_total)}"
        f" ({plan.parameter_bytes_per_rank / max(plan.parameter_bytes_total, 1):.1%}){budget}"),
        "collectives per forward: " + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"),
    ]
    if plan.training:
        lines[3:3] = [_training_memory_line(plan)]
        lines += [_training_backward_line(plan), *_inference_difference_lines(plan, max_rows)]
    if plan.fallback_ops:
        lines.append(_clip("ops without a sharding rule (run replicated): " + ", ".join(plan.fallback_ops), WIDTH))
    lines += expert_lines(plan.nodes, plan.world_size, plan.expert_form_times, max_rows, plan.expert_load_imbalance)
    runs = [r for r in block_runs(plan.nodes, plan.collectives) if r.first.nodes or r.first.collectives]
    lines += ["", (f"{'block':<28} {'x':>3}  {'weights':<18} {'collectives':<13} {'compute':>10} {'comm':>10} "
                  f"{'weights/rk':>10}")]
    shown = [r for r in runs if r.first.name or r.first.collectives or r.first.compute_s]
    lines += [_block_row(plan, run) for run in shown[:max_rows]]
    if len(shown) > max_rows:
        lines.append(f"... {len(shown) - max_rows} more blocks")
    lines.append("(figures per block; x: blocks alike; *n: n of them; AR all-reduce, AG all-gather, RS reduce-scatter)")
    weight_lines = _weights_lines(plan, runs)
    if weight_lines:
        lines += ["", "weight placements:", *weight_lines[: max_rows * 2]]
        if any(weight_of(fqn) for fqn in plan.parameters):
            lines.append("(q: quantized weight, its scales and zero points split with it; plan.parameters lists them)")
    collective_lines = _collective_lines(runs, max_rows)
    if collective_lines:
        lines += ["", f"    {'collective':<16} {'of tensor':<16} {'placement':<11} {'bytes':>10} {'time':>10}  in module",
                  *collective_lines]
    lines += ["", "autotp.explain(plan, name) says why; autotp.to_html(plan, path) draws it;",
              "autotp.diff(plan, other) compares."]
    return "\n".join(line.rstrip() for line in lines)
