"""State updates in place: the last step of the rewrite for graphs that update a buffer (a KV cache, a counter).

The captured graph is functional: ``new_cache = index_copy(cache, 2, positions, keys)`` (or
``index_put(cache, [None, None, positions], keys)``), and the attention reads ``new_cache``. The planner
placed ``cache`` and its update alike (the edge between them is ``must_match``), so on every rank the
update's first argument is the rank's own block of the cache, the placeholder itself. This pass turns
each such update into its in-place form (``index_copy_``, ``index_put_``): the rank's cache tensor is
written where it lies, the attention reads it, and no copy of the whole cache is made per call. Any
other new value reaches its buffer through the ``copy(buffer, new)`` that capture put last in the graph,
made ``copy_`` here.

Input: a rank-local ``GraphModule`` from :func:`autotp.passes.rewrite.rewrite_for_rank` and
:attr:`autotp.capture.tracing.CapturedGraph.state`. Output: the same module, updated and recompiled.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autotp.base.errors import PlanError

aten = torch.ops.aten

__all__ = ["IN_PLACE_UPDATES", "WRITES_IN_PLACE", "update_state_in_place"]

WRITES_IN_PLACE = "autotp_writes_in_place"
"""``node.meta`` key that capture sets (True) on each state update: the planner prices the update as
the rows it writes, not a copy of the whole buffer, because :func:`update_state_in_place` makes it so."""

IN_PLACE_UPDATES = {aten.index_copy.default: aten.index_copy_.default, aten.index_put.default: aten.index_put_.default}
"""Updates that overwrite some slices of their first argument and keep the rest -> their in-place form: a
buffer's new value made by one of them straight from the buffer is written where the buffer lies."""

_IN_PLACE = {**IN_PLACE_UPDATES, aten.copy.default: aten.copy_.default}
"""Every state update's in-place form: the above, and the copy capture adds for any other new value."""


def update_state_in_place(gm: fx.GraphModule, state: dict[str, str],
                          fqns: dict[str, str] | None = None) -> fx.GraphModule:
    """Make every state update of ``gm`` (placeholder name -> update node name) write into its placeholder.

    ``fqns`` (placeholder name -> the buffer's FQN) names the buffer in the error raised when an update does
    not write straight into this rank's block of its buffer (a placement edited by hand, a reshard between
    them): applied anyway, the rank would keep a new value the buffer never sees."""
    if not state:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    for placeholder, update_name in state.items():
        update = nodes.get(update_name)
        buffer = nodes.get(placeholder)
        if update is None or buffer is None or update.target not in _IN_PLACE or update.args[0] is not buffer:
            shown = update.format_node() if update is not None else f"(no node {update_name!r})"
            name = (fqns or {}).get(placeholder, placeholder)
            raise PlanError(
                f"the update of state buffer {name!r} does not write into its own block on this rank: {shown}. "
                "The plan must place a state buffer and its update alike; plan again instead of editing "
                "the buffer's placement by hand."
            )
        update.target = _IN_PLACE[update.target]
    gm.recompile()
    return gm
