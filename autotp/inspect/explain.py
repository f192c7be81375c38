"""Why the plan is what it is: per-node alternatives, ``Plan.explain`` and ``Plan.diff``.

:func:`node_alternatives` runs when a plan is built (it needs the costed strategy graph, which
the plan does not keep): for every node it prices each other candidate strategy *with the
neighbours' choices held fixed* — the change in the node's own compute time plus the change in
resharding on its input edges (its producers now have to deliver other placements) and output
edges (its consumers now receive another placement). One collective serves every consumer that
needs the same placement of a tensor, exactly as in the solver's objective, so a delta is the
change in the plan's predicted time if only this node changed. The plan stores the result on
each :class:`~autotp.planning.plan.NodeDecision`; :func:`explain` and :func:`diff` only read the plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

import torch
import torch.utils._pytree as pytree

from autotp.base.placements import Placement, placement_to_str
from autotp.base.shapes import concrete_shape
from autotp.passes.costing import CostedGraph, is_local_reshard, reshard_plan
from autotp.passes.rules import Strategy
from autotp.passes.strategies import Edge
from autotp.planning.plan import Alternative, CollectiveDecision, NodeDecision, Plan

__all__ = ["PlanDiff", "diff", "explain", "find_node", "format_seconds", "node_alternatives", "strategy_text"]

MAX_ALTERNATIVES = 8
"""Alternatives kept per node (cheapest first); a GEMM can have a dozen candidates."""


def strategy_text(strategy: Strategy) -> str:
    """``(R, S(0)) -> S(2)``; a placeholder's strategy is just its placement, e.g. ``S(0)``."""
    out = placement_to_str(strategy.output)
    if not strategy.inputs:
        return out
    return f"({', '.join(placement_to_str(p) for p in strategy.inputs)}) -> {out}"


@functools.lru_cache(maxsize=1024)
def reshard_kind(src: str | Placement, dst: str | Placement) -> str:
    """Name of what turns ``src`` into ``dst``: ``all_reduce``, ``all_gather+slice``, ``slice``..."""
    from autotp.base.placements import placement_from_str

    s = placement_from_str(src) if isinstance(src, str) else src
    d = placement_from_str(dst) if isinstance(dst, str) else dst
    steps = reshard_plan(s, d)
    return "+".join(steps) if steps else "none"


def _value_key(value: object) -> tuple:
    """What a resharding's price depends on besides the placements: the tensors' shapes and dtypes."""
    return tuple((concrete_shape(v), v.dtype) for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------- alternatives

class _Pricer:
    """Resharding cost of one producer's output given what each of its readers needs."""

    def __init__(self, costed: CostedGraph, chosen: dict[str, Strategy]) -> None:
        self.costed = costed
        self.chosen = chosen
        self.readers: dict[str, list[Edge]] = defaultdict(list)
        self.edges_in: dict[str, list[Edge]] = defaultdict(list)
        for edge in costed.graph.edges:
            self.readers[edge.producer].append(edge)
            self.edges_in[edge.consumer].append(edge)
        self._cache: dict[tuple[tuple, Placement, Placement], float] = {}
        self._keys: dict[str, tuple] = {}
        self._base: dict[str, dict[str, float]] = {}

    def reshard_s(self, producer: str, src: Placement, dst: Placement) -> float:
        if producer not in self._keys:
            self._keys[producer] = _value_key(self.costed.graph.nodes[producer].meta.get("val"))
        key = (self._keys[producer], src, dst)  # the same tensor shape in every layer: priced once
        if key not in self._cache:
            self._cache[key] = self.costed.reshard_s(producer, src, dst)
        return self._cache[key]

    def base_cost(self, producer: str) -> dict[str, float]:
        """:meth:`producer_cost` of the plan as chosen (cached)."""
        if producer not in self._base:
            self._base[producer] = self.producer_cost(producer, {})[0]
        return self._base[producer]

    def producer_cost(self, producer: str, override: dict[str, Strategy]) -> tuple[dict[str, float], str]:
        """Seconds per resharding kind on ``producer``'s output edges, and why it is impossible ('' if not)."""
        def strategy_of(name: str) -> Strategy:
            return override.get(name, self.chosen[name])

        src = strategy_of(producer).output
        needed: dict[Placement, Edge] = {}
        for edge in self.readers[producer]:
            dst = strategy_of(edge.consumer).inputs[edge.slot]
            if dst == src:
                continue
            if edge.must_match:
                return {}, f"{producer} returns several tensors: nothing can reshard them between it and {edge.consumer}"
            if edge.local_only and not is_local_reshard(src, dst):
                return {}, (f"parameter {producer} would have to be gathered for {edge.consumer} "
                            f"({placement_to_str(src)} -> {placement_to_str(dst)}); parameters are only sliced locally")
            needed.setdefault(dst, edge)
        by_kind: dict[str, float] = defaultdict(float)
        for dst in needed:
            by_kind[reshard_kind(src, dst)] += self.reshard_s(producer, src, dst)
        return dict(by_kind), ""


def node_alternatives(costed: CostedGraph, choice: dict[str, int], *, memory_budget_bytes: float | None = None,
                      limit: int = MAX_ALTERNATIVES) -> dict[str, tuple[Alternative, ...]]:
    """Every node's other candidate strategies, priced with its neighbours held fixed (cheapest first).

    A weight moves with the one op that reads it: an op's alternative takes the weight to the
    placement the alternative reads it in (a memory change, no collective), and a weight's
    alternative lets its reader take its cheapest strategy that reads the weight that way.
    Without this, nearly every alternative of a GEMM would be impossible, as weights are
    never gathered.
    """
    graph = costed.graph
    chosen = {name: graph.strategies[name][index] for name, index in choice.items()}
    index_of = {name: {s: i for i, s in enumerate(graph.strategies[name])} for name in graph.order}
    pricer = _Pricer(costed, chosen)
    total_bytes = sum(per[choice[name]] for name, per in costed.memory_bytes.items())

    @functools.cache
    def own_weights(name: str) -> dict[int, str]:
        """Slot -> parameter read only by ``name``."""
        return {e.slot: e.producer for e in pricer.edges_in[name]
                if e.producer in graph.parameters and all(r.consumer == name for r in pricer.readers[e.producer])}

    def price(override: dict[str, Strategy]) -> tuple[float, dict[str, float], int, str]:
        affected = list(dict.fromkeys([*override, *(e.producer for n in override for e in pricer.edges_in[n])]))
        comm: dict[str, float] = defaultdict(float)
        for u in affected:
            before = pricer.base_cost(u)
            after, why = pricer.producer_cost(u, override)
            if why:
                return 0.0, {}, 0, why
            for kind in set(after) | set(before):
                comm[kind] += after.get(kind, 0.0) - before.get(kind, 0.0)
        compute = sum(costed.compute_s[n][index_of[n][s]] - costed.compute_s[n][choice[n]] for n, s in override.items())
        memory = sum(costed.memory_bytes[n][index_of[n][s]] - costed.memory_bytes[n][choice[n]]
                     for n, s in override.items() if n in costed.memory_bytes)
        return compute, {k: v for k, v in comm.items() if abs(v) > 1e-15}, int(memory), ""

    def with_weights(name: str, strategy: Strategy) -> tuple[dict[str, Strategy], list[str]]:
        override = {name: strategy}
        moved = []
        for slot, weight in own_weights(name).items():
            want = next((s for s in graph.strategies[weight] if s.output == strategy.inputs[slot]), None)
            if want is not None and want != chosen[weight]:
                override[weight] = want
                moved.append(f"{graph.parameters[weight]} {placement_to_str(chosen[weight].output)} -> "
                             f"{placement_to_str(want.output)}")
        return override, moved

    def candidates(name: str, strategy: Strategy) -> list[tuple[dict[str, Strategy], str]]:
        """Ways to take ``strategy`` at ``name``: (override, note) pairs."""
        readers = {e.consumer for e in pricer.readers[name]}
        if name in graph.parameters and len(readers) == 1:
            reader = next(iter(readers))
            slots = [e.slot for e in pricer.readers[name]]
            found = []
            for option in graph.strategies[reader]:
                if all(option.inputs[i] == strategy.output for i in slots):
                    override, _ = with_weights(reader, option)
                    override[name] = strategy
                    note = "" if option == chosen[reader] else f"with {reader} as {strategy_text(option)}"
                    found.append((override, note))
            return found or [({name: strategy}, "")]
        override, moved = with_weights(name, strategy)
        return [(override, f"weight follows: {'; '.join(moved)}" if moved else "")]

    result: dict[str, tuple[Alternative, ...]] = {}
    for name in graph.order:
        strategies = graph.strategies[name]
        if len(strategies) < 2:
            continue
        alternatives = []
        for index, strategy in enumerate(strategies):
            if index == choice[name]:
                continue
            best: Alternative | None = None
            for override, note in candidates(name, strategy):
                compute, comm, memory, blocked = price(override)
                comm_items = tuple(sorted(comm.items()))
                if blocked:
                    option = Alternative(strategy_text(strategy), None, note=blocked)
                else:
                    if memory > 0 and memory_budget_bytes is not None and total_bytes + memory > memory_budget_bytes:
                        note = f"{note}; " if note else ""
                        note += "exceeds the memory budget"
                    option = Alternative(strategy_text(strategy), compute + sum(v for _, v in comm_items), compute,
                                         comm_items, memory, note)
                if best is None or _rank(option) < _rank(best):
                    best = option
            if best is not None:
                alternatives.append(best)
        alternatives.sort(key=_rank)
        result[name] = tuple(alternatives[:limit])
    return result


def _rank(alt: Alternative) -> tuple[bool, float]:
    return alt.delta_s is None, alt.delta_s if alt.delta_s is not None else 0.0


# --------------------------------------------------------------------------- text helpers

def format_seconds(seconds: float, *, signed: bool = False) -> str:
    """``1.234 ms`` / ``12.3 us`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    value = abs(seconds)
    if value >= 1.0:
        return f"{sign}{value:.3f} s"
    if value >= 1e-3:
        return f"{sign}{value * 1e3:.3f} ms"
    return f"{sign}{value * 1e6:.1f} us"


def format_bytes(nbytes: float, *, signed: bool = False) -> str:
    """``1.50 MiB`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if nbytes >= 0 else "-") if signed else ("-" if nbytes < 0 else "")
    value = abs(nbytes)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"


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


def describe_alternative(alt: Alternative) -> str:
    """One line: ``replicating this would cost +1.800 ms (all_gather +1.700 ms, compute +0.100 ms)``."""
    if alt.delta_s is None:
        return f"{_verb(alt.strategy)}: not possible while its neighbours keep their choices: {alt.note}"
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
    if alt.note:
        line += f"; {alt.note}"
    return line


# --------------------------------------------------------------------------- explain

def find_node(plan: Plan, name: str) -> NodeDecision:
    """The node called ``name``, or the placeholder of the parameter/buffer with FQN ``name``."""
    for node in plan.nodes:
        if node.name == name or (node.target and node.target == name):
            return node
    close = [n.target or n.name for n in plan.nodes
             if name.split(".")[-1] in (n.target or n.name)][:8]
    hint = f"; similar: {', '.join(close)}" if close else ""
    raise KeyError(f"no node or parameter named {name!r} in this plan{hint}")


def _node_label(node: NodeDecision) -> str:
    what = node.target or node.name
    op = "parameter" if node.op == "placeholder" and node.target else node.op
    where = f" in {node.module}" if node.module else ""
    shape = f" {list(node.shape)}" if node.shape else ""
    return f"{what} ({op}{where}){shape}"


def _explain_node(plan: Plan, node: NodeDecision, indent: str = "") -> list[str]:
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
        lines.append(f"{indent}  - {describe_alternative(alt)}")
    return lines


def _collective_text(c: CollectiveDecision) -> str:
    kind = "+".join(c.steps) or "none"
    return f"{kind} {c.src}->{c.dst} of {format_bytes(c.nbytes)} ({format_seconds(c.time_s)})"


def explain(plan: Plan, name: str) -> str:
    """Why ``name`` (a node name or a parameter FQN) is placed as it is: its alternatives and their cost.

    For a parameter, the nodes that read it are explained too: a weight's own alternatives cost
    nothing but memory while its readers stay as they are; the readers' alternatives show what
    splitting it differently would do to compute and communication.
    """
    node = find_node(plan, name)
    lines = _explain_node(plan, node)
    if node.op == "placeholder":
        readers = [n for n in plan.nodes if node.name in n.input_nodes]
        for reader in readers[:4]:
            lines.append("")
            lines.append(f"read by {reader.name}:")
            lines.extend(_explain_node(plan, reader, "  "))
        if len(readers) > 4:
            lines.append(f"... and {len(readers) - 4} more readers")
    return "\n".join(lines)


# --------------------------------------------------------------------------- diff

@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What differs between two plans of the same graph (``other`` relative to ``base``)."""

    parameters: tuple[tuple[str, str, str], ...]  # (FQN, base placement, other placement)
    nodes: tuple[tuple[str, str, str], ...]  # (node name, base strategy, other strategy)
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


def diff(base: Plan, other: Plan) -> PlanDiff:
    """What changes going from ``base`` to ``other`` (placements, strategies, collectives, cost)."""
    notes = []
    if base.fingerprint != other.fingerprint:
        notes.append(f"note: the plans are for different graphs ({base.fingerprint} vs {other.fingerprint})")
    if base.world_size != other.world_size or base.hardware != other.hardware:
        notes.append(f"note: world_size/hardware differ: {base.world_size}/{base.hardware} vs "
                     f"{other.world_size}/{other.hardware}")
    params = tuple((fqn, base.parameters.get(fqn, "-"), other.parameters.get(fqn, "-"))
                   for fqn in dict.fromkeys([*base.parameters, *other.parameters])
                   if base.parameters.get(fqn) != other.parameters.get(fqn))
    theirs = {n.name: n for n in other.nodes}
    nodes = []
    for node in base.nodes:
        if node.op == "placeholder" and node.target in base.parameters:
            continue  # listed by FQN above
        match = theirs.get(node.name)
        if match is not None and (match.inputs, match.output) != (node.inputs, node.output):
            nodes.append((node.name, strategy_text(node.strategy()), strategy_text(match.strategy())))
    ours_c = {_collective_key(c) for c in base.collectives}
    theirs_c = {_collective_key(c) for c in other.collectives}
    order = [_collective_key(c) for c in (*base.collectives, *other.collectives)]
    return PlanDiff(
        parameters=params,
        nodes=tuple(nodes),
        collectives_added=tuple(k for k in dict.fromkeys(order) if k in theirs_c and k not in ours_c),
        collectives_removed=tuple(k for k in dict.fromkeys(order) if k in ours_c and k not in theirs_c),
        compute_delta_s=other.predicted_compute_s - base.predicted_compute_s,
        comm_delta_s=other.predicted_comm_s - base.predicted_comm_s,
        memory_delta_bytes=int(other.parameter_bytes_per_rank - base.parameter_bytes_per_rank),
        notes=tuple(notes),
    )

