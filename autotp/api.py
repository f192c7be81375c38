"""The front door: ``autotp.plan`` (decide) and ``autotp.compile`` (decide and apply).

Pipeline (each step a pure function of its inputs; see ARCHITECTURE.md)::

    capture      nn.Module -> CapturedGraph (ATen FX graph, FakeTensor shapes)
    strategies   -> StrategyGraph (candidate placements of every node)
    cost         -> CostedGraph (predicted seconds and bytes per strategy)
    solve        -> Solution (MILP, HiGHS)
    plan         -> Plan (data: inspect, save, edit, reload)
    rewrite      -> rank-local GraphModule (sharded weights, functional collectives)
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autotp.base.errors import PlanError, UnsupportedOpError
from autotp.base.placements import Placement, placement_to_str, split_of
from autotp.base.shapes import concrete_shape, numel
from autotp.capture import CapturedGraph, capture
from autotp.cost_model import Hardware, get_hardware
from autotp.inspect.explain import node_alternatives
from autotp.passes.costing import CostedGraph, cost_strategy_graph, reshard_plan, tensor_nbytes
from autotp.passes.rewrite import rewrite_for_rank
from autotp.passes.rules import tensor_inputs
from autotp.passes.solver import Solution, solve
from autotp.passes.strategies import build_strategy_graph
from autotp.passes.tying import tie_identical_blocks
from autotp.passes.uneven import build_partitions
from autotp.planning.checks import check_plan_applies
from autotp.planning.constraints import Constraints, apply_constraints, check_plan_constraints
from autotp.planning.plan import CollectiveDecision, NodeDecision, Plan, graph_fingerprint, module_path
from autotp.runtime.module import TensorParallelModule, shard_tensor

__all__ = ["compile", "plan"]

DEFAULT_HARDWARE = "h100-sxm"


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r} ({type(world_size).__name__}); e.g. world_size=4")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}; pass the number of ranks to split over, e.g. world_size=4")
    return world_size


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[autotp] {message}", file=sys.stderr, flush=True)


def _to_model_device(model: torch.nn.Module, value: Any) -> Any:
    """Move example tensors to the meta device when the model lives there (planning only)."""
    params = list(model.parameters())
    if params and params[0].device.type == "meta":
        return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)
    return value


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


def _auto_budget(costed: CostedGraph) -> float:
    """Every matrix split along *some* dim (the cost model picks which), 1-D tensors may stay whole.

    Per matrix the allowance is its largest shard over the dims it could be split on, so
    rounding of uneven splits never forces one dim over another; a matrix that no split lets
    its readers use as is (e.g. read by an op without a sharding rule) is allowed whole. The
    budget depends on shapes, the world size and which ops read each parameter, not on the
    strategies offered (constraints and reference plans get the same budget).
    """
    world_size = costed.graph.world_size
    splittable = _splittable_parameters(costed)
    total = 0.0
    for name in costed.memory_bytes:
        if not costed.graph.nodes[name].users:
            continue  # never read (the second name of a tied weight): not held, so no allowance
        val = costed.graph.nodes[name].meta["val"]
        full = numel(val) * val.element_size()
        sizes = list(concrete_shape(val))
        splits = [full // size * math.ceil(size / world_size) for size in sizes if size > 1]
        whole = val.dim() <= 1 or not splits or name not in splittable
        total += full if whole else max(splits)
    return total


def _resolve_budget(memory_budget: float | int | str | None, costed: CostedGraph) -> float | None:
    if memory_budget is None:
        return None
    if memory_budget == "auto":
        return _auto_budget(costed)
    if isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool) and memory_budget > 0:
        return float(memory_budget)
    raise ValueError(
        f"memory_budget must be 'auto', None (no limit) or a positive number of bytes per rank, got {memory_budget!r}"
    )


def _build_plan(captured: CapturedGraph, costed: CostedGraph, solution: Solution, hardware: Hardware,
                budget: float | None, plan_time_s: float) -> Plan:
    graph = costed.graph
    chosen = {name: graph.strategies[name][index] for name, index in solution.choice.items()}
    fallback = set(graph.fallback)
    alternatives = node_alternatives(costed, solution.choice, memory_budget_bytes=budget)
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
            compute_s=costed.compute_s[name][solution.choice[name]],
            module=module_path(node),
            fallback=name in fallback,
            input_nodes=tuple(p.name for p in tensor_inputs(node)),
            target=targets.get(name, ""),
            shape=concrete_shape(value) if value is not None else (),
            dtype=str(value.dtype).removeprefix("torch.") if value is not None else "",
            alternatives=alternatives.get(name, ()),
        ))
    consumers: dict[tuple[str, Placement], list[str]] = defaultdict(list)
    for name in graph.order:
        node = graph.nodes[name]
        for producer, needed in zip(tensor_inputs(node), chosen[name].inputs):
            if chosen[producer.name].output != needed and isinstance(producer.meta.get("val"), torch.Tensor):
                consumers[producer.name, needed].append(name)
    collectives = []
    for (producer, needed), users in consumers.items():
        src = chosen[producer].output
        collectives.append(CollectiveDecision(
            producer=producer,
            src=placement_to_str(src),
            dst=placement_to_str(needed),
            steps=tuple(reshard_plan(src, needed)),
            nbytes=tensor_nbytes(graph.nodes[producer].meta["val"]),
            time_s=costed.reshard_s(producer, src, needed),
            consumers=tuple(users),
            module=module_path(graph.nodes[producer]),
        ))
    parameters = {graph.parameters[name]: placement_to_str(chosen[name].output) for name in graph.order if name in graph.parameters}
    per_rank = sum(costed.memory_bytes[name][solution.choice[name]] for name in costed.memory_bytes)
    total = sum(per[0] for per in costed.memory_bytes.values())
    compute_s = sum(n.compute_s for n in nodes)
    comm_s = sum(c.time_s for c in collectives)
    return Plan(
        world_size=graph.world_size,
        hardware=hardware.name,
        nodes=tuple(nodes),
        parameters=parameters,
        collectives=tuple(collectives),
        parameter_bytes_total=total,
        parameter_bytes_per_rank=per_rank,
        memory_budget_bytes=budget,
        predicted_compute_s=compute_s,
        predicted_comm_s=comm_s,
        fallback_ops=tuple(sorted({str(graph.nodes[n].target) for n in graph.fallback})),
        fingerprint=graph_fingerprint(captured.graph_module),
        plan_time_s=plan_time_s,
        solver_status=solution.status,
        solver_gap=solution.mip_gap,
    )


def _plan_captured(captured: CapturedGraph, world_size: int, hardware: str | Hardware,
                   memory_budget: float | int | str | None, strict: bool, time_limit_s: float,
                   progress: bool, started: float, constraints: Constraints | None = None) -> Plan:
    hw = get_hardware(hardware)
    graph = build_strategy_graph(captured.graph_module, world_size, captured.parameter_fqns())
    graph = apply_constraints(graph, constraints)
    if graph.fallback:
        lines = []
        for name in graph.fallback:
            node = graph.nodes[name]
            where = (node.meta.get("stack_trace") or "").strip().splitlines()
            lines.append(f"{node.format_node()}\n      at {where[-2].strip() if len(where) >= 2 else '<unknown>'}")
        if strict:
            raise UnsupportedOpError(
                "strict=True and these ops have no sharding rule (they would run replicated):\n  "
                + "\n  ".join(lines) + "\nPass strict=False to run them replicated."
            )
    _log(progress, f"{len(graph.order)} nodes, {sum(len(s) for s in graph.strategies.values())} strategies; costing on {hw.name}")
    costed = cost_strategy_graph(graph, hw)
    budget = _resolve_budget(memory_budget, costed)
    _log(progress, "solving (MILP, HiGHS)")
    solution = solve(costed, memory_budget_bytes=budget, time_limit_s=time_limit_s, tie=tie_identical_blocks(graph))
    plan = _build_plan(captured, costed, solution, hw, budget, time.perf_counter() - started)
    if plan.fallback_ops:
        import warnings

        warnings.warn(
            f"autotp: {len(graph.fallback)} node(s) of ops without a sharding rule run replicated: "
            f"{', '.join(plan.fallback_ops)} (see plan.fallback_ops; strict=True makes this an error)",
            stacklevel=3,
        )
    _log(progress, f"plan ready in {plan.plan_time_s:.2f} s: {plan.collective_counts()}")
    return plan


def plan(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    hardware: str | Hardware = DEFAULT_HARDWARE,
    memory_budget: float | int | str | None = "auto",
    strict: bool = False,
    time_limit_s: float = 60.0,
    progress: bool = False,
    constraints: Constraints | None = None,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
) -> Plan:
    """Decide how to split ``model`` over ``world_size`` ranks, without running anything.

    Needs no process group and no real weights: a model built on the ``meta`` device is fine.

    ``memory_budget`` is the most parameter bytes one rank may hold:

    - ``"auto"`` (default): the weights are *distributed* — each rank holds about
      ``1/world_size`` of the parameter bytes: room for every matrix split along one of its
      dims, while 1-D tensors such as norms and biases may stay whole. Tensor parallelism is
      usually asked for because the weights do not fit one device, so the default keeps that
      promise; within it, the cost model chooses *how* to split so communication is least.
    - a number of bytes per rank: tighter or looser than the default.
    - ``None``: no limit; the cost model may keep layers whole where splitting does not pay.

    ``hardware`` names a profile of :data:`autotp.cost_model.KNOWN_HARDWARE`, or is a
    :class:`~autotp.cost_model.Hardware` or a path to a JSON profile.
    ``strict=True`` raises instead of running ops without a sharding rule replicated.
    ``constraints`` pins placements before solving: ``{fnmatch pattern over parameter FQNs and
    node names: placement}``, e.g. ``{"model.layers.*.mlp.down_proj.weight": Replicate()}``
    (see :mod:`autotp.planning.constraints`).

    ``dynamic`` (default True) traces the batch and sequence dims (dims 0 and 1 of every tensor
    input) as symbols, so the plan serves every size; only static dims are split. ``dynamic=False``
    pins every size to the example's; ``dynamic_shapes`` is passed to ``torch.export`` as is
    (see :mod:`autotp.capture`).
    """
    started = time.perf_counter()
    world_size = _check_world_size(world_size)
    _log(progress, f"tracing {type(model).__name__} with torch.export")
    captured = capture(model, _to_model_device(model, example_inputs), _to_model_device(model, example_kwargs),
                       dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    return _plan_captured(captured, world_size, hardware, memory_budget, strict, time_limit_s, progress, started,
                          constraints)


def _group_world_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "autotp.compile needs an initialised process group: call torch.distributed.init_process_group() "
            "first (e.g. under torchrun), or use autotp.plan(...) to plan without one"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def compile(  # noqa: A001 - mirrors torch.compile
    model: torch.nn.Module,
    world_size: int | None = None,
    *,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    hardware: str | Hardware = DEFAULT_HARDWARE,
    memory_budget: float | int | str | None = "auto",
    plan: Plan | None = None,
    strict: bool = False,
    group: dist.ProcessGroup | None = None,
    time_limit_s: float = 60.0,
    progress: bool = False,
    constraints: Constraints | None = None,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
) -> TensorParallelModule:
    """Make ``model`` tensor-parallel over the ranks of ``group`` (default: the whole world).

    Call it on every rank with the same model weights and example inputs. Returns this rank's
    :class:`TensorParallelModule`: called like ``model``, it returns the same outputs (within
    floating-point tolerance) on every rank. Each rank keeps only its shards of the split
    parameters, sliced once here. ``world_size`` defaults to the group's size; pass ``plan=``
    to apply a saved or hand-edited :class:`Plan` instead of planning. Other options as in
    :func:`autotp.plan`.

    Shapes: with ``dynamic=True`` (default) the returned module serves every batch size and
    sequence length from this one trace (no re-trace, no re-plan per call); a dim that stayed
    static raises a clear error when called with another size.
    """
    started = time.perf_counter()
    group_size, rank = _group_world_size(group)
    if world_size is None:
        world_size = group_size
    world_size = _check_world_size(world_size)
    if world_size != group_size:
        raise ValueError(
            f"world_size={world_size} but the process group has {group_size} ranks; pass world_size={group_size} "
            f"(or omit it), or start {world_size} processes (e.g. torchrun --nproc-per-node {world_size})"
        )
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(
            "autotp.compile needs real weights, but the model has parameters on the meta device; "
            "use autotp.plan(...) to plan a meta model, or load its weights first"
        )
    _log(progress and rank == 0, f"tracing {type(model).__name__} with torch.export")
    captured = capture(model, example_inputs, example_kwargs, dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    if plan is None:
        plan = _plan_once(captured, world_size, hardware, memory_budget, strict, time_limit_s,
                          progress and rank == 0, started, constraints, group, rank)
    else:
        check_plan_applies(plan, captured, world_size)
        check_plan_constraints(plan, constraints)
    decisions = plan.decisions()
    parts = build_partitions(captured.graph_module, decisions, world_size)
    group_name = (group or dist.group.WORLD).group_name
    local_gm = rewrite_for_rank(captured.graph_module, decisions, parts, rank, group_name)
    local_values = _local_values(captured, plan, parts, rank)
    return TensorParallelModule(captured, local_gm, plan, local_values, rank)


def _plan_once(captured: CapturedGraph, world_size: int, hardware: str | Hardware,
               memory_budget: float | int | str | None, strict: bool, time_limit_s: float, progress: bool,
               started: float, constraints: Constraints | None, group: dist.ProcessGroup | None, rank: int) -> Plan:
    """Plan on the group's first rank and broadcast the plan: every rank applies the same plan,
    and the others spend no time solving. (A fake process group, used for tests, cannot carry
    objects, so there every rank plans; planning is deterministic.)"""
    if world_size == 1 or dist.get_backend(group) == "fake":
        return _plan_captured(captured, world_size, hardware, memory_budget, strict, time_limit_s, progress, started,
                              constraints)
    box: list[object] = [None]
    if rank == 0:
        try:
            box[0] = _plan_captured(captured, world_size, hardware, memory_budget, strict, time_limit_s, progress,
                                    started, constraints)
        except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
            box[0] = exc
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    if isinstance(box[0], BaseException):
        if rank == 0:
            raise box[0]
        raise PlanError(f"planning failed on rank 0: {box[0]}") from None
    if not isinstance(box[0], Plan):
        raise PlanError(f"rank 0 sent {type(box[0]).__name__} instead of a Plan")
    return box[0]


def _local_values(captured: CapturedGraph, plan: Plan, parts: Any, rank: int) -> dict[str, torch.Tensor]:
    """Slice every parameter to this rank's block; buffers and constants are taken whole."""
    exported = captured.exported
    state = exported.state_dict
    unread = {n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder" and not n.users}
    values: dict[str, torch.Tensor] = {}
    for slot in captured.inputs:
        if slot.kind == "parameter" and slot.name in unread:
            # the graph never reads it (the second name of a tied weight): hold nothing
            values[slot.name] = state[str(slot.target)].new_empty(0)
        elif slot.kind == "parameter":
            values[slot.name] = shard_tensor(state[str(slot.target)], plan.parameters[str(slot.target)], parts, slot.name, rank)
        elif slot.kind == "buffer":
            values[slot.name] = state[str(slot.target)] if str(slot.target) in state else exported.constants[str(slot.target)]
        elif slot.kind == "constant":
            values[slot.name] = exported.constants[str(slot.target)]
    return values

