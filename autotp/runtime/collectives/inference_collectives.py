"""The form each collective of an inference graph takes on its group, decided alike on every rank.

:func:`inference_all_reduces` is what :func:`autotp.runtime.execution.applying.apply_plan` runs on every inference graph, in this order:

Which ranks share a host is the launcher's word where it gives one (:class:`autotp.runtime.collectives.hosts.Host`, read
once at the front of the runtime and passed down): ranks on two nodes of a launcher take the backend's
collectives (or the one-shot form) between them, even where they could map one segment.

1. ranks on one host with CUDA tensors: small sum all-reduces in symmetric memory
   (:mod:`autotp.runtime.collectives.symmetric_memory`; the others, and all-gathers, keep the backend's);
2. a gloo group on one x86-64 host with CPU tensors: every sum all-reduce and all-gather through a shared
   segment (:mod:`autotp.runtime.collectives.shared_memory`);
3. else a gloo group of three or more ranks: small sum all-reduces in one exchange round
   (:func:`autotp.passes.small_collectives.one_shot_small_all_reduces`);
4. else the backend's own collectives.

Each form is a row of two tables keyed by one enum, :class:`~autotp.cost_model.collective_forms.CollectiveForm`:
:data:`~autotp.cost_model.collective_forms.FORM_TABLE` (when it applies, its cost, its fit; the cost model reads
it to price what runs) and :data:`RUNTIME_FORMS` here (how it is set up on a group and put in a graph, and how a
graph's node shows it). The runtime tries the forms in ``FORM_TABLE``'s order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.fx as fx

from autotp.cost_model.collective_forms import FORM_TABLE, CollectiveForm
from autotp.passes.small_collectives import (
    StandInCollective,
    has_group_collectives,
    one_shot_all_reduce,
    one_shot_small_all_reduces,
    through_stand_ins,
)
from autotp.runtime.collectives.hosts import Host
from autotp.runtime.collectives.shared_memory import (
    SharedMemoryAllGather,
    SharedMemoryAllReduce,
    shared_memory_all_reduce_for,
)
from autotp.runtime.collectives.symmetric_memory import SymmetricMemoryAllReduce, symmetric_memory_all_reduce_for

__all__ = ["RUNTIME_FORMS", "RuntimeForm", "collective_forms", "graph_device", "inference_all_reduces"]

c10d = torch.ops._c10d_functional


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device of ``gm``'s tensors (inputs as traced, parameters, buffers): the CPU unless one is elsewhere."""
    devices = {val.device for node in gm.graph.nodes if node.op == "placeholder"
               for val in [node.meta.get("val")] if isinstance(val, torch.Tensor)}
    devices |= {t.device for t in (*gm.parameters(), *gm.buffers())}
    others = sorted((d for d in devices if d.type != "cpu"), key=str)
    return others[0] if others else torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Group:
    """What a form is set up on: the process group (None: the default one), its size, where this rank runs
    (``host``), how long a rank waits for the others (``timeout_s``) and the device of the graph's tensors."""

    group: dist.ProcessGroup | None
    world_size: int
    host: Host
    timeout_s: float
    device: torch.device


@dataclasses.dataclass(frozen=True)
class RuntimeForm:
    """A form's runtime half (its cost half: :data:`~autotp.cost_model.collective_forms.FORM_TABLE`).

    ``install(gm, group)``: ``gm`` with the collectives the form takes put in its form, or None where the form
    does not run on ``group`` (collective: every rank calls it, and decides alike); ``shows(node)``: whether a
    node of an inference graph runs in this form (:func:`collective_forms`)."""

    install: Callable[[fx.GraphModule, Group], fx.GraphModule | None]
    shows: Callable[[fx.Node], bool]


def _through(form: CollectiveForm, stand_ins: Callable[[Group], tuple[StandInCollective, ...] | None]
             ) -> Callable[[fx.GraphModule, Group], fx.GraphModule | None]:
    """A form's install from the stand-ins it sets up on a group (None: it does not run there), which
    :func:`~autotp.passes.small_collectives.through_stand_ins` puts in place of the kinds its row runs."""
    def install(gm: fx.GraphModule, group: Group) -> fx.GraphModule | None:
        made = stand_ins(group)
        return None if made is None else through_stand_ins(gm, FORM_TABLE[form], made, group.world_size)
    return install


def _symmetric_memory(group: Group) -> tuple[StandInCollective, ...] | None:
    all_reduce = symmetric_memory_all_reduce_for(group.group, host=group.host, timeout_s=group.timeout_s,
                                                 device=group.device)
    return None if all_reduce is None else (all_reduce,)


def _shared_memory(group: Group) -> tuple[StandInCollective, ...] | None:
    all_reduce = shared_memory_all_reduce_for(group.group, host=group.host, timeout_s=group.timeout_s,
                                              device_type=group.device.type)
    return None if all_reduce is None else (all_reduce, SharedMemoryAllGather(all_reduce))


def _is_backend_collective(node: fx.Node) -> bool:
    return (node.op == "call_function" and str(node.target).startswith("_c10d_functional.")
            and node.target is not c10d.wait_tensor.default)


RUNTIME_FORMS: Mapping[CollectiveForm, RuntimeForm] = MappingProxyType({
    CollectiveForm.SYMMETRIC_MEMORY: RuntimeForm(
        _through(CollectiveForm.SYMMETRIC_MEMORY, _symmetric_memory),
        lambda node: isinstance(node.target, SymmetricMemoryAllReduce)),
    CollectiveForm.SHARED_MEMORY: RuntimeForm(
        _through(CollectiveForm.SHARED_MEMORY, _shared_memory),
        lambda node: isinstance(node.target, (SharedMemoryAllReduce, SharedMemoryAllGather))),
    CollectiveForm.ONE_SHOT: RuntimeForm(
        lambda gm, group: one_shot_small_all_reduces(gm, group.group, group.world_size),
        lambda node: node.target is one_shot_all_reduce),
    CollectiveForm.RING: RuntimeForm(lambda gm, group: gm, _is_backend_collective),
})
"""Every form's runtime half, keyed as :data:`~autotp.cost_model.collective_forms.FORM_TABLE`."""

if set(RUNTIME_FORMS) != set(FORM_TABLE):  # pragma: no cover - a form added without its runtime row
    raise AssertionError(f"RUNTIME_FORMS lacks rows for {sorted(set(FORM_TABLE) - set(RUNTIME_FORMS))}")


def inference_all_reduces(gm: fx.GraphModule, group: dist.ProcessGroup | None, world_size: int, *,
                          host: Host, timeout_s: float) -> fx.GraphModule:
    """``gm`` with its sum all-reduces (and, through shared memory, its all-gathers over the whole group) in
    the fastest form ``group`` has (module docstring): the first form of ``FORM_TABLE`` that runs on it.

    Collective where the graph has collectives on a group of several ranks (the host checks, the buffers):
    every rank calls it for the same graph, with ``host`` where it runs. ``timeout_s``: how long a rank waits
    for the others, there and in every shared-memory collective. Changes ``gm`` in place and returns it.
    """
    if world_size <= 1 or not has_group_collectives(gm, world_size):
        return gm
    on = Group(group, world_size, host, timeout_s, graph_device(gm))
    for form in FORM_TABLE:
        installed = RUNTIME_FORMS[form].install(gm, on)
        if installed is not None:
            return installed
    return gm


def collective_forms(gm: fx.GraphModule) -> frozenset[str]:
    """The forms the collectives of an inference graph took (:func:`inference_all_reduces`), each as its row
    names it (``FormSpec.name_in_graph``; the backend's functional collectives: ``"backend"``); what a test or a
    report reads to see what ran on a group."""
    forms = set()
    for node in gm.graph.nodes:
        form = next((form for form in FORM_TABLE if RUNTIME_FORMS[form].shows(node)), None)
        if form is not None:
            forms.add(FORM_TABLE[form].name_in_graph)
    return frozenset(forms)
