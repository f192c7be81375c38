"""The Plan: what autotp decided, as data.

A :class:`Plan` records the mesh, the chosen strategy of every graph node, the placement of
every parameter (by FQN), every collective the rewrite will insert, and the predicted cost
broken down per node. It is a frozen value: print it, save it as JSON, load it back, edit it
by hand and apply it with ``autotp.compile(model, plan=...)``. Loading re-checks the plan
against the model's graph and names exactly what does not match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from collections.abc import Mapping

import torch
import torch.fx as fx

from autotp.errors import PlanMismatchError
from autotp.passes.rules import Strategy
from autotp.placements import placement_from_str, placement_to_str

__all__ = ["CollectiveDecision", "NodeDecision", "Plan", "graph_fingerprint"]

PLAN_FORMAT_VERSION = 1


def _describe(node: fx.Node) -> str:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    target = node.target if node.op == "call_function" else node.op
    return f"{node.name}:{target}:{shape}"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of node names, ops and shapes: a plan applies only to the graph it was made for."""
    text = "\n".join(_describe(n) for n in gm.graph.nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def module_path(node: fx.Node) -> str:
    """The FQN of the innermost module that produced ``node`` (``""`` at the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L__self___", "")


@dataclasses.dataclass(frozen=True)
class NodeDecision:
    """The chosen strategy of one node, with its predicted compute time on one rank."""

    name: str
    op: str
    inputs: tuple[str, ...]
    output: str
    compute_s: float
    module: str = ""
    fallback: bool = False

    def strategy(self) -> Strategy:
        return Strategy(tuple(placement_from_str(p) for p in self.inputs), placement_from_str(self.output))


@dataclasses.dataclass(frozen=True)
class CollectiveDecision:
    """One resharding the rewrite inserts: ``producer``'s output from ``src`` to ``dst``."""

    producer: str
    src: str
    dst: str
    steps: tuple[str, ...]
    nbytes: int
    time_s: float
    consumers: tuple[str, ...]
    module: str = ""


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
    version: int = PLAN_FORMAT_VERSION

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

    def collective_counts(self) -> dict[str, int]:
        """How many of each collective kind one forward pass issues."""
        counts: Counter[str] = Counter()
        for c in self.collectives:
            for step in c.steps:
                if step not in ("slice", "zero"):
                    counts[step] += 1
        return dict(counts)

    # ---------------------------------------------------------------- text
    def summary(self, max_rows: int = 60) -> str:
        """A compact, terminal-width table: parameters, collectives, totals."""
        lines = [
            f"autotp plan: world_size={self.world_size} hardware={self.hardware} "
            f"(plan v{self.version}, graph {self.fingerprint})",
            f"predicted forward: {self.predicted_time_s * 1e3:.3f} ms "
            f"(compute {self.predicted_compute_s * 1e3:.3f} ms, communication {self.predicted_comm_s * 1e3:.3f} ms)",
            f"parameters per rank: {self.parameter_bytes_per_rank / 2**20:.2f} MiB of {self.parameter_bytes_total / 2**20:.2f} MiB "
            f"({self.parameter_bytes_per_rank / max(self.parameter_bytes_total, 1):.1%})"
            + (f", budget {self.memory_budget_bytes / 2**20:.2f} MiB" if self.memory_budget_bytes else ", no budget"),
            "",
            f"{'parameter':<56} placement",
        ]
        params = list(self.parameters.items())
        for fqn, placement in params[:max_rows]:
            lines.append(f"  {fqn:<54} {placement}")
        if len(params) > max_rows:
            lines.append(f"  ... {len(params) - max_rows} more")
        lines.append("")
        lines.append(f"{'collective':<16} {'after node':<28} {'placement':<12} {'bytes':>10} {'time':>10}  module")
        for c in self.collectives[:max_rows]:
            kinds = "+".join(s for s in c.steps if s not in ("slice", "zero")) or "+".join(c.steps)
            lines.append(
                f"  {kinds:<14} {c.producer:<28} {c.src + '->' + c.dst:<12} {c.nbytes:>10} {c.time_s * 1e6:>8.1f}us  {c.module}"
            )
        if len(self.collectives) > max_rows:
            lines.append(f"  ... {len(self.collectives) - max_rows} more")
        counts = self.collective_counts()
        lines.append("collectives per forward: " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"))
        if self.fallback_ops:
            lines.append("ops without a sharding rule (run replicated): " + ", ".join(self.fallback_ops))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["parameters"] = dict(self.parameters)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{source} is not a valid autotp plan: not JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("version") != PLAN_FORMAT_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise PlanMismatchError(
                f"{source} is not an autotp plan of format version {PLAN_FORMAT_VERSION} (found version {found!r}); "
                "re-create it with autotp.plan(...).save(path)"
            )
        try:
            nodes = tuple(NodeDecision(**{**n, "inputs": tuple(n["inputs"])}) for n in data.pop("nodes"))
            collectives = tuple(
                CollectiveDecision(**{**c, "steps": tuple(c["steps"]), "consumers": tuple(c["consumers"])})
                for c in data.pop("collectives")
            )
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
