"""The process group a tensor-parallel model runs on: checking it, and agreeing on one plan.

Both front doors that apply a plan (``autotp.compile`` and the ``torch.compile`` backend) bind
to a group with :func:`bind_group` and plan with :func:`plan_on_first_rank`, so they check the
same things with the same messages and every rank applies the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from autotp.base.errors import PlanError
from autotp.capture.tracing import CapturedGraph
from autotp.planning.options import PlanOptions, check_world_size
from autotp.planning.plan import Plan
from autotp.planning.plan_cache import cached_plan, plan_key, store_plan
from autotp.planning.planner import plan_graph
from autotp.runtime.agreement.exchanges import DEFAULT_AGREEMENT_TIMEOUT_S, exchanges_with_others, share_from_first

__all__ = ["PlannedAhead", "bind_group", "plan_ahead", "plan_on_first_rank"]


def bind_group(group: dist.ProcessGroup | None, world_size: int | None, *, caller: str) -> tuple[int, int]:
    """``(world_size, rank)`` of this process in ``group`` (``None``: the whole world).

    ``world_size=None`` takes the group's size; a given one must be an int equal to it.
    ``caller`` names the entry point in the error raised when no process group is initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialised process group: call torch.distributed.init_process_group() first "
            "(e.g. under torchrun), or use autotp.plan(...) to plan without one"
        )
    group_size = dist.get_world_size(group)
    world_size = group_size if world_size is None else check_world_size(world_size)
    if world_size != group_size:
        raise ValueError(
            f"world_size={world_size} but the process group has {group_size} ranks; pass world_size={group_size} "
            f"(or omit it), or start {world_size} processes (e.g. torchrun --nproc-per-node {world_size})"
        )
    return world_size, dist.get_rank(group)


@dataclasses.dataclass
class PlannedAhead:
    """Rank 0's plan made before the ranks agree on their graphs (:func:`plan_ahead`): the plan and its
    plan-cache write, or the failure to plan, handed to :func:`plan_on_first_rank`."""

    plan: Plan | None
    store: Callable[[], None] | None
    failure: Exception | None


def plan_ahead(captured: CapturedGraph, options: PlanOptions, *, group: dist.ProcessGroup | None, rank: int,
               plan_cache: Any = None) -> PlannedAhead | None:
    """On the group's first rank, where :func:`plan_on_first_rank` will send the plan: plan now, while the
    other ranks are still rebuilding the traced program rank 0 sent them, instead of after the agreement
    on the graphs (the plan is used and sent only once that agreement holds; a failure to plan is kept and
    reaches every rank as before). None elsewhere (nothing to overlap)."""
    if rank != 0 or options.world_size == 1 or not exchanges_with_others(group):
        return None
    try:
        plan, store = _plan(captured, options, plan_cache)
    except Exception as exc:  # noqa: BLE001 - sent to the other ranks by plan_on_first_rank, then raised
        return PlannedAhead(None, None, exc)
    return PlannedAhead(plan, store, None)


def plan_on_first_rank(captured: CapturedGraph, options: PlanOptions, *, group: dist.ProcessGroup | None,
                       rank: int, agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S,
                       plan_cache: Any = None, ahead: PlannedAhead | None = None) -> Plan:
    """Plan on the group's first rank and send the plan to the others: every rank applies the same
    plan, and the others spend no time solving. They wait at most ``options.time_limit_s +
    agreement_timeout_s`` (:func:`~autotp.runtime.agreement.exchanges.share_from_first`), then name rank 0.
    (A fake process group, used for tests, cannot carry objects, so there every rank plans;
    planning is deterministic.) ``options.progress`` is honoured on the first rank only.
    ``plan_cache`` (a :class:`autotp.capture.trace_cache.TraceCache`): the first rank reuses the plan made
    before for the same graph and options, or stores the one it makes (only it reads the cache,
    so the ranks cannot disagree on whether to wait for a plan). ``ahead``: the first rank's plan made
    already (:func:`plan_ahead`), sent instead of planning here."""
    if rank != 0 and options.progress:
        options = dataclasses.replace(options, progress=False)
    if options.world_size == 1 or dist.get_backend(group) == "fake":
        plan, store = _plan(captured, options, plan_cache)
        if store is not None:
            store()
        return plan
    made: Plan | None = None
    store = None
    failure: Exception | None = None
    if rank == 0 and ahead is not None:
        made, store, failure = ahead.plan, ahead.store, ahead.failure
    elif rank == 0:
        try:
            made, store = _plan(captured, options, plan_cache)
        except Exception as exc:  # noqa: BLE001 - the other ranks must not wait for a plan that never comes
            failure = exc
    sent = share_from_first(made if failure is None else f"{type(failure).__name__}: {failure}", group=group,
                            timeout_s=options.time_limit_s + agreement_timeout_s, what="the plan from rank 0")
    if failure is not None:
        raise failure
    if store is not None:  # after sending: the other ranks go on while rank 0 writes the plan cache
        store()
    if isinstance(sent, str):
        raise PlanError(f"planning failed on rank 0: {sent}")
    if not isinstance(sent, Plan):
        raise PlanError(f"rank 0 sent {type(sent).__name__} instead of a Plan")
    return sent


def _plan(captured: CapturedGraph, options: PlanOptions,
          plan_cache: Any) -> tuple[Plan, Callable[[], None] | None]:
    """:func:`plan_graph`, through ``plan_cache`` when there is one; and the write of a new plan to the
    cache (None: nothing to write), left to the caller so that it can send the plan first."""
    if plan_cache is None:
        return plan_graph(captured, options), None
    key = plan_key(captured, options)
    if key is None:  # options the cache cannot name (a user's strategy filter)
        return plan_graph(captured, options), None
    plan = cached_plan(plan_cache, key, captured, options.world_size)
    if plan is not None:
        return plan, None
    plan = plan_graph(captured, options)
    return plan, functools.partial(store_plan, plan_cache, key, plan)
