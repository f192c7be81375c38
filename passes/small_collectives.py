"""Faster all-reduces for inference graphs: in symmetric memory on CUDA, through shared memory on one
host, else one-shot on gloo.

:func:`autotp.runtime.collectives.inference_collectives.inference_all_reduces` is what :func:`autotp.runtime.execution.applying.apply_plan` runs
on every inference graph. Where the group's ranks share one host and their tensors are on CUDA devices, small
sum all-reduces run as PyTorch's one-shot kernel in symmetric memory (:mod:`autotp.runtime.collectives.symmetric_memory`).
Where a gloo group's ranks share one x86-64 host
(:func:`autotp.cost_model.collectives.uses_shared_memory_all_reduce`), every sum all-reduce and
every all-gather over the group goes through a shared-memory segment (:mod:`autotp.runtime.collectives.shared_memory`,
one per graph and group; about 20x faster than gloo's TCP loopback for a decode step's 2 KiB). This
module's :func:`through_stand_ins` puts the runtime's callables (each a :class:`StandInCollective`) in place
of the collectives their form runs (its row's ``kinds`` in
:data:`autotp.cost_model.collective_forms.FORM_TABLE`), and :func:`compiler_visible_collectives` puts their
custom ops in place of the callables for ``torch.compile``. Elsewhere (gloo ranks on several hosts,
another architecture) small all-reduces take the one-shot form below. The passes here take what they put in
the graph as arguments and never touch a process group's memory themselves.

Decoding one token per row makes every collective tiny (a few KiB) and therefore pure latency.
gloo's all-reduce is a ring: ``ws - 1`` reduce-scatter hops then ``ws - 1`` all-gather hops, each
waiting for the next rank to run. At tp 4 on a loaded CPU machine that is about 8 ms per
all-reduce of 2 KiB, against about 4 ms for an ``all_to_all_single`` in which every rank sends
its whole tensor to every other rank in one round and sums the ``ws`` copies itself (the
"one-shot" all-reduce that vLLM and TensorRT-LLM use for small messages on GPUs). At tp 2 the
ring is already a single exchange, so nothing changes there.

Every rank sums the same ``ws`` tensors in the same order (rank 0 first), so every rank gets the
same bits, as with gloo's ring; tokens chosen from the result agree on every rank.

:func:`one_shot_small_all_reduces` rewrites an inference graph after :mod:`autotp.passes.rewrite`:
each ``all_reduce(x, "sum") -> wait_tensor`` pair becomes one :func:`one_shot_all_reduce` node,
which sums ``x`` in one round when it holds at most :data:`ONE_SHOT_MAX_BYTES` and through the
ring otherwise (rank-local sizes are known only when the graph runs). The condition is
the one-shot row of :data:`autotp.cost_model.collective_forms.FORM_TABLE` (``FormSpec.takes``), which the
cost model reads too, so a plan for a gloo profile (``Hardware.small_all_reduce`` the one-shot form) prices
what runs.
:func:`autotp.passes.rewrite.count_collectives` still counts it as an ``all_reduce``. Other backends
keep their own all-reduce in this pass (CUDA tensors on one host take the symmetric-memory form above), and
so do training graphs (the backward of the functional all-reduce is kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
import torch.fx as fx

from autotp.cost_model.collective_forms import FORM_TABLE, ONE_SHOT_MAX_BYTES, CollectiveForm, FormSpec

__all__ = ["COLLECTIVE_STATE_PREFIX", "ONE_SHOT_MAX_BYTES", "StandInCollective", "compiler_visible_collectives",
           "has_group_collectives", "inference_collective_kind", "one_shot_all_reduce", "one_shot_small_all_reduces",
           "through_stand_ins"]

c10d = torch.ops._c10d_functional

_ONE_SHOT = FORM_TABLE[CollectiveForm.ONE_SHOT]


def one_shot_all_reduce(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group_name``.

    Up to :data:`ONE_SHOT_MAX_BYTES`, every rank sends ``x`` to every rank and adds the
    ``world_size`` copies in rank order (the same bits on every rank); a larger ``x`` goes through
    the functional all-reduce (gloo's ring). The size is checked per call, so a graph with dynamic
    batch or sequence dims takes the right path for each call's size, on every rank alike.
    """
    if not _ONE_SHOT.takes("all_reduce", world_size, x.numel() * x.element_size()):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
    flat = x.reshape(-1)
    count = int(flat.numel())
    received = c10d.wait_tensor(c10d.all_to_all_single(flat.repeat(world_size), [count] * world_size,
                                                       [count] * world_size, group_name))
    return received.view(world_size, *x.shape).sum(0)


class StandInCollective:
    """Base of a callable that a rank-local graph calls in place of a functional collective and its wait
    (the shared-memory all-reduce and all-gather of :mod:`autotp.runtime.collectives.shared_memory`, the symmetric-memory
    all-reduce of :mod:`autotp.runtime.collectives.symmetric_memory`): ``kind`` (``"all_reduce"``, ``"all_gather"``) is the
    collective it does, as counting and pricing see it."""

    kind: ClassVar[str]

    def compiler_form(self) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
        """``(op, state, args)``: the custom op a compiler sees in place of this callable, called as
        ``op(x, state, *args)``. ``state`` is the tensor the op mutates (the memory the ranks share), so a
        compiler keeps every call, in graph order; ``args`` are plain ints and strings
        (:func:`compiler_visible_collectives`)."""
        raise NotImplementedError(f"{type(self).__name__} has no compiler form")


def inference_collective_kind(target: object) -> str | None:
    """The collective kind (``"all_reduce"``, ``"all_gather"``) of a target this module puts in place of
    a functional collective and its wait, or None for any other target."""
    if target is one_shot_all_reduce:
        return "all_reduce"
    if isinstance(target, StandInCollective):
        return target.kind
    return None


def _waited_once(gm: fx.GraphModule, op: Any, keep: Callable[[fx.Node], bool]) -> list[tuple[fx.Node, fx.Node]]:
    """``(collective, wait_tensor)`` node pairs of ``gm``'s ``op`` nodes that ``keep`` accepts, waited on once."""
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op or not keep(node):
            continue
        waits = list(node.users)
        if len(waits) == 1 and waits[0].target is c10d.wait_tensor.default:
            pairs.append((node, waits[0]))
    return pairs


def _sum_all_reduces(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """``(all_reduce, wait_tensor)`` node pairs of ``gm``'s sum all-reduces waited on once."""
    return _waited_once(gm, c10d.all_reduce.default, lambda node: bool(node.args[1] == "sum"))


def _all_gathers(gm: fx.GraphModule, world_size: int) -> list[tuple[fx.Node, fx.Node]]:
    """``(all_gather_into_tensor, wait_tensor)`` pairs over the whole group, waited on once."""
    return _waited_once(gm, c10d.all_gather_into_tensor.default, lambda node: bool(node.args[1] == world_size))


def _replace(gm: fx.GraphModule, pairs: list[tuple[fx.Node, fx.Node]], target: Any,
             extra_args: Callable[[fx.Node], tuple[Any, ...]] = lambda node: ()) -> fx.GraphModule:
    """Each pair replaced by one ``target(source, *extra_args(all_reduce))`` node; recompiled when any."""
    for node, wait in pairs:
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(target, (node.args[0], *extra_args(node)))
        fused.meta.update(wait.meta)
        wait.replace_all_uses_with(fused)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(node)
    if pairs:
        gm.graph.lint()
        gm.recompile()
    return gm


_PAIRS: dict[str, Callable[[fx.GraphModule, int], list[tuple[fx.Node, fx.Node]]]] = {
    "all_gather": _all_gathers,
    "all_reduce": lambda gm, world_size: _sum_all_reduces(gm),
}
"""The collective kinds a stand-in may take the place of, each with what finds them in a graph, in the order
:func:`through_stand_ins` replaces them."""


def has_group_collectives(gm: fx.GraphModule, world_size: int) -> bool:
    """Whether ``gm`` has a sum all-reduce or an all-gather over the whole group that
    :func:`through_stand_ins` would replace."""
    return any(pairs(gm, world_size) for pairs in _PAIRS.values())


def through_stand_ins(gm: fx.GraphModule, form: FormSpec, stand_ins: tuple[StandInCollective, ...],
                      world_size: int) -> fx.GraphModule:
    """``gm`` with the collectives ``form`` runs (its row's ``kinds``: sum all-reduces, all-gathers over the
    whole group of ``world_size`` ranks), each with its wait, replaced by one ``stand_in(x)`` node, the stand-in
    of ``stand_ins`` of that kind. Changes ``gm`` in place and returns it."""
    by_kind = {stand_in.kind: stand_in for stand_in in stand_ins}
    if set(by_kind) != set(form.kinds):
        raise AssertionError(f"{form.form} runs {', '.join(form.kinds)}; its stand-ins do {', '.join(by_kind)}")
    for kind, pairs in _PAIRS.items():
        if kind in by_kind:
            _replace(gm, pairs(gm, world_size), by_kind[kind])
    return gm


COLLECTIVE_STATE_PREFIX = "_autotp_collective_state_"
"""Name prefix of the buffers :func:`compiler_visible_collectives` gives a graph: the memory its collectives'
ops share with the other ranks (a CUDA graph must see them at fixed addresses)."""


def compiler_visible_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose stand-in collectives are their custom ops (:meth:`StandInCollective.compiler_form`),
    each reading its state from a buffer of the copy; ``gm`` itself when it has none.

    A compiler cannot trace a Python callable that holds its own state; an op that takes the state as a
    tensor it mutates is kept opaque, called once per node, in graph order."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, StandInCollective)]
    if not nodes:
        return gm
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, remap)
    graph.output(output)
    copy = fx.GraphModule(gm, graph)
    states: dict[int, fx.Node] = {}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for old in nodes:
        node = remap[old]
        op, state, args = cast(StandInCollective, old.target).compiler_form()
        key = id(state)
        if key not in states:
            name = f"{COLLECTIVE_STATE_PREFIX}{len(states)}"
            copy.register_buffer(name, state, persistent=False)
            with graph.inserting_before(first):
                states[key] = graph.get_attr(name)
        with graph.inserting_before(node):
            call = graph.call_function(op, (node.args[0], states[key], *args))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    copy.recompile()
    return copy


def one_shot_small_all_reduces(gm: fx.GraphModule, group: dist.ProcessGroup | None,
                               world_size: int) -> fx.GraphModule:
    """``gm`` with its small gloo sum all-reduces done by :func:`one_shot_all_reduce` (see the module docstring).

    ``group``: the process group the graph's collectives run on (``None``: the default group).
    Changes ``gm`` in place and returns it; a graph on another backend, or at ``world_size <= 2``
    (where gloo's ring is one exchange already), is returned unchanged.
    """
    if (world_size < _ONE_SHOT.min_group or not dist.is_initialized()
            or not _ONE_SHOT.takes_group(group_size=world_size, backend=str(dist.get_backend(group)))):
        return gm
    return _replace(gm, _sum_all_reduces(gm), one_shot_all_reduce,
                    lambda node: (node.args[2], world_size))  # (group name, world size)
