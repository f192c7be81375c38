"""Mixture-of-experts blocks: found in the graph, forced to one form on request, and read back from a plan.

An MoE block is found from the graph alone, never from module or class names: a grouped GEMM
(``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) whose weight is a 3-D parameter ``(E, K, N)``
(through views and transposes) and whose row-group offsets come from a router's ``topk``. The grouped
GEMMs that share one ``topk`` are one block (the gate/up and the down projection of the routed experts); where the
offsets come from a router of another kind (Phi-MoE's sparse mixer picks its two experts with two ``max``), the
grouped GEMMs that share one offsets tensor are (a grouped GEMM over a 3-D parameter is experts either way); a
shared expert (DeepSeek-style) is an ordinary MLP beside it and is planned like one. Experts run as one batched
product over every token (Llama-4 text: ``bmm(x (E, T, K), w (E, K, N))`` on inputs scaled by the router's
scores) are a block too: a ``bmm`` over a 3-D parameter whose batch dim is its experts, routed by the ``topk``
nearest its input rows (:func:`autotp.passes.rules.experts.nearest_router`).

Each block takes one of three forms, and the solver picks between them like any other choice:

- **experts split**: every rank holds a slice of every expert (``w S(1)``/``S(2)``, Megatron-style inside the
  experts) and the block ends in an all-reduce;
- **experts placed**: every rank holds whole experts (``w S(0)``, E / world_size each, uneven where the world
  size does not divide E); each rank computes the tokens routed to its own experts (the activations are
  whole on every rank in a tensor-parallel plan, so no token moves first) and one all-reduce combines them
  (:mod:`autotp.passes.rules.experts`). No token moves while the activations are replicated. Batched experts
  placed are the ``bmm``'s batch split (``x S(0)``, ``w S(0)``): each rank runs every token through its own
  experts, and the sum over experts after them is the Partial the same all-reduce combines.
- **experts dispatched**: whole experts per rank as above, but the block's tokens are split across the ranks
  (``S(0)`` of its rows, as sequence parallelism leaves them; the token dim must be static, ``dynamic=False``):
  each rank routes its own tokens, sends each row to the rank of its expert with an all-to-all and gets the
  results back with another, weighted by the router; no all-reduce (the rows come back in token order, ``S(0)``).

``PlanOptions(experts="placed" | "dispatched" | "split")`` narrows every block's candidates to one form
(:func:`narrow_expert_forms`), as constraints do for any other placement; ``"auto"`` leaves the choice to
the solver. Training plans never place experts (the expert-placed ops have no backward): ``experts="placed"`` or
``"dispatched"`` with ``training=True`` is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch.fx as fx

from autotp.base.errors import PlanError
from autotp.base.placements import Shard, is_rank_local, placement_from_str
from autotp.base.strategy import Strategy
from autotp.base.units import format_seconds
from autotp.cost_model.routing import even_expert_counts
from autotp.passes.rules import tensor_inputs
from autotp.passes.rules.experts import (
    BATCHED_EXPERT_OPS,
    batched_expert_weight,
    expert_weight_input,
    expert_weight_source,
    is_dispatched,
    is_grouped_mm,
    nearest_router,
    router_of,
)
from autotp.passes.rules.registry import rule_for
from autotp.passes.strategies import StrategyGraph
from autotp.planning.decisions import NodeDecision

__all__ = ["EXPERT_FORMS", "ExpertBlock", "PlannedExperts", "check_experts_option", "expert_lines", "explain_experts",
           "find_expert_blocks", "narrow_expert_forms", "planned_experts", "strategy_form"]

EXPERT_FORMS = ("auto", "placed", "dispatched", "split")

def check_experts_option(value: object, training: bool) -> None:
    """Validate ``PlanOptions.experts`` (ValueError saying what to pass)."""
    if value not in EXPERT_FORMS:
        raise ValueError(f"experts must be one of {', '.join(map(repr, EXPERT_FORMS))}, got {value!r}; e.g. "
                         "experts='placed' to put whole experts on ranks")
    if value in ("placed", "dispatched") and training:
        raise ValueError(f"experts={value!r} plans inference only: the expert-placed grouped GEMMs have no backward. "
                         "Pass experts='auto' or experts='split' with training=True (experts are then split)")


@dataclasses.dataclass(frozen=True)
class ExpertBlock:
    """One MoE block of a graph: its router's ``topk`` node, its grouped GEMMs and their expert weights."""

    module: str  # the module path of its grouped GEMMs (e.g. model.layers.0.mlp.experts), for reports
    router: str  # the topk node whose indices route the tokens (else the grouped GEMMs' offsets node)
    gemms: tuple[str, ...]  # grouped GEMM nodes, graph order
    weights: tuple[str, ...]  # the parameter placeholders of their expert weights (E, K, N)
    experts: int  # E
    batched: bool = False  # a batched product over every token (bmm, the experts its batch dim), not grouped


def _weight_parameter(node: fx.Node, parameters: Iterable[str]) -> fx.Node | None:
    """The parameter placeholder that ``node`` (a grouped GEMM's weight input) is a view of, or None."""
    source = expert_weight_source(node)
    return source if source is not None and source.name in set(parameters) else None


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def find_expert_blocks(graph: StrategyGraph) -> list[ExpertBlock]:
    """Every MoE block of ``graph`` (module docstring), in graph order."""
    found: dict[str, list[tuple[fx.Node, fx.Node]]] = {}
    for name in graph.order:
        node = graph.nodes[name]
        if node.op != "call_function" or rule_for(node.target) is None:
            continue
        weight = expert_weight_input(node) if is_grouped_mm(node.target) else batched_expert_weight(node)
        param = _weight_parameter(weight, graph.parameters) if weight is not None else None
        router = router_of(node) if param is not None else None
        inputs = tensor_inputs(node)
        if router is None and param is not None and is_grouped_mm(node.target) and len(inputs) > 2:
            router = inputs[2]  # the offsets of a router of its own (Phi-MoE's sparse mixer: two max), not a topk
        if router is not None and param is not None:
            found.setdefault(router.name, []).append((node, param))
    blocks = []
    for router, members in found.items():
        gemms = tuple(node.name for node, _ in members)
        weights = tuple(dict.fromkeys(param.name for _, param in members))
        experts = int(members[0][1].meta["val"].shape[0])
        batched = members[0][0].target in BATCHED_EXPERT_OPS
        blocks.append(ExpertBlock(_module_path(members[0][0]), router, gemms, weights, experts, batched))
    return blocks


def _placed(strategy: Strategy) -> bool:
    """Whether an expert GEMM's strategy holds whole experts: its weight (input 1) split by experts, ``S(0)``."""
    return len(strategy.inputs) in (2, 3) and strategy.inputs[1] == Shard(0)


def strategy_form(strategy: Strategy) -> str:
    """The form a grouped GEMM's strategy gives its block: ``"dispatched"`` (rows of the ranks' own tokens,
    ``w S(0)``), ``"placed"`` (``w S(0)``, rows whole) or ``"split"`` (anything else)."""
    if is_dispatched(strategy):
        return "dispatched"
    return "placed" if _placed(strategy) else "split"


def _no_such_form(form: str, name: str, module: str, candidates: Sequence[Strategy], blockers: Sequence[str],
                  graph: StrategyGraph) -> PlanError:
    hint = ""
    if form == "dispatched" and not any(is_dispatched(s) for s in candidates):
        hint = (" The dispatched form needs the block's tokens split across the ranks, so their count must be "
                "static: pass PlanOptions(dynamic=False) (or experts='placed' for whole activations).")
    elif form == "dispatched":
        ops = ", ".join(f"{b} ({graph.nodes[b].target})" for b in blockers[:4]) or "none found"
        hint = (" Its tokens cannot stay on their ranks through the block: an op between the router and the combine "
                f"is not one autotp runs on a rank's own tokens (ops that read them and take none: {ops}). "
                "Use experts='placed'.")
    return PlanError(f"experts={form!r}: the grouped GEMM {name} in {module} has no such strategy "
                     f"(candidates: {', '.join(map(str, candidates))}).{hint}")


def _rank_local_viable(graph: StrategyGraph) -> tuple[dict[str, list[Strategy]], list[str]]:
    """The candidates of ``graph`` less those that make or read rank-local rows (``S(local)``, ``S(routed)``) no
    neighbour can take or give (no resharding step goes into or out of them), to a fixed point; and the nodes that
    read such rows from a candidate and take none (why a block cannot be dispatched)."""
    strategies = {name: list(found) for name, found in graph.strategies.items()}
    involved = [name for name in graph.order
                if any(is_rank_local(p) for s in strategies[name] for p in (s.output, *s.inputs))]
    if not involved:
        return strategies, []
    producer = {(edge.consumer, edge.slot): edge.producer for edge in graph.edges}
    readers: dict[str, list[tuple[str, int]]] = {}
    for edge in graph.edges:
        readers.setdefault(edge.producer, []).append((edge.consumer, edge.slot))
    blockers = sorted({consumer for name in involved for consumer, slot in readers.get(name, [])
                       if not any(is_rank_local(s.inputs[slot]) for s in strategies[consumer])})

    def viable(name: str, strategy: Strategy) -> bool:
        if not all(any(made.output == p for made in strategies[producer[name, slot]])
                   for slot, p in enumerate(strategy.inputs) if is_rank_local(p)):
            return False
        return not is_rank_local(strategy.output) or all(
            any(read.inputs[slot] == strategy.output for read in strategies[consumer])
            for consumer, slot in readers.get(name, []))

    changed = True
    while changed:
        changed = False
        for name in involved:
            kept = [s for s in strategies[name] if viable(name, s)]  # the all-replicate candidate always stays
            if len(kept) != len(strategies[name]):
                strategies[name], changed = kept, True
    return strategies, blockers


def narrow_expert_forms(graph: StrategyGraph, form: str) -> StrategyGraph:
    """``graph`` with every MoE block's candidates narrowed to ``form`` (``"placed"``, ``"dispatched"`` or
    ``"split"``; ``"auto"``: only rank-local candidates that cannot connect removed). A PlanError when a block
    cannot take the form asked for."""
    strategies, blockers = _rank_local_viable(graph)
    if form == "auto":
        return dataclasses.replace(graph, strategies=strategies)
    for block in find_expert_blocks(graph):
        for name in block.gemms:
            kept = [s for s in strategies[name] if strategy_form(s) == form]
            if not kept:
                raise _no_such_form(form, name, block.module, graph.strategies[name], blockers, graph)
            strategies[name] = kept
        for name in block.weights:
            keep = [s for s in strategies[name] if (s.output == Shard(0)) == (form != "split")]
            strategies[name] = keep or strategies[name]
    return dataclasses.replace(graph, strategies=strategies)


@dataclasses.dataclass(frozen=True)
class PlannedExperts:
    """The form one MoE block took in a plan, read from the plan's grouped GEMMs."""

    module: str
    form: str  # "placed", "dispatched", "split", "replicated" or "mixed" (its GEMMs in different forms)
    gemms: tuple[str, ...]
    weights: tuple[str, ...]  # the expert weights' FQNs (or placeholder names)
    experts: int
    per_rank: tuple[int, ...]  # experts each rank holds (placed), else ()
    batched: bool = False  # the experts are a batched product over every token (Llama-4 text), not grouped

    def __str__(self) -> str:
        if self.form == "placed":
            counts = sorted(set(self.per_rank))
            held = "/".join(map(str, counts[::-1]))
            return f"{self.module}: experts placed, {self.experts} experts, {held} whole experts per rank"
        if self.form == "dispatched":
            counts = sorted(set(self.per_rank))
            held = "/".join(map(str, counts[::-1]))
            return (f"{self.module}: experts dispatched (all-to-all), {self.experts} experts, {held} whole experts per "
                    "rank, tokens split across the ranks")
        if self.form == "split":
            return f"{self.module}: experts split, every rank a slice of each of {self.experts} experts"
        if self.form == "mixed":
            return (f"{self.module}: experts mixed, {self.experts} experts, its expert GEMMs in different forms (their "
                    "placements below)")
        return f"{self.module}: experts replicated, every rank all {self.experts} experts"


def _form_of(node: NodeDecision) -> str:
    weight = placement_from_str(node.inputs[1]) if len(node.inputs) in (2, 3) else None
    if weight == Shard(0):
        return "dispatched" if is_rank_local(placement_from_str(node.inputs[0])) else "placed"
    return "split" if any(p != "R" for p in node.inputs[:2]) or node.output != "R" else "replicated"


def _weight_record(node: NodeDecision, by_name: dict[str, NodeDecision]) -> NodeDecision | None:
    """The parameter placeholder an expert GEMM's weight (input 1) is read from, through views, or None."""
    producer = by_name.get(node.input_nodes[1]) if len(node.input_nodes) > 1 else None
    while producer is not None and producer.op != "placeholder" and producer.input_nodes:
        producer = by_name.get(producer.input_nodes[0])
    return producer if producer is not None and producer.op == "placeholder" else None


def _batched_expert_record(node: NodeDecision, by_name: dict[str, NodeDecision]) -> bool:
    """Whether ``node`` is a batched product over a 3-D parameter whose batch dim is its E >= 2 experts
    (:func:`autotp.passes.rules.experts.batched_expert_weight`, read from a plan's records)."""
    if node.op not in {str(op) for op in BATCHED_EXPERT_OPS} or len(node.inputs) != 2 or len(node.shape) != 3:
        return False
    weight = _weight_record(node, by_name)
    rows = by_name.get(node.input_nodes[0]) if node.input_nodes else None
    return (weight is not None and bool(weight.target) and len(weight.shape) == 3 and weight.shape[0] >= 2
            and rows is not None and rows.shape[:1] == weight.shape[:1])


def _routed_batched_record(node: NodeDecision, by_name: dict[str, NodeDecision]) -> bool:
    """A batched expert GEMM of a plan's records with a router (:func:`~autotp.passes.rules.experts.nearest_router`)."""
    if not _batched_expert_record(node, by_name):
        return False
    start = by_name.get(node.input_nodes[0])

    def inputs_of(record: NodeDecision) -> list[NodeDecision]:
        return [by_name[name] for name in record.input_nodes if name in by_name]

    return start is not None and nearest_router(start, inputs_of, lambda record: record.op,
                                                lambda record: _batched_expert_record(record, by_name)) is not None


def planned_experts(nodes: Iterable[NodeDecision], world_size: int) -> list[PlannedExperts]:
    """The form of every MoE block in a plan's ``nodes``: its expert GEMMs (grouped GEMMs, and batched ones with a
    router) that read a 3-D weight by dim 0 (``S(0)``: placed) or by another dim (split), grouped by module."""
    by_name = {node.name: node for node in nodes}
    blocks: dict[str, list[NodeDecision]] = {}
    for node in by_name.values():
        grouped = node.op.endswith(("grouped_mm.default", "grouped_mm_fallback.default"))
        if (grouped and len(node.inputs) == 3 and len(node.shape) == 2) or _routed_batched_record(node, by_name):
            blocks.setdefault(node.module, []).append(node)
    found = []
    for module, gemms in blocks.items():
        forms = {_form_of(g) for g in gemms}
        form = forms.pop() if len(forms) == 1 else "mixed"
        weights, experts = [], 0
        for gemm in gemms:
            producer = _weight_record(gemm, by_name)
            if producer is not None:
                weights.append(producer.target or producer.name)
                experts = max(experts, producer.shape[0] if producer.shape else 0)
        per_rank = tuple(even_expert_counts(experts, world_size)) if form in ("placed", "dispatched") else ()
        batched = all(len(g.inputs) == 2 for g in gemms)
        found.append(PlannedExperts(module, form, tuple(g.name for g in gemms), tuple(dict.fromkeys(weights)),
                                    experts, per_rank, batched))
    return found


def _why(form: str, form_times: Sequence[tuple[str, float]]) -> str:
    """Why a block took ``form``: the predicted plan time with every block in each form (``Plan.expert_form_times``)."""
    times = dict(form_times)
    if form == "mixed":  # the solver's own mix, priced below every one-form plan
        listed = ", ".join(f"experts {other} {format_seconds(time)}" for other, time in times.items())
        return "the solver's cheapest plan mixes the forms" + (f"; with every block in one form: {listed}" if listed
                                                                else "")
    if form not in times or len(times) < 2:
        return "forced (PlanOptions(experts=...)) or the only form possible" if form != "replicated" else ""
    others = ", ".join(f"experts {other} {format_seconds(time)}" for other, time in times.items() if other != form)
    return f"the plan with experts {form} is predicted {format_seconds(times[form])} per forward, with {others}"


def _measured(module: str, loads: Sequence[tuple[str, float]]) -> str:
    """How a block's load was priced, where a measured router load was given (``Plan.expert_load_imbalance``)."""
    imbalance = dict(loads).get(module)
    if imbalance is None:
        return ""
    return f"priced for the measured router load: busiest expert {imbalance:.2f}x the mean rows"


def expert_lines(nodes: Iterable[NodeDecision], world_size: int, form_times: Sequence[tuple[str, float]] = (),
                 max_rows: int = 40, loads: Sequence[tuple[str, float]] = ()) -> list[str]:
    """The plan text's lines on its MoE blocks (none when it has none): each block's form, why, and the measured
    router load it was priced for (``loads``: ``Plan.expert_load_imbalance``)."""
    blocks = planned_experts(nodes, world_size)
    if not blocks:
        return []
    lines = ["", "mixture-of-experts blocks:"]
    for block in blocks[:max_rows]:
        notes = "; ".join(note for note in (_why(block.form, form_times), _measured(block.module, loads)) if note)
        lines.append(f"  {block}" + (f" ({notes})" if notes else ""))
    if len(blocks) > max_rows:
        lines.append(f"  ... {len(blocks) - max_rows} more blocks")
    return lines


def explain_experts(nodes: Sequence[NodeDecision], world_size: int, module: str,
                    form_times: Sequence[tuple[str, float]] = (),
                    loads: Sequence[tuple[str, float]] = ()) -> list[str] | None:
    """``autotp.explain``'s account of the MoE block of ``module`` (its form, its experts per rank, the
    placements of its grouped GEMMs and weights, why); None when ``module`` names no MoE block."""
    found = [b for b in planned_experts(nodes, world_size) if b.module == module or b.module.startswith(module + ".")]
    if not found:
        return None
    by_name = {node.name: node for node in nodes}
    lines = []
    for block in found:
        lines.append(str(block))
        why = _why(block.form, form_times)
        if why:
            lines.append(f"  why: {why}")
        measured = _measured(block.module, loads)
        if measured:
            lines.append(f"  load: {measured}")
        if block.form == "placed" and block.batched:
            lines.append("  each rank runs every token through its own experts (a batched product over all tokens, "
                         "each token's input scaled by its router score, zero for experts it did not pick); the sum "
                         "over experts after them is a partial sum, which one all-reduce after the block combines")
        elif block.form == "placed":
            lines.append("  each rank computes the tokens routed to its own experts (the activations are whole on "
                         "every rank); one all-reduce after the block combines them, weighted by the router")
        if block.form == "dispatched":
            lines.append("  each rank routes its own tokens (split across the ranks), sends each row to the rank of "
                         "its expert with an all-to-all and gets the results back with another; the router's "
                         "weighting and the sum over the top-k run on the rank's own tokens, no all-reduce")
        for name in block.gemms:
            gemm = by_name[name]
            lines.append(f"  {name}: ({', '.join(gemm.inputs)}) -> {gemm.output}")
        lines.append(f"  expert weights: {', '.join(block.weights)}")
    return lines
