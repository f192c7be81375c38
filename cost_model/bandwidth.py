"""Memory bandwidth at a working set: data that stays in cache moves faster than data read from DRAM.

A roofline prices memory-bound work (a one-token GEMV reads its whole weight for two FLOPs per
element) at ``bytes / bandwidth``. Which bandwidth depends on how much data a call touches: a
copy of 256 MiB measures DRAM, but a model whose weights fit the last-level cache reads them from
there on every call after the first, several times faster. One DRAM figure for every graph prices
a small model's decode step several times too slow, and the planner then splits what should stay
whole (more work divided, but collectives added that cost more than the work they save).

So ``autotp calibrate`` measures the copy bandwidth at several working-set sizes, per rank with
every rank copying at once (ranks share the last-level cache and the memory controllers as they
do when a plan runs), and stores them as ``Hardware.memory_bandwidth_curve``; the cost pass prices
each graph at the bandwidth of its own working set (:func:`at_working_set` with
:func:`graph_working_set_bytes`): the bytes of its placeholders (parameters, buffers, KV cache,
inputs) held whole, plus its largest intermediate value. That is the working set of the graph
run unsplit; a split plan touches less per rank, so the figure is the lower bound of what the
plan gets, the same for every candidate (the MILP's costs must not depend on its own choice).

Between measured sizes the bandwidth is interpolated linearly in ``log(working set)``; below the
smallest size it is the smallest size's, above the largest the largest's (DRAM). A profile with
no curve (GPU datasheet profiles, CPU profiles calibrated before the curve existed) prices every
graph at ``memory_bandwidth_gbps``, as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .collective_forms import FORM_TABLE, CollectiveForm
from .compute import tensor_bytes
from .hardware import Hardware

__all__ = [
    "DEFAULT_WORKING_SETS",
    "at_working_set",
    "bandwidth_at_gbps",
    "cold_call_at_s",
    "graph_profile",
    "graph_working_set_bytes",
]

DEFAULT_WORKING_SETS = (2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20)
"""Working sets (bytes per rank: source plus destination of a copy) ``autotp calibrate`` measures:
from inside a core's L2 (1 MiB) through a server's last-level cache (tens to hundreds of MiB) to
DRAM; the calibration's large copy (``CalibrationConfig.copy_bytes``) adds the DRAM point."""


def bandwidth_at_gbps(hardware: Hardware, working_set_bytes: float) -> float:
    """GB/s a rank of ``hardware`` gets moving data whose working set is ``working_set_bytes``.

    Interpolated in ``log(bytes)`` between the points of ``Hardware.memory_bandwidth_curve``,
    clamped to its end points; ``memory_bandwidth_gbps`` when the profile has no curve.
    """
    if not hardware.memory_bandwidth_curve:
        return hardware.memory_bandwidth_gbps
    return _on_curve(hardware.memory_bandwidth_curve, working_set_bytes)


def cold_call_at_s(curve: Sequence[tuple[float, float]], working_set_bytes: float) -> float:
    """Seconds a shared-memory collective pays beyond its back-to-back time in a graph of ``working_set_bytes``
    (``Hardware.shared_memory_cold_curve``'s value there, as :func:`at_working_set` resolves it); 0.0 without a
    curve."""
    return _on_curve(curve, working_set_bytes) if curve else 0.0


def _on_curve(curve: Sequence[tuple[float, float]], working_set_bytes: float) -> float:
    """A working-set curve's value at ``working_set_bytes``: linear in ``log(bytes)`` between its
    points, clamped to its end points."""
    if not math.isfinite(working_set_bytes) or working_set_bytes < 0:
        raise ValueError(f"working_set_bytes must be a finite number >= 0, got {working_set_bytes!r}")
    if working_set_bytes <= curve[0][0]:
        return curve[0][1]
    for (small, small_value), (large, large_value) in zip(curve, curve[1:]):
        if working_set_bytes <= large:
            weight = math.log(working_set_bytes / small) / math.log(large / small)
            return small_value + weight * (large_value - small_value)
    return curve[-1][1]


def at_working_set(hardware: Hardware, working_set_bytes: float) -> Hardware:
    """``hardware`` with ``memory_bandwidth_gbps`` set to :func:`bandwidth_at_gbps` of
    ``working_set_bytes``, and ``gemv_bandwidth_gbps`` and ``shared_memory_cold_call_s`` to their curves'
    values there: the profile every kernel and collective of one graph is priced with. The curves are
    kept, so resolving again (for another working set) starts from the measurements, not from these
    figures. A profile with no curve is returned unchanged."""
    resolved = {}
    if hardware.memory_bandwidth_curve:
        resolved["memory_bandwidth_gbps"] = bandwidth_at_gbps(hardware, working_set_bytes)
    if hardware.gemv_bandwidth_curve:
        resolved["gemv_bandwidth_gbps"] = _on_curve(hardware.gemv_bandwidth_curve, working_set_bytes)
    if hardware.shared_memory_cold_curve:
        resolved["shared_memory_cold_call_s"] = _on_curve(hardware.shared_memory_cold_curve, working_set_bytes)
    return dataclasses.replace(hardware, **resolved) if resolved else hardware


def graph_profile(hardware: Hardware, working_set_bytes: float, *, training: bool = False) -> Hardware:
    """The profile one graph is priced with: :func:`at_working_set` of ``working_set_bytes``, and
    for a training graph the backend's own collectives (``CollectiveForm.RING``) unless the profile's form runs
    in training graphs too (``FormSpec.in_training``: autotp's inference forms rewrite inference graphs only; a
    training graph keeps the functional all-reduce, whose backward autograd knows)."""
    resolved = at_working_set(hardware, working_set_bytes)
    if training and not FORM_TABLE[CollectiveForm.from_name(resolved.small_all_reduce)].in_training:
        resolved = dataclasses.replace(resolved, small_all_reduce=CollectiveForm.RING)
    return resolved


def graph_working_set_bytes(graph: fx.Graph) -> int:
    """Bytes one call of ``graph`` touches on a rank that holds everything whole: every
    placeholder's tensors (parameters, buffers, KV cache, inputs) plus the largest value a node
    produces (the biggest intermediate, e.g. a prefill's logits). Sizes from ``meta["val"]``;
    a dynamic size counts at its example value."""
    placeholders = largest = 0
    for node in graph.nodes:
        size = sum(tensor_bytes(leaf.shape, leaf.dtype) for leaf in pytree.tree_leaves(node.meta.get("val"))
                   if isinstance(leaf, torch.Tensor))
        if node.op == "placeholder":
            placeholders += size
        elif node.op == "call_function":
            largest = max(largest, size)
    return placeholders + largest
