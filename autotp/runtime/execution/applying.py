"""Applying a plan on one rank: plan or check, then the rank-local graph and this rank's shards.

The stages below the front doors (:mod:`autotp.api`), shared by the tensor-parallel compile
(:mod:`autotp.driver`), generation (:mod:`autotp.runtime.generation.compile_for_generation`) and the mesh runtime::

    plan_or_check     CapturedGraph (+ a given Plan) -> Plan (planned on the first rank, or checked)
    rank_local_graph  Plan -> this rank's GraphModule (local shapes, functional collectives)
    apply_plan        + this rank's parameter shards, buffers and cache blocks, and their layout
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autotp.base.strategy import Strategy
from autotp.capture.tracing import CapturedGraph
from autotp.passes.rewrite import generate_code, rewrite_for_rank
from autotp.passes.state import update_state_in_place
from autotp.passes.uneven import Partitions, build_partitions
from autotp.planning.checks import check_plan_applies
from autotp.planning.constraints import check_plan_constraints
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan
from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S
from autotp.runtime.agreement.group import PlannedAhead, plan_on_first_rank
from autotp.runtime.checkpoints.loading import agree_on_success, read_local_values
from autotp.runtime.collectives.hosts import Host
from autotp.runtime.collectives.inference_collectives import inference_all_reduces
from autotp.runtime.collectives.watched_collectives import watched_collectives
from autotp.runtime.execution.shards import ShardCache, parameter_layout, shard_tensor

__all__ = ["apply_plan", "plan_or_check", "rank_local_graph"]


def plan_or_check(captured: CapturedGraph, plan: Plan | None, options: PlanOptions, *,
                  group: dist.ProcessGroup | None, rank: int,
                  agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, plan_cache: Any = None,
                  ahead: PlannedAhead | None = None) -> Plan:
    """Plan ``captured`` (on the first rank, broadcast; through ``plan_cache`` when given; ``ahead``: the first
    rank's plan made already), or check that the given ``plan`` applies to it."""
    if plan is None:
        return plan_on_first_rank(captured, options, group=group, rank=rank, agreement_timeout_s=agreement_timeout_s,
                                  plan_cache=plan_cache, ahead=ahead)
    check_plan_applies(plan, captured, options.world_size)
    check_plan_constraints(plan, options.constraints)
    return plan


def apply_plan(captured: CapturedGraph, plan: Plan, *, group: dist.ProcessGroup | None, rank: int, host: Host,
               files: Any = None, model: torch.nn.Module | None = None, device: torch.device | None = None,
               timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, training: bool = False,
               created: frozenset[str] = frozenset(), decisions: dict[str, Strategy] | None = None,
               weights: dict[str, torch.Tensor] | None = None, shards: ShardCache | None = None,
               ) -> tuple[torch.fx.GraphModule, dict[str, torch.Tensor], dict]:
    """This rank's graph (state updates in place), its local parameter shards, buffers and cache blocks,
    and the parameter layout (global offsets of every rank's block, for ``save``).

    With ``files`` (an opened checkpoint) the shards are read from it, agreed by all ranks within
    ``timeout_s`` (``created``: the state buffers made zero there, not read: a KV cache); otherwise they are
    sliced from the captured model's weights. ``training``: the graph differentiates correctly (see
    :func:`autotp.passes.rewrite.rewrite_for_rank`). ``host``: where this rank runs (which ranks of ``group``
    may share memory: :mod:`autotp.runtime.collectives.hosts`).

    The ``torch.compile`` backend applies a plan made for another lowering of the same ops: ``decisions`` are
    the plan's strategies by this graph's node names, ``weights`` the full parameters by input slot name (Dynamo
    passes them as arguments), and ``shards`` keeps each split once across its graphs."""
    local_gm, parts = rank_local_graph(captured, plan, group=group, rank=rank, host=host, timeout_s=timeout_s,
                                       training=training, decisions=decisions)
    if files is None:
        local_values = _local_values(captured, plan, parts, rank, weights or {}, shards)
    else:
        local_values = agree_on_success(group, lambda: read_local_values(captured, plan, parts, rank, files, model,
                                                                          device, created), timeout_s=timeout_s)
    return local_gm, local_values, parameter_layout(captured, plan, parts)


def rank_local_graph(captured: CapturedGraph, plan: Plan, *, group: dist.ProcessGroup | None, rank: int, host: Host,
                     timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, training: bool = False,
                     decisions: dict[str, Strategy] | None = None) -> tuple[torch.fx.GraphModule, Partitions]:
    """This rank's graph of :func:`apply_plan` (state updates in place) and the partitions its shards follow,
    without the shards: for a graph that takes another graph's tensors (generation's prefill graphs).
    ``decisions``: the plan's strategies by node name, where they are not ``plan.decisions()``."""
    if decisions is None:
        decisions = plan.decisions()
    parts = build_partitions(captured.graph_module, decisions, plan.world_size)
    group_name = (group or dist.group.WORLD).group_name
    local_gm = update_state_in_place(
        rewrite_for_rank(captured.graph_module, decisions, parts, rank, group_name, routes=plan.reshard_routes(),
                         training=training),
        captured.state, captured.state_fqns())
    if not training:  # gloo all-reduces through shared memory on one host, else small ones in one round
        local_gm = inference_all_reduces(local_gm, group, plan.world_size, host=host, timeout_s=timeout_s)
        # gloo's other collectives wait in steps that notice a failed peer (autotp.runtime.agreement.peer_failure)
        local_gm = watched_collectives(local_gm, group, timeout_s=timeout_s)
    return generate_code(local_gm), parts


def _local_values(captured: CapturedGraph, plan: Plan, parts: Any, rank: int, weights: dict[str, torch.Tensor],
                  shards: ShardCache | None) -> dict[str, torch.Tensor]:
    """Slice every parameter (from ``weights`` by slot name, else the captured program's) to this rank's block,
    through ``shards`` when given; buffers and constants are taken whole."""
    exported = captured.exported
    state = exported.state_dict
    unread = {n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder" and not n.users}
    values: dict[str, torch.Tensor] = {}
    for slot in captured.inputs:
        if slot.kind == "parameter":
            full = weights[slot.name] if slot.name in weights else state[str(slot.target)]
            if slot.name in unread:  # the graph never reads it (the second name of a tied weight): hold nothing
                values[slot.name] = full.new_empty(0)
                continue
            placement = plan.parameters[str(slot.target)]
            if shards is not None:
                values[slot.name] = shards.get(full, placement, parts, slot.name, rank, str(slot.target))
            else:
                values[slot.name] = shard_tensor(full, placement, parts, slot.name, rank)
        elif slot.kind == "buffer" and slot.name in captured.state:
            # a KV cache: this rank's block, a copy of its own (the graph writes into it)
            full = state[str(slot.target)] if str(slot.target) in state else exported.constants[str(slot.target)]
            values[slot.name] = shard_tensor(full, plan.parameters[str(slot.target)], parts, slot.name, rank).clone()
        elif slot.kind == "buffer":
            values[slot.name] = state[str(slot.target)] if str(slot.target) in state else exported.constants[str(slot.target)]
        elif slot.kind == "constant":
            values[slot.name] = exported.constants[str(slot.target)]
    return values

