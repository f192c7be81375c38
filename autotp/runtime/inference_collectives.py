"""The form each collective of an inference graph takes on its group, decided alike on every rank.

:func:`inference_all_reduces` is what :func:`autotp.runtime.applying.apply_plan` runs on every inference graph, in this order:

Which ranks share a host is the launcher's word where it gives one (:class:`autotp.runtime.hosts.Host`, read
once at the front of the runtime and passed down): ranks on two nodes of a launcher take the backend's
collectives (or the one-shot form) between them, even where they could map one segment.

1. ranks on one host with CUDA tensors: small sum all-reduces in symmetric memory
   (:mod:`autotp.runtime.symmetric_memory`; the others, and all-gathers, keep the backend's);
2. a gloo group on one x86-64 host with CPU tensors: every sum all-reduce and all-gather through a shared
   segment (:mod:`autotp.runtime.shared_memory`);
3. else a gloo group of three or more ranks: small sum all-reduces in one exchange round
   (:func:`autotp.passes.small_collectives.one_shot_small_all_reduces`);
4. else the backend's own collectives.

The cost model prices the same forms (``Hardware.small_all_reduce``: ``"symmetric_memory"``,
``"shared_memory"``, ``"one_shot"``, ``"ring"``; :mod:`autotp.cost_model.collectives`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from autotp.passes.small_collectives import (
    has_group_collectives,
    one_shot_all_reduce,
    one_shot_small_all_reduces,
    sum_all_reduces_through,
    through_stand_ins,
)
from autotp.runtime.hosts import Host
from autotp.runtime.shared_memory import SharedMemoryAllGather, SharedMemoryAllReduce, shared_memory_all_reduce_for
from autotp.runtime.symmetric_memory import SymmetricMemoryAllReduce, symmetric_memory_all_reduce_for

__all__ = ["collective_forms", "graph_device", "inference_all_reduces"]

c10d = torch.ops._c10d_functional


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device of ``gm``'s tensors (inputs as traced, parameters, buffers): the CPU unless one is elsewhere."""
    devices = {val.device for node in gm.graph.nodes if node.op == "placeholder"
               for val in [node.meta.get("val")] if isinstance(val, torch.Tensor)}
    devices |= {t.device for t in (*gm.parameters(), *gm.buffers())}
    others = sorted((d for d in devices if d.type != "cpu"), key=str)
    return others[0] if others else torch.device("cpu")


def inference_all_reduces(gm: fx.GraphModule, group: dist.ProcessGroup | None, world_size: int, *,
                          host: Host, timeout_s: float) -> fx.GraphModule:
    """``gm`` with its sum all-reduces (and, through shared memory, its all-gathers over the whole group) in
    the fastest form ``group`` has (module docstring).

    Collective where the graph has collectives on a group of several ranks (the host checks, the buffers):
    every rank calls it for the same graph, with ``host`` where it runs. ``timeout_s``: how long a rank waits
    for the others, there and in every shared-memory collective. Changes ``gm`` in place and returns it.
    """
    if world_size <= 1 or not has_group_collectives(gm, world_size):
        return one_shot_small_all_reduces(gm, group, world_size)
    device = graph_device(gm)
    symmetric = symmetric_memory_all_reduce_for(group, host=host, timeout_s=timeout_s, device=device)
    if symmetric is not None:
        return sum_all_reduces_through(gm, symmetric)
    shared = shared_memory_all_reduce_for(group, host=host, timeout_s=timeout_s, device_type=device.type)
    if shared is None:
        return one_shot_small_all_reduces(gm, group, world_size)
    return through_stand_ins(gm, shared, SharedMemoryAllGather(shared), world_size)


def collective_forms(gm: fx.GraphModule) -> frozenset[str]:
    """The forms the collectives of an inference graph took (:func:`inference_all_reduces`):
    ``"symmetric_memory"``, ``"shared_memory"``, ``"one_shot"``, ``"backend"`` (a functional collective of
    the process group's backend); what a test or a report reads to see what ran on a group."""
    forms = set()
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, SymmetricMemoryAllReduce):
            forms.add("symmetric_memory")
        elif isinstance(target, (SharedMemoryAllReduce, SharedMemoryAllGather)):
            forms.add("shared_memory")
        elif target is one_shot_all_reduce:
            forms.add("one_shot")
        elif node.op == "call_function" and str(target).startswith("_c10d_functional.") and (
                target is not c10d.wait_tensor.default):
            forms.add("backend")
    return frozenset(forms)
