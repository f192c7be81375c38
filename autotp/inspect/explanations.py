"""Why the plan is what it is: ``autotp.explain(plan, name)`` and ``autotp.diff(plan, other)``, read from
the plan alone.

Each node's alternatives (its other candidate strategies, priced with the neighbours' choices
held fixed) are priced when the plan is built, by
:func:`autotp.planning.alternatives.node_alternatives`, and stored on each
:class:`~autotp.planning.plan.NodeDecision`; this module only reads and formats them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from autotp.adapters.torchao import part_label, weight_of
from autotp.base.units import format_bytes, format_seconds
from autotp.planning.alternatives import strategy_text
from autotp.planning.decisions import Alternative, CollectiveDecision, NodeDecision
from autotp.planning.experts import explain_experts
from autotp.planning.plan import Plan

__all__ = ["PlanDiff", "describe_alternative", "diff", "explain", "find_node"]


def _verb(strategy: str) -> str:
    """What taking ``strategy`` means, in words."""
    out = strategy.rsplit("->", 1)[-1].strip()
    inputs = strategy.split("->", 1)[0] if "->" in strategy else ""
    if out == "R" and all(p.strip() == "R" for p in inputs.strip("() ").split(",") if p.strip()):
        return "replicating this"
    if out == "R":
        return f"running this as {strategy}"
    if out == "P":
        return f"leaving a partial sum ({strategy})"
    if out.startswith("S("):
        dim = out[2:out.index(")")]
        how = f"splitting this along dim {dim}"
        return how if not inputs else f"{how} ({strategy})"
    return f"taking {strategy}"


def describe_alternative(alt: Alternative, part_names: Mapping[str, str] | None = None) -> str:
    """One line: ``replicating this would cost +1.800 ms (all_gather +1.700 ms, compute +0.100 ms)``; with
    ``part_names`` (:func:`_part_names` of the plan), a quantized weight's parts named in the note are named as
    the weight."""
    note = _readable(alt.note, part_names) if alt.note and part_names else alt.note
    if alt.delta_s is None:
        return f"{_verb(alt.strategy)}: not possible while its neighbours keep their choices: {note}"
    parts = [f"{kind} {format_seconds(v, signed=True)}" for kind, v in sorted(alt.comm_delta_s, key=lambda kv: -abs(kv[1]))]
    if abs(alt.compute_delta_s) > 1e-15:
        parts.append(f"compute {format_seconds(alt.compute_delta_s, signed=True)}")
    verb = "would cost" if alt.delta_s > 0 else "would save" if alt.delta_s < 0 else "would cost the same"
    amount = "" if alt.delta_s == 0 else f" {format_seconds(abs(alt.delta_s))}"
    line = f"{_verb(alt.strategy)} {verb}{amount}"
    if parts:
        line += f" ({', '.join(parts)})"
    if alt.memory_delta_bytes:
        line += f"; {format_bytes(alt.memory_delta_bytes, signed=True)} of parameters per rank"
    if note:
        line += f"; {note}"
    return line


def _part_names(plan: Plan) -> dict[str, str]:
    """Each quantized weight part's exported FQN and placeholder name -> its name in reports,
    ``q_proj.weight (scale)`` (:func:`autotp.adapters.torchao.part_label`)."""
    names = {}
    for node in plan.nodes:
        label = part_label(node.target) if node.op == "placeholder" and node.target else None
        if label is not None:
            names[node.target] = names[node.name] = label
    return names


def _readable(text: str, part_names: Mapping[str, str]) -> str:
    """``text`` with every quantized weight part it names (exported FQN or placeholder) named as the weight."""
    return re.sub(r"[\w.]+", lambda word: part_names.get(word.group(0), word.group(0)), text)


# --------------------------------------------------------------------------- explain

def find_node(plan: Plan, name: str) -> NodeDecision:
    """The node called ``name``, or the placeholder of the parameter/buffer with FQN ``name``."""
    for node in plan.nodes:
        if node.name == name or (node.target and node.target == name):
            return node
    for node in plan.nodes:  # a quantized weight by its own name: its data part, whose placement its parts follow
        if node.target and weight_of(node.target) == (name, 0):
            return node
    close = [n.target or n.name for n in plan.nodes
             if name.split(".")[-1] in (n.target or n.name)][:8]
    hint = f"; similar: {', '.join(close)}" if close else ""
    raise KeyError(f"no node or parameter named {name!r} in this plan{hint}")


def _node_label(node: NodeDecision) -> str:
    what = (part_label(node.target) if node.target else None) or node.target or node.name
    op = "parameter" if node.op == "placeholder" and node.target else node.op
    where = f" in {node.module}" if node.module else ""
    shape = f" {list(node.shape)}" if node.shape else ""
    return f"{what} ({op}{where}){shape}"


def _explain_node(plan: Plan, node: NodeDecision, part_names: Mapping[str, str], indent: str = "") -> list[str]:
    strategy = node.strategy()
    lines = [f"{indent}{_node_label(node)}: chose {strategy_text(strategy)}"
             + (f", compute {format_seconds(node.compute_s)}" if node.compute_s else "")]
    if node.fallback:
        lines.append(f"{indent}  no sharding rule for {node.op}: it runs replicated")
    incoming = [c for c in plan.collectives if node.name in c.consumers]
    outgoing = [c for c in plan.collectives if c.producer == node.name]
    for c in incoming:
        lines.append(f"{indent}  before it: {_collective_text(c)} of its input {c.producer}")
    for c in outgoing:
        lines.append(f"{indent}  after it: {_collective_text(c)} for {', '.join(c.consumers[:4])}"
                     + (" ..." if len(c.consumers) > 4 else ""))
    if not node.alternatives:
        if plan.version < 2:
            lines.append(f"{indent}  (alternatives are not recorded in format-v1 plans; plan again to see them)")
        else:
            lines.append(f"{indent}  no other candidate strategy")
    for alt in node.alternatives:
        lines.append(f"{indent}  - {describe_alternative(alt, part_names)}")
    return lines


def _collective_text(c: CollectiveDecision) -> str:
    kind = "+".join(c.steps) or "none"
    return f"{kind} {c.src}->{c.dst} of {format_bytes(c.nbytes)} ({format_seconds(c.time_s)})"


def explain(plan: Plan, name: str) -> str:
    """Why ``name`` (a node name or a parameter FQN) is placed as it is: its alternatives and their cost.

    ``name`` may also be the module of a mixture-of-experts block (``"model.layers.0.mlp.experts"``): then the
    form it took (experts placed or split), the experts each rank holds and why
    (:func:`autotp.planning.experts.explain_experts`).

    For a parameter, the nodes that read it are explained too: a weight's own alternatives cost
    nothing but memory while its readers stay as they are; the readers' alternatives show what
    splitting it differently would do to compute and communication.
    """
    blocks = explain_experts(plan.nodes, plan.world_size, name, plan.expert_form_times, plan.expert_load_imbalance)
    if blocks is not None and not any(n.name == name or n.target == name for n in plan.nodes):
        return "\n".join(blocks)
    node = find_node(plan, name)
    part_names = _part_names(plan)
    lines = _explain_node(plan, node, part_names)
    if node.op == "placeholder":
        readers = [n for n in plan.nodes if node.name in n.input_nodes]
        for reader in readers[:4]:
            lines.append("")
            lines.append(f"read by {reader.name}:")
            lines.extend(_explain_node(plan, reader, part_names, "  "))
        if len(readers) > 4:
            lines.append(f"... and {len(readers) - 4} more readers")
    return "\n".join(lines)


# --------------------------------------------------------------------------- diff

@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What differs between two plans of the same graph (``other`` relative to ``plan``): ``autotp.diff(plan, other)``."""

    parameters: tuple[tuple[str, str, str], ...]  # (FQN, placement in plan, placement in other)
    nodes: tuple[tuple[str, str, str], ...]  # (node name, strategy in plan, strategy in other)
    collectives_added: tuple[str, ...]  # collectives and local reshards (slice, zero) only ``other`` has
    collectives_removed: tuple[str, ...]
    compute_delta_s: float
    comm_delta_s: float
    memory_delta_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def time_delta_s(self) -> float:
        return self.compute_delta_s + self.comm_delta_s

    def __bool__(self) -> bool:
        return bool(self.parameters or self.nodes or self.collectives_added or self.collectives_removed)

    def __str__(self) -> str:
        return self.format()

    def format(self, max_rows: int = 30) -> str:
        lines = list(self.notes)
        lines.append(
            f"predicted time {format_seconds(self.time_delta_s, signed=True)} (compute "
            f"{format_seconds(self.compute_delta_s, signed=True)}, communication "
            f"{format_seconds(self.comm_delta_s, signed=True)}); parameters per rank "
            f"{format_bytes(self.memory_delta_bytes, signed=True)}"
        )
        if not self:
            lines.append("same placements and collectives")
            return "\n".join(lines)
        if self.parameters:
            lines.append(f"{len(self.parameters)} parameter placement(s) changed:")
            lines.extend(f"  {fqn}: {a} => {b}" for fqn, a, b in self.parameters[:max_rows])
            if len(self.parameters) > max_rows:
                lines.append(f"  ... {len(self.parameters) - max_rows} more")
        others = self.nodes
        if others:
            lines.append(f"{len(others)} node strateg{'y' if len(others) == 1 else 'ies'} changed:")
            lines.extend(f"  {name}: {a}  =>  {b}" for name, a, b in others[:max_rows])
            if len(others) > max_rows:
                lines.append(f"  ... {len(others) - max_rows} more")
        for title, rows in (("reshardings added", self.collectives_added), ("reshardings removed", self.collectives_removed)):
            if rows:
                lines.append(f"{title} ({len(rows)}):")
                lines.extend(f"  {r}" for r in rows[:max_rows])
                if len(rows) > max_rows:
                    lines.append(f"  ... {len(rows) - max_rows} more")
        return "\n".join(lines)


def _collective_key(c: CollectiveDecision) -> str:
    return f"{'+'.join(c.steps)} {c.producer} {c.src}->{c.dst} ({format_bytes(c.nbytes)})"


def diff(plan: Plan, other: Plan) -> PlanDiff:
    """What changes going from ``plan`` to ``other`` (placements, strategies, collectives, cost)."""
    notes = []
    if plan.fingerprint != other.fingerprint:
        notes.append(f"note: the plans are for different graphs ({plan.fingerprint} vs {other.fingerprint})")
    if plan.world_size != other.world_size or plan.hardware != other.hardware:
        notes.append(f"note: world_size/hardware differ: {plan.world_size}/{plan.hardware} vs "
                     f"{other.world_size}/{other.hardware}")
    params = tuple((fqn, plan.parameters.get(fqn, "-"), other.parameters.get(fqn, "-"))
                   for fqn in dict.fromkeys([*plan.parameters, *other.parameters])
                   if plan.parameters.get(fqn) != other.parameters.get(fqn))
    theirs = {n.name: n for n in other.nodes}
    nodes = []
    for node in plan.nodes:
        if node.op == "placeholder" and node.target in plan.parameters:
            continue  # listed by FQN above
        match = theirs.get(node.name)
        if match is not None and (match.inputs, match.output) != (node.inputs, node.output):
            nodes.append((node.name, strategy_text(node.strategy()), strategy_text(match.strategy())))
    ours_c = {_collective_key(c) for c in plan.collectives}
    theirs_c = {_collective_key(c) for c in other.collectives}
    order = [_collective_key(c) for c in (*plan.collectives, *other.collectives)]
    return PlanDiff(
        parameters=params,
        nodes=tuple(nodes),
        collectives_added=tuple(k for k in dict.fromkeys(order) if k in theirs_c and k not in ours_c),
        collectives_removed=tuple(k for k in dict.fromkeys(order) if k in ours_c and k not in theirs_c),
        compute_delta_s=other.predicted_compute_s - plan.predicted_compute_s,
        comm_delta_s=other.predicted_comm_s - plan.predicted_comm_s,
        memory_delta_bytes=int(other.parameter_bytes_per_rank - plan.parameter_bytes_per_rank),
        notes=tuple(notes),
    )

