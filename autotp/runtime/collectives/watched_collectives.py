"""gloo collectives of an inference graph that stop waiting when another rank failed.

A functional collective's ``wait_tensor`` waits without bound (up to the group's own timeout, 30 minutes
by default), so a rank whose peer raised mid-call would sit there. :func:`watched_collectives` replaces each
functional collective of a gloo group and its wait (those the shared-memory collectives did not take:
reduce-scatters, all-to-alls, and everything on several hosts) by a :class:`WatchedCollective`: the same
collective issued with ``async_op=True`` and waited on by
:func:`~autotp.runtime.agreement.peer_failure.watched_wait`, which looks for a peer's failure note twice a second
while it waits (a completed collective returns at once, with no store round trip).

For ``torch.compile`` (the ``compiled`` runtime mode) each stand-in has a custom op
(``autotp::watched_all_reduce`` ...; :meth:`WatchedCollective.compiler_form`) that takes a small tensor it
mutates, so the compiler keeps every call, in graph order, as for the shared-memory ops.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.fx as fx

from autotp.base.errors import AutoTPError
from autotp.passes.small_collectives import StandInCollective
from autotp.runtime.agreement.peer_failure import FailureNotes, failure_notes, watched_wait

__all__ = ["WatchedCollective", "watched_collectives"]

c10d = torch.ops._c10d_functional

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

_KINDS = {  # functional collective -> (kind, its arguments after the tensor, as the op takes them)
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
}


def _issue(kind: str, x: torch.Tensor, args: tuple, group: dist.ProcessGroup) -> tuple[torch.Tensor, Any]:
    """Start collective ``kind`` of ``x`` (the functional collective's ``args`` after the tensor, its group name
    last) on ``group``; returns the output tensor and the work to wait on."""
    x = x.contiguous()
    if kind == "all_reduce":
        out = x.clone()
        return out, dist.all_reduce(out, op=_REDUCE_OPS[args[0]], group=group, async_op=True)
    if kind == "all_gather":
        out = x.new_empty((args[0] * x.shape[0], *x.shape[1:]))
        return out, dist.all_gather_into_tensor(out, x, group=group, async_op=True)
    if kind == "reduce_scatter":
        out = x.new_empty((x.shape[0] // args[1], *x.shape[1:]))
        return out, dist.reduce_scatter_tensor(out, x, op=_REDUCE_OPS[args[0]], group=group, async_op=True)
    output_sizes, input_sizes = list(args[0]), list(args[1])
    out = x.new_empty((sum(output_sizes), *x.shape[1:]))
    return out, dist.all_to_all_single(out, x, output_sizes, input_sizes, group=group, async_op=True)


class WatchedCollective(StandInCollective):
    """One functional collective and its wait, as a callable ``op(x)`` a graph node calls (module docstring)."""

    __module__ = "autotp.runtime.collectives.watched_collectives"
    kind: ClassVar[str] = ""

    def __init__(self, kind: str, args: tuple, group: dist.ProcessGroup, notes: FailureNotes | None,
                 order: torch.Tensor) -> None:
        self.kind = kind  # type: ignore[misc]  # per instance: one class serves every kind
        self.args, self.group, self.notes, self.order = args, group, notes, order
        self.__name__ = f"autotp_watched_{kind}"

    def __repr__(self) -> str:
        return f"WatchedCollective({self.kind}, {self.args})"

    def __deepcopy__(self, memo: dict) -> WatchedCollective:
        return self  # a copy of a graph still talks to the same group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, work = _issue(self.kind, x, self.args, self.group)
        watched_wait(work, self.notes)
        return out

    def compiler_form(self) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
        """``autotp::watched_<kind>`` on the group's order tensor, with the collective's arguments."""
        setattr(self.order, "_autotp_watched", (self.group, self.notes))  # noqa: B010 - read back by the op
        return getattr(torch.ops.autotp, f"watched_{self.kind}").default, self.order, self.args


def watched_collectives(gm: fx.GraphModule, group: dist.ProcessGroup | None, *, timeout_s: float) -> fx.GraphModule:
    """``gm`` with each functional collective of a gloo ``group`` and its single wait replaced by a
    :class:`WatchedCollective`; other backends and one-rank groups are left as they are. Changes ``gm`` in
    place and returns it."""
    notes = failure_notes(group, timeout_s=timeout_s)
    if notes is None or str(dist.get_backend(group)) != "gloo":
        return gm
    process_group = group or dist.group.WORLD
    order = torch.zeros(1)  # what the compiled ops mutate: it keeps them in graph order
    changed = False
    for node in list(gm.graph.nodes):
        kind = _KINDS.get(node.target) if node.op == "call_function" else None
        waits = list(node.users) if kind is not None else []
        if kind is None or len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
            continue
        args = tuple(node.args[1:])
        if args[-1] != process_group.group_name or any(isinstance(a, fx.Node) for a in _leaves(args)) \
                or (kind in ("all_reduce", "reduce_scatter") and args[0] not in _REDUCE_OPS):
            continue  # another group, sizes known only at run time, or a reduction gloo lacks: kept as it is
        stand_in = WatchedCollective(kind, args, process_group, notes, order)
        with gm.graph.inserting_before(node):
            watched = gm.graph.call_function(stand_in, (node.args[0],))
        watched.meta.update(waits[0].meta)
        waits[0].replace_all_uses_with(watched)
        gm.graph.erase_node(waits[0])
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _leaves(args: tuple) -> list[Any]:
    return [leaf for a in args for leaf in (a if isinstance(a, (list, tuple)) else [a])]


def _group_of(order: torch.Tensor) -> tuple[dist.ProcessGroup, FailureNotes | None]:
    found = getattr(order, "_autotp_watched", None)
    if found is None:
        raise AutoTPError(
            "the compiled graph handed a watched collective a copy of its order tensor, so it cannot tell which "
            "process group to use; run with autotp.RuntimeOptions(runtime_mode='eager') and report the torch "
            f"release ({torch.__version__})")
    return found


def _run(kind: str, x: torch.Tensor, order: torch.Tensor, *args: Any) -> torch.Tensor:
    group, notes = _group_of(order)
    out, work = _issue(kind, x, args, group)
    watched_wait(work, notes)
    return out


_LIBRARY = torch.library.Library("autotp", "FRAGMENT")  # held for the life of the process
_SCHEMAS = {
    "all_reduce": "str reduce_op, str group_name",
    "all_gather": "int group_size, str group_name",
    "reduce_scatter": "str reduce_op, int group_size, str group_name",
    "all_to_all": "int[] output_split_sizes, int[] input_split_sizes, str group_name",
}


def _fake(kind: str, x: torch.Tensor, order: torch.Tensor, *args: Any) -> torch.Tensor:
    if kind == "all_reduce":
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if kind == "all_gather":
        return x.new_empty((args[0] * x.shape[0], *x.shape[1:]))
    if kind == "reduce_scatter":
        return x.new_empty((x.shape[0] // args[1], *x.shape[1:]))
    return x.new_empty((sum(args[0]), *x.shape[1:]))


def _bound(function: Any, kind: str) -> Any:
    def op(x: torch.Tensor, order: torch.Tensor, *args: Any) -> torch.Tensor:
        return function(kind, x, order, *args)

    return op


for _kind, _schema in _SCHEMAS.items():
    _LIBRARY.define(f"watched_{_kind}(Tensor x, Tensor(a!) order, {_schema}) -> Tensor")
    _LIBRARY.impl(f"watched_{_kind}", _bound(_run, _kind), "CPU")
    torch.library.register_fake(f"autotp::watched_{_kind}", _bound(_fake, _kind), lib=_LIBRARY)
