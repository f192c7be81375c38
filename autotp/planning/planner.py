"""Plan a captured graph: strategies -> (filters, constraints) -> cost -> budget -> solve -> :class:`Plan`.

:func:`plan_graph` is the one planner every entry point calls (``autotp.plan``,
``autotp.compile``, the ``torch.compile`` backend, ``autotp plan`` and the Megatron reference).
It needs no process group and no real weights. State after each step:

1. strategies: the captured graph, unchanged, with candidate placements per node
   (:func:`autotp.passes.strategies.build_strategy_graph`);
2. filters: ``options.strategy_filter`` then ``options.constraints`` narrow the candidates;
3. cost: predicted seconds per strategy and resharding, bytes per parameter placement;
4. budget: ``options.memory_budget`` resolved to bytes per rank (:func:`auto_memory_budget`);
5. solve: one strategy per node (exact MILP, identical layers tied);
6. plan: the :class:`~autotp.planning.plan.Plan` data (placements, collectives, costs).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Hashable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autotp.base.errors import PlanError, UnsupportedOpError
from autotp.base.module_paths import block_name
from autotp.base.placements import Replicate, Shard, placement_to_str, split_of
from autotp.base.progress import log_progress
from autotp.base.shapes import concrete_shape
from autotp.base.strategy import Strategy
from autotp.capture.tracing import CapturedGraph
from autotp.cost_model import Hardware
from autotp.passes.backward import Training, checkpointed_blocks_price, trainable_bytes_factor
from autotp.passes.costing import CostedGraph, cost_strategy_graph, forward_compute_s, tensor_nbytes
from autotp.passes.pricing import Resharding, compute_s, price_choice, saved_activation_bytes
from autotp.passes.quantized import quantized_links
from autotp.passes.rules import tensor_inputs
from autotp.passes.solver import Solution, min_parameter_bytes, solve
from autotp.passes.strategies import StrategyGraph, build_strategy_graph
from autotp.passes.tying import tie_identical_blocks
from autotp.passes.uneven import largest_shard_nbytes
from autotp.planning.alternatives import node_alternatives
from autotp.planning.constraints import apply_constraints
from autotp.planning.decisions import CollectiveDecision, NodeDecision
from autotp.planning.expert_load import measured_blocks, with_expert_load
from autotp.planning.experts import find_expert_blocks, narrow_expert_forms, planned_experts
from autotp.planning.kv_heads import kv_projection_parameters
from autotp.planning.options import PlanOptions
from autotp.planning.outputs import free_outputs, with_local_outputs
from autotp.planning.plan import Plan, graph_fingerprint, module_path

__all__ = ["auto_memory_budget", "check_fits_device", "plan_graph", "resolve_memory_budget"]


def _splittable_parameters(costed: CostedGraph) -> set[str]:
    """Parameters of which some split is accepted, as is, by every op that reads them."""
    graph = costed.graph
    accepted: dict[str, set] = {}
    for edge in graph.edges:
        if edge.producer in graph.parameters:
            slot = {s.inputs[edge.slot] for s in graph.strategies[edge.consumer] if split_of(s.inputs[edge.slot])}
            accepted[edge.producer] = slot if edge.producer not in accepted else accepted[edge.producer] & slot
    unread = set(graph.parameters) - set(accepted)  # e.g. the alias of a tied weight: any split will do
    return unread | {name for name, placements in accepted.items() if placements}


def auto_memory_budget(costed: CostedGraph, state: frozenset[str] = frozenset(), world_size: int | None = None) -> float:
    """The ``memory_budget="auto"`` bytes per rank: every matrix split along *some* dim, 1-D tensors may stay whole.

    Per matrix the allowance is its largest shard over the dims it could be split on, so
    rounding of uneven splits never forces one dim over another; a matrix that no split lets
    its readers use as is (e.g. read by an op without a sharding rule) is allowed whole, and so
    is ``state`` (KV caches: whether to split their heads is the cost model's choice), and so are
    key/value projections with fewer kv heads than ranks (:mod:`autotp.planning.kv_heads`: the
    cost model may replicate the kv heads, as Megatron and vLLM do, instead of an all-reduce of
    k and v in every layer). The budget depends on shapes, the world size and which ops read each parameter, not on the
    strategies offered (constraints and reference plans get the same budget). ``world_size``
    (default: the graph's) gives the same figure at another world size, with the same readers.

    A training plan's allowance counts each trainable parameter's gradient and optimizer state
    with it; the activations kept for the backward are not held to it (the planner solves with
    ``count_activations=False`` under this budget: it is about distributing the weights).
    """
    world_size = world_size or costed.graph.world_size
    splittable = _splittable_parameters(costed)
    kv_heads = kv_projection_parameters(costed.graph.graph_module, world_size, set(costed.graph.parameters))
    total = 0.0
    for name in costed.memory_bytes:
        if not costed.graph.nodes[name].users:
            continue  # never read (the second name of a tied weight): not held, so no allowance
        val = costed.graph.nodes[name].meta["val"]
        full = largest_shard_nbytes(val.shape, val.element_size(), Replicate(), world_size)
        splits = [largest_shard_nbytes(val.shape, val.element_size(), Shard(d), world_size)
                  for d, size in enumerate(concrete_shape(val)) if size > 1]
        whole = val.dim() <= 1 or not splits or name not in splittable or name in state or name in kv_heads
        training = costed.training
        factor = (trainable_bytes_factor(val, training.optimizer_states)
                  if training is not None and name in training.requires_grad else 1.0)
        total += factor * (full if whole else max(splits))
    return total


def resolve_memory_budget(memory_budget: float | int | str | None, costed: CostedGraph,
                          state: frozenset[str] = frozenset()) -> float | None:
    """Bytes per rank for a validated ``memory_budget`` option (``"auto"``, ``None`` or bytes)."""
    if memory_budget is None:
        return None
    if memory_budget == "auto":
        budget = auto_memory_budget(costed, state)
        check_fits_device(costed, budget, state)
        return budget
    return float(memory_budget)


def check_fits_device(costed: CostedGraph, budget: float, state: frozenset[str] = frozenset()) -> None:
    """Refuse, before any weight is read, a world size at which the model cannot fit the device's memory.

    Per rank: the ``"auto"`` parameter bytes (``state``, the KV caches, counted whole as there), plus
    other buffers, constants and inputs (whole on every rank), plus activations, bounded above by
    the two largest tensors the graph computes (an op's input and output, unsplit) — against
    ``hardware.memory_gib``. The error names the smallest world size at which the same estimate
    fits (the same rule applied at that world size).
    """
    graph = costed.graph
    hw_bytes = costed.hardware.memory_gib * 2**30
    nodes = list(graph.graph_module.graph.nodes)
    state_bytes = sum(tensor_nbytes(n.meta["val"]) for n in nodes if n.op == "placeholder" and n.users
                      and n.name not in graph.parameters and isinstance(n.meta.get("val"), torch.Tensor))
    sizes = sorted((tensor_nbytes(n.meta["val"]) for n in nodes
                    if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)), reverse=True)
    activation_bytes = sum(sizes[:2])

    def needed(world_size: int) -> float:
        weights = budget if world_size == graph.world_size else auto_memory_budget(costed, state, world_size=world_size)
        return weights + state_bytes + activation_bytes

    if needed(graph.world_size) <= hw_bytes:
        return
    fits = next((w for w in range(graph.world_size + 1, 4097) if needed(w) <= hw_bytes), None)
    def size(n: float) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

    what = (f"at world_size={graph.world_size} each rank needs about {size(needed(graph.world_size))} "
            f"(parameters {size(budget)}, buffers and inputs {size(state_bytes)}, activations up to "
            f"{size(activation_bytes)}) but a {costed.hardware.name} device has {size(hw_bytes)}")
    where = (f"the smallest world size that fits is {fits}: pass world_size={fits}" if fits is not None
             else "no world size up to 4096 fits (activations or buffers alone are too large)")
    raise PlanError(f"the model does not fit in device memory: {what}; {where}, or hardware= a profile with "
                    "more memory, or memory_budget=<bytes per rank> to plan anyway")


def _narrowed(before: StrategyGraph, after: StrategyGraph) -> StrategyGraph:
    """``after`` if it keeps the nodes of ``before`` and only narrows their candidates; else a PlanError."""
    problems = []
    for name in before.order:
        kept = after.strategies.get(name, [])
        if not kept:
            problems.append(f"{name}: no candidate strategy left")
        elif not set(kept) <= set(before.strategies[name]):
            problems.append(f"{name}: strategies that were not candidates were added")
    if after.order != before.order or problems:
        detail = "; ".join(problems[:5]) or "the nodes changed"
        raise PlanError(f"strategy_filter must only narrow each node's candidate strategies: {detail}")
    return after


def _check_fallback(graph: StrategyGraph, strict: bool) -> None:
    """With ``strict``, refuse ops that have no sharding rule, naming each and where the user's code calls it."""
    if not graph.fallback or not strict:
        return
    lines = []
    for name in graph.fallback:
        node = graph.nodes[name]
        where = (node.meta.get("stack_trace") or "").strip().splitlines()
        lines.append(f"{node.format_node()}\n      at {where[-2].strip() if len(where) >= 2 else '<unknown>'}")
    raise UnsupportedOpError(
        "strict=True and these ops have no sharding rule (they would run replicated):\n  "
        + "\n  ".join(lines) + "\nPass strict=False to run them replicated."
    )


def _blame_constraints(error: PlanError, options: PlanOptions, budget: float | None, costed: CostedGraph) -> PlanError:
    """A budget error that names the user's constraints when they, not the budget alone, break it.

    The solver's floor assumes every parameter may be split; constraints that keep weights whole
    (``Replicate()``) raise it, and the default budget was never meant to hold whole matrices.
    """
    pinned = [pattern for pattern, text in (options.constraints or {}).items() if str(text) == "R"]
    floor = min_parameter_bytes(costed)
    if not pinned or budget is None or floor <= budget:
        return error
    which = ", ".join(f"{pattern}=Replicate()" for pattern in pinned)
    if options.memory_budget == "auto":
        said = (f"the default memory budget (memory_budget='auto': about 1/world_size of the weights per rank, "
                f"{budget / 2**20:.2f} MiB)")
    else:
        said = f"memory_budget={options.memory_budget!r} ({budget / 2**20:.2f} MiB per rank)"
    return PlanError(
        f"your constraints keep weights whole on every rank ({which}), and then {said} cannot hold the "
        f"parameters: with these constraints a rank needs at least {floor} bytes ({floor / 2**20:.2f} MiB). "
        f"Pass options=autotp.PlanOptions(memory_budget=None) (no limit) or memory_budget>={floor} there, or drop "
        "the Replicate() constraint."
    )


def plan_graph(captured: CapturedGraph, options: PlanOptions, *, alternatives: bool = True) -> Plan:
    """Decide how to split ``captured`` over ``options.world_size`` ranks; returns the :class:`Plan`.

    Deterministic: the same graph and options give the same plan on every process. Raises
    :class:`~autotp.PlanError` when no plan meets the memory budget or the constraints, and
    :class:`~autotp.UnsupportedOpError` for ops without a rule when ``options.strict``; otherwise
    such ops run replicated, with a warning (see ``plan.fallback_ops``).
    ``plan.plan_time_s`` is the wall-clock time of this call. ``alternatives=False`` leaves
    ``NodeDecision.alternatives`` empty (a plan made only to compare with: a third of a small plan's time).
    """
    started = time.perf_counter()
    hw = options.hardware_profile
    graph = _strategy_graph(captured, options)
    if options.strategy_filter is not None:
        graph = _narrowed(graph, options.strategy_filter(graph))
    graph = narrow_expert_forms(graph, options.experts)
    graph = with_expert_load(graph, options.expert_load)
    graph = apply_constraints(graph, options.constraints)
    if options.outputs == "local":
        graph = free_outputs(graph)
    _check_fallback(graph, options.strict)
    log_progress(options.progress, f"{len(graph.order)} nodes, {sum(len(s) for s in graph.strategies.values())} strategies; "
                           f"costing on {hw.name}")
    training = Training.of(graph, options.optimizer_states, _frozen(captured)) if options.training else None
    costed = cost_strategy_graph(graph, hw, training)
    budget = resolve_memory_budget(options.memory_budget, costed, frozenset(captured.state))
    log_progress(options.progress, "solving (MILP, HiGHS)")
    try:
        solution = solve(costed, memory_budget_bytes=budget, time_limit_s=options.time_limit_s,
                         tie=tie_identical_blocks(graph), count_activations=options.memory_budget != "auto",
                         links=tuple(quantized_links(graph)))
    except PlanError as exc:
        raise _blame_constraints(exc, options, budget, costed) from None
    plan = _build_plan(captured, costed, solution, hw, budget, time.perf_counter() - started, alternatives=alternatives)
    if graph.expert_shares:
        plan = dataclasses.replace(plan, expert_load_imbalance=measured_blocks(graph))
    if options.outputs == "local":
        plan = with_local_outputs(plan)
    if options.activation_checkpointing == "blocks":
        plan = _with_checkpointed_blocks(plan, costed)
    if options.training:
        plan = _compare_with_inference(plan, captured, options, started)
    elif options.experts == "auto" and find_expert_blocks(graph):
        plan = _compare_expert_forms(plan, captured, options, started)
    if plan.fallback_ops:
        warnings.warn(
            f"autotp: {len(graph.fallback)} node(s) of ops without a sharding rule run replicated: "
            f"{', '.join(plan.fallback_ops)} (see plan.fallback_ops; strict=True makes this an error)",
            stacklevel=3,
        )
    log_progress(options.progress, f"plan ready in {plan.plan_time_s:.2f} s: {plan.collective_counts()}")
    return plan


_STRATEGY_GRAPHS: weakref.WeakKeyDictionary[fx.GraphModule, dict[Hashable, StrategyGraph]] = weakref.WeakKeyDictionary()
"""Traced graph module -> the strategy graphs built of it, by what they depend on (see :func:`_strategy_graph`)."""


def _strategy_graph(captured: CapturedGraph, options: PlanOptions) -> StrategyGraph:
    """``build_strategy_graph`` of ``captured`` for ``options``, built once per traced graph and what the build reads
    of the options (world size, split dropout, placed experts): a generation compile plans each phase's graph
    several times (alone, pinned to the other phase, whole), and an ``experts="auto"`` plan once per expert form,
    each from the same strategies (half or more of a small plan's time). Filters, constraints and expert forms
    narrow a copy; each call gets its own containers, so none can change what a later plan starts from."""
    gm = captured.graph_module
    key = (options.world_size, options.dropout == "split", not options.training,
           tuple((node.name, node.target) for node in gm.graph.nodes))  # a graph changed in place builds anew
    built = _STRATEGY_GRAPHS.setdefault(gm, {})
    graph = built.get(key)
    if graph is None:
        graph = built[key] = build_strategy_graph(
            gm, options.world_size, {**captured.parameter_fqns(), **captured.state_fqns()}, frozenset(captured.state),
            split_random=options.dropout == "split", place_experts=not options.training)
    return graph.with_own_containers()


def _with_checkpointed_blocks(plan: Plan, costed: CostedGraph) -> Plan:
    """``plan``'s activation bytes and predicted times with every repeated block checkpointed (kept: the
    blocks' inputs and one block's saved tensors; recomputed: each block's forward, reshardings included)."""
    graph = costed.graph
    if costed.training is None:
        return plan
    chosen = plan.decisions()
    modules = {name: module_path(graph.nodes[name]) for name in graph.order}

    def block_of(name: str) -> str | None:
        return block_name(modules[name]) if modules.get(name) else None

    price = checkpointed_blocks_price(
        graph, costed.training.saved, lambda name: chosen[name], costed.activation_bytes,
        lambda name: forward_compute_s(graph.nodes[name], chosen[name], graph.world_size, costed.hardware,
                                       graph.expert_shares.get(name)),
        [(c.producer, c.consumers, c.time_s) for c in plan.collectives], block_of)
    return dataclasses.replace(plan, activation_bytes_per_rank=int(price.activation_bytes),
                               predicted_compute_s=plan.predicted_compute_s + price.recompute_compute_s,
                               predicted_comm_s=plan.predicted_comm_s + price.recompute_comm_s,
                               activation_checkpointing="blocks")


def _frozen(captured: CapturedGraph) -> frozenset[str]:
    """Parameter placeholders whose tensor has ``requires_grad=False`` in the model (they do not train)."""
    weights = captured.exported.state_dict
    return frozenset(name for name, fqn in captured.parameter_fqns().items()
                     if not getattr(weights.get(fqn), "requires_grad", True))


def _compare_with_inference(plan: Plan, captured: CapturedGraph, options: PlanOptions, started: float) -> Plan:
    """``plan`` (a training plan) with the parameters whose placement the inference plan of the
    same graph and options chooses differently (that plan is solved here, quietly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning is the training plan's to give
        inference = plan_graph(captured, dataclasses.replace(options, training=False, progress=False,
                                                                   activation_checkpointing=None), alternatives=False)
    differences = tuple((fqn, inference.parameters[fqn], placement) for fqn, placement in plan.parameters.items()
                        if inference.parameters.get(fqn, placement) != placement)
    return dataclasses.replace(plan, inference_differences=differences, inference_time_s=inference.predicted_time_s,
                               plan_time_s=time.perf_counter() - started)


def _compare_expert_forms(plan: Plan, captured: CapturedGraph, options: PlanOptions, started: float) -> Plan:
    """``plan`` with the predicted time of the same graph and options with every MoE block placed and with every
    block split, and with every block dispatched where it can be (``Plan.expert_form_times``; the form ``plan`` took
    everywhere is not solved again), which ``print(plan)`` and ``autotp.explain`` give as the reason for the form."""
    taken = {block.form for block in planned_experts(plan.nodes, plan.world_size)}
    times = []
    for form in ("placed", "split", "dispatched"):
        if form == "dispatched" and options.dynamic and options.dynamic_shapes is None:
            continue  # a dynamic token dim is never split: no block can take it
        if taken == {form}:
            times.append((form, plan.predicted_time_s))
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback warning is this plan's to give
                other = plan_graph(captured, dataclasses.replace(options, experts=form, progress=False),
                                   alternatives=False)
        except PlanError:
            continue  # that form does not fit (the memory budget, the constraints)
        times.append((form, other.predicted_time_s))
    return dataclasses.replace(plan, expert_form_times=tuple(times), plan_time_s=time.perf_counter() - started)


def _weight_bytes(costed: CostedGraph, name: str, strategy: Strategy) -> int:
    """Bytes of parameter ``name``'s largest shard under ``strategy`` (0 when nothing reads it)."""
    node = costed.graph.nodes[name]
    val = node.meta["val"]
    return largest_shard_nbytes(val.shape, val.element_size(), strategy.output, costed.graph.world_size) if node.users else 0


def _build_plan(captured: CapturedGraph, costed: CostedGraph, solution: Solution, hardware: Hardware,
                budget: float | None, plan_time_s: float, *, alternatives: bool = True) -> Plan:
    graph = costed.graph
    chosen = {name: graph.strategies[name][index] for name, index in solution.choice.items()}
    fallback = set(graph.fallback)
    priced = node_alternatives(costed, solution.choice, memory_budget_bytes=budget) if alternatives else {}
    targets = {slot.name: str(slot.target) for slot in captured.inputs if slot.kind != "user"}
    nodes = []
    for name in graph.order:
        node = graph.nodes[name]
        strategy = chosen[name]
        value = next((v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)), None)
        nodes.append(NodeDecision(
            name=name,
            op=str(node.target) if node.op == "call_function" else node.op,
            inputs=tuple(placement_to_str(p) for p in strategy.inputs),
            output=placement_to_str(strategy.output),
            compute_s=compute_s(costed, name, solution.choice[name]),
            module=module_path(node),
            fallback=name in fallback,
            input_nodes=tuple(p.name for p in tensor_inputs(node)),
            target=targets.get(name, ""),
            shape=concrete_shape(value) if value is not None else (),
            dtype=str(value.dtype).removeprefix("torch.") if value is not None else "",
            alternatives=priced.get(name, ()),
        ))
    price = price_choice(costed, solution.choice)
    def decision(r: Resharding) -> CollectiveDecision:
        return CollectiveDecision(
            producer=r.producer,
            src=placement_to_str(r.src),
            dst=placement_to_str(r.dst),
            steps=tuple(step.kind for step in (r.route if r.backward else costed.reshard_route(r.producer, r.src, r.dst))),
            nbytes=tensor_nbytes(graph.nodes[r.producer].meta["val"]),
            time_s=r.time_s,
            consumers=r.consumers,
            module=module_path(graph.nodes[r.producer]),
        )

    # a resharding of no steps (an expert-placed sum read as a plain one) is nothing to insert or to report
    collectives = [c for c in map(decision, price.forward) if c.steps]
    parameters = {graph.parameters[name]: placement_to_str(chosen[name].output) for name in graph.order if name in graph.parameters}
    per_rank = sum(_weight_bytes(costed, name, chosen[name]) for name in costed.memory_bytes)
    total = sum(_weight_bytes(costed, name, Strategy((), Replicate())) for name in costed.memory_bytes)
    training = costed.training
    trainable = [name for name in costed.memory_bytes if training is not None and name in training.requires_grad]
    gradient_bytes = sum(_weight_bytes(costed, name, chosen[name]) for name in trainable)
    optimizer_bytes = sum(_weight_bytes(costed, name, chosen[name]) // graph.nodes[name].meta["val"].element_size()
                          * 4 * training.optimizer_states for name in trainable) if training is not None else 0
    return Plan(
        world_size=graph.world_size,
        hardware=hardware.name,
        runtime_mode=hardware.runtime_mode,
        nodes=tuple(nodes),
        parameters=parameters,
        collectives=tuple(collectives),
        parameter_bytes_total=total,
        parameter_bytes_per_rank=per_rank,
        memory_budget_bytes=budget,
        predicted_compute_s=price.predicted_compute_s,
        predicted_comm_s=price.comm_s,
        fallback_ops=tuple(sorted({str(graph.nodes[n].target) for n in graph.fallback})),
        fingerprint=graph_fingerprint(captured.graph_module),
        plan_time_s=plan_time_s,
        solver_status=solution.status,
        solver_gap=solution.mip_gap,
        training=training is not None,
        backward_collectives=tuple(decision(r) for r in price.backward),
        predicted_backward_comm_s=sum(r.time_s for r in price.backward),
        gradient_bytes_per_rank=gradient_bytes,
        optimizer_bytes_per_rank=optimizer_bytes,
        activation_bytes_per_rank=int(saved_activation_bytes(costed, lambda name: chosen[name])),
    )
