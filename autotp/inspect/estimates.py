"""What a plan is predicted to cost: time per forward pass and memory per rank, broken down.

:func:`estimate` (``autotp.estimate(plan)``) reads only the :class:`~autotp.planning.plan.Plan` — no model,
no graph, no process group — and adds up the terms the planner priced:

* **time per forward** = compute + communication. Compute is the sum of every node's roofline
  time on one rank (``NodeDecision.compute_s``: max(FLOPs / peak, bytes / bandwidth) + kernel
  floor, see :mod:`autotp.cost_model.compute`); communication is the sum of every resharding
  the rewrite inserts that talks to other ranks (``CollectiveDecision.time_s``: alpha-beta
  collectives, see :mod:`autotp.cost_model.collectives`); a resharding without a collective (a
  local slice, zeros on the ranks other than 0) runs on the rank like any op and counts as compute
  of the node whose output it reshards. The two are added, not overlapped: the rewritten
  graph waits on each collective right after issuing it (``wait_tensor``), so nothing overlaps.
  Both are broken down per node (a collective counts for the node whose output it reshards)
  and per layer (see :func:`layer_of`).
* **host time** (when the profile is known: a name of ``KNOWN_HARDWARE`` or ``hardware=``): the
  dispatch the graph's nodes cost on the host under each runtime mode of the profile
  (:func:`autotp.cost_model.runtime.host_time_per_call`: eager pays every kernel and view node,
  compiled and cuda_graph only the call of the graph), and the per-call term
  ``graph_call_s`` (``Hardware.graph_launch_s``: the Python call of the graph, or the replay of a
  captured CUDA graph; ``Hardware.model_call_s``, what the model's call adds; ``Hardware.core_share_call_s``,
  what ranks sharing cores lose at its start), which
  :attr:`Estimate.time_per_call_s` adds to the per-node terms. The node times already include their
  host dispatch under the plan's own runtime mode. A plan with collectives also pays ``call_sync_wait_s``
  once per call (``Hardware.call_sync_wait_s``: its first collective waits for ranks that entered the call
  out of step, plus
  ``Hardware.call_sync_wait_per_compute`` times its compute: ranks drift apart while they compute,
  :func:`autotp.cost_model.collectives.call_sync_wait_s`), in :attr:`Estimate.comm_per_call_s`
  and :attr:`Estimate.time_per_call_s`; the solver pays the once-per-call part for a plan with any
  collective, not the part that grows with compute (a product of the choice and its compute).
  On a profile whose core share holds only up to a range of compute (``Hardware.core_share_range_s``), the
  compute beyond it runs at the fair share: :attr:`Estimate.fair_share_saving_s`, taken off
  :attr:`Estimate.time_s` (:meth:`autotp.cost_model.hardware.Hardware.shared_core_compute_s`; the nodes' own
  times stay at the profile's share).
* **memory per rank** = parameters (the plan's ``parameter_bytes_per_rank``: the largest
  rank's shards) + buffers and constants (whole on every rank) + the peak of live activations.
  The activation peak is a liveness walk over the plan's graph in execution order, the order
  the FX-generated code runs it in, which frees each tensor right after its last use: a node's
  output (at its local size under its placement: ``S(d)`` is the largest rank's block, ``R``
  and ``P`` full size) is allocated when the node runs and freed after its last consumer has
  run; view ops (``view``, ``transpose``, ``getitem``, ...) alias their input and only extend its
  life; every collective's result is a new buffer of its target placement's local size that
  lives until its last consumer. User inputs and graph outputs count for the whole forward.
  Not counted: temporaries inside a kernel (e.g. attention scores inside SDPA) and inside a
  collective (padding for uneven splits), and the caching allocator's fragmentation. This needs
  the node shapes of plan format v2; for a v1 plan the activation peak is ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterable
from typing import Any

import torch

from autotp.base.module_paths import block_name
from autotp.base.placements import placement_from_str
from autotp.base.reshard import ReshardKind
from autotp.cost_model import KNOWN_HARDWARE, Hardware, get_hardware, launches_no_kernel
from autotp.cost_model.collectives import call_sync_wait_s
from autotp.cost_model.runtime import HostTime, graph_host_s, host_time_per_call
from autotp.passes.resharding import is_collective_step
from autotp.passes.uneven import largest_shard_nbytes
from autotp.planning.decisions import CollectiveDecision, NodeDecision
from autotp.planning.plan import Plan

__all__ = [
    "Estimate",
    "LayerEstimate",
    "NodeEstimate",
    "estimate",
    "layer_of",
]



@functools.lru_cache(maxsize=512)
def _launches_no_kernel(op_name: str) -> bool:
    """:func:`autotp.cost_model.launches_no_kernel` of an op recorded by name (``aten.view.default``)."""
    if op_name == str(operator.getitem):
        return True
    namespace, _, rest = op_name.partition(".")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace, None), packet_name, None) if namespace == "aten" else None
    op = getattr(packet, overload, None) if packet is not None and overload else None
    return op is not None and launches_no_kernel(op)

_GIB = 2**30


def layer_of(module: str) -> str:
    """The layer a module belongs to: its FQN up to and including the first numeric part.

    ``model.layers.3.mlp.up_proj`` -> ``model.layers.3`` (:func:`autotp.base.module_paths.block_name`); ``transformer.h.0.attn`` ->
    ``transformer.h.0``; ``0`` (a Sequential's first child) -> ``0``. A module outside any
    numbered container is its own group (``lm_head``, ``model.norm``); ``""`` (ops at the top
    level of ``forward``) is ``"(top level)"``.
    """
    if not module:
        return "(top level)"
    return block_name(module) or module


@dataclasses.dataclass(frozen=True)
class NodeEstimate:
    """One graph node: its compute, the collectives on its output, and its output's local size."""

    name: str
    op: str
    module: str
    layer: str
    compute_s: float
    comm_s: float
    output_bytes_per_rank: int

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class LayerEstimate:
    """The nodes of one layer (see :func:`layer_of`) added up."""

    layer: str
    compute_s: float
    comm_s: float
    nodes: int
    collectives: int

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted seconds per forward pass and bytes per rank of one plan (see module docstring).

    ``memory_capacity_bytes`` is the device memory of the hardware profile when it is known
    (``None`` for a profile the estimate could not resolve by name; pass ``hardware=``).
    """

    hardware: str
    world_size: int
    compute_s: float
    comm_s: float
    nodes: tuple[NodeEstimate, ...]
    layers: tuple[LayerEstimate, ...]
    parameter_bytes_per_rank: int
    buffer_bytes_per_rank: int
    activation_peak_bytes_per_rank: int | None
    activation_peak_after: str
    memory_capacity_bytes: float | None
    training: bool = False  # a training plan's: times are per forward + backward step, backward collectives included
    runtime_mode: str = "eager"
    graph_call_s: float = 0.0
    host: HostTime | None = None
    call_sync_wait_s: float = 0.0
    fair_share_saving_s: float = 0.0

    @property
    def time_s(self) -> float:
        """Predicted seconds per forward pass: compute + communication (no overlap), less what the compute beyond
        the profile's core-share range saves at the fair share (module docstring)."""
        return self.compute_s - self.fair_share_saving_s + self.comm_s

    @property
    def comm_per_call_s(self) -> float:
        """Predicted communication per call of the rank-local graph: :attr:`comm_s` plus the wait its
        first collective pays once for ranks that entered the call out of step (``call_sync_wait_s``)."""
        return self.comm_s + self.call_sync_wait_s

    @property
    def time_per_call_s(self) -> float:
        """Predicted seconds per call of the rank-local graph: :attr:`time_s` plus the per-call
        terms (``graph_call_s``, the host's call; ``call_sync_wait_s``, the first collective's wait)."""
        return self.time_s + self.graph_call_s + self.call_sync_wait_s

    @property
    def memory_bytes_per_rank(self) -> int | None:
        """Parameters + buffers + activation peak on the largest rank (``None`` without shapes)."""
        if self.activation_peak_bytes_per_rank is None:
            return None
        return self.parameter_bytes_per_rank + self.buffer_bytes_per_rank + self.activation_peak_bytes_per_rank

    def layer(self, name: str) -> LayerEstimate:
        """The estimate of one layer by name (e.g. ``"model.layers.0"``); KeyError lists the layers."""
        for layer in self.layers:
            if layer.layer == name:
                return layer
        raise KeyError(f"no layer {name!r} in this plan; layers: {', '.join(entry.layer for entry in self.layers)}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["time_s"] = self.time_s
        data["time_per_call_s"] = self.time_per_call_s
        data["memory_bytes_per_rank"] = self.memory_bytes_per_rank
        return data

    def summary(self, max_rows: int = 40) -> str:
        """A terminal table: totals, the layers, the costliest nodes, memory per rank."""
        lines = [
            f"autotp estimate: world_size={self.world_size} hardware={self.hardware}",
            f"time per {'training step (forward + backward)' if self.training else 'forward'}: {_ms(self.time_s)} "
            f"(compute {_ms(self.compute_s)}, "
            f"communication {_ms(self.comm_s)})",
        ]
        if self.host is not None:
            modes = ", ".join(f"{mode} {_ms(seconds)}" for mode, seconds in self.host.by_mode.items())
            lines.append(f"host dispatch per forward ({self.host.kernels} kernel nodes, {self.host.views} views, "
                         f"{_ms(self.graph_call_s)} call): {modes}; nodes priced as {self.runtime_mode}")
        if self.fair_share_saving_s:
            lines.append(f"compute beyond the calibration's longest graph, at the fair share of a core: "
                         f"-{_ms(self.fair_share_saving_s)}")
        if self.call_sync_wait_s:
            lines.append("wait per call for ranks out of step (entering the call, drifting while computing): "
                         f"{_ms(self.call_sync_wait_s)}")
        lines += [
            "",
            f"{'layer':<40} {'compute':>11} {'comm':>11} {'total':>11} {'share':>7}",
        ]
        for layer in self.layers[:max_rows]:
            share = layer.time_s / self.time_s if self.time_s else 0.0
            lines.append(
                f"  {layer.layer:<38} {_ms(layer.compute_s):>11} {_ms(layer.comm_s):>11} "
                f"{_ms(layer.time_s):>11} {share:>7.1%}"
            )
        if len(self.layers) > max_rows:
            lines.append(f"  ... {len(self.layers) - max_rows} more layers")
        costliest = sorted(self.nodes, key=lambda n: n.time_s, reverse=True)[: min(10, max_rows)]
        lines += ["", f"{'costliest nodes':<40} {'compute':>11} {'comm':>11}  op"]
        for node in costliest:
            lines.append(f"  {node.name:<38} {_ms(node.compute_s):>11} {_ms(node.comm_s):>11}  {node.op}")
        lines += ["", "memory per rank:", f"  parameters   {_mib(self.parameter_bytes_per_rank)}",
                  f"  buffers      {_mib(self.buffer_bytes_per_rank)}"]
        if self.activation_peak_bytes_per_rank is None:
            lines.append("  activations  unknown (a plan of format v1 has no shapes; re-plan to get them)")
        else:
            lines.append(f"  activations  {_mib(self.activation_peak_bytes_per_rank)} at peak "
                         f"(after {self.activation_peak_after})")
            total = self.memory_bytes_per_rank or 0
            capacity = ""
            if self.memory_capacity_bytes:
                capacity = f" of {self.memory_capacity_bytes / _GIB:.1f} GiB ({total / self.memory_capacity_bytes:.1%})"
            lines.append(f"  total        {_mib(total)}{capacity}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _dtype_itemsize(name: str) -> int:
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        return 0
    return dtype.itemsize


def local_nbytes(shape: Iterable[int], dtype: str, placement_text: str, world_size: int) -> int:
    """Bytes of a tensor of ``shape`` on the largest rank under ``placement_text``.

    ``S(d)`` holds ``ceil(size / N)`` of dim ``d`` (``S(d)xk``: that of each of the k blocks);
    ``R`` and ``P`` hold the whole tensor: :func:`autotp.passes.uneven.largest_shard_nbytes`, as
    the planner's parameter bytes.
    """
    return largest_shard_nbytes(tuple(shape), _dtype_itemsize(dtype), placement_from_str(placement_text), world_size)


def _resolve_profile(plan: Plan, hardware: str | Hardware | None) -> Hardware | None:
    if hardware is None:
        return KNOWN_HARDWARE.get(plan.hardware)
    profile = get_hardware(hardware)
    if profile.name != plan.hardware:
        raise ValueError(
            f"this plan was costed for hardware {plan.hardware!r}, not {profile.name!r}; an estimate "
            f"adds up the plan's own costs, so re-plan with autotp.plan(..., options=autotp.PlanOptions(hardware={profile.name!r})) "
            f"to estimate on {profile.name!r}"
        )
    return profile


def _host_time(plan: Plan, profile: Hardware) -> HostTime:
    """Host dispatch of one call of the plan's graph under each runtime mode of ``profile``."""
    views = sum(1 for node in plan.nodes if node.op not in _NOT_OPS and _launches_no_kernel(node.op))
    kernels = sum(1 for node in plan.nodes
                  if node.op not in _NOT_OPS and not _launches_no_kernel(node.op) and node.compute_s > 0)
    return host_time_per_call(profile, kernels, views)


_NOT_OPS = frozenset({"placeholder", "output", "get_attr"})


def estimate(plan: Plan, hardware: str | Hardware | None = None) -> Estimate:
    """Predicted time per forward pass and memory per rank of ``plan`` (see module docstring).

    ``hardware`` is only needed for the device capacity of a profile that is not one of
    :data:`~autotp.cost_model.KNOWN_HARDWARE` (e.g. a calibrated JSON profile); it must be the
    profile the plan was costed for.
    """
    profile = _resolve_profile(plan, hardware)
    capacity = profile.memory_gib * _GIB if profile is not None else None
    comm_by_producer: dict[str, float] = {}
    local_by_producer: dict[str, float] = {}  # reshardings without a collective run on the rank: compute
    comm_s = 0.0
    for collective in (*plan.collectives, *plan.backward_collectives):  # a training plan prices its backward too
        talks = _talks(collective)
        into = comm_by_producer if talks else local_by_producer
        into[collective.producer] = into.get(collective.producer, 0.0) + collective.time_s
        comm_s += collective.time_s if talks else 0.0
    nodes = tuple(
        NodeEstimate(
            name=node.name,
            op=node.op,
            module=node.module,
            layer=layer_of(node.module),
            compute_s=node.compute_s + local_by_producer.get(node.name, 0.0),
            comm_s=comm_by_producer.get(node.name, 0.0),
            output_bytes_per_rank=local_nbytes(node.shape, node.dtype, node.output, plan.world_size),
        )
        for node in plan.nodes
    )
    layers = _by_layer(plan, nodes)
    buffers = sum(
        local_nbytes(n.shape, n.dtype, "R", plan.world_size)
        for n in plan.nodes
        if n.op == "placeholder" and n.target and n.target not in plan.parameters
    )
    peak, peak_after = _activation_peak(plan)
    nodes_compute_s = sum(node.compute_s for node in plan.nodes)
    return Estimate(
        hardware=plan.hardware,
        world_size=plan.world_size,
        compute_s=sum(n.compute_s for n in nodes),
        comm_s=comm_s,
        nodes=nodes,
        layers=layers,
        parameter_bytes_per_rank=plan.parameter_bytes_per_rank,
        buffer_bytes_per_rank=buffers,
        activation_peak_bytes_per_rank=peak,
        activation_peak_after=peak_after,
        memory_capacity_bytes=capacity,
        training=plan.training,
        runtime_mode=profile.runtime_mode if profile is not None else "eager",
        graph_call_s=graph_host_s(profile) if profile is not None else 0.0,
        host=_host_time(plan, profile) if profile is not None else None,
        call_sync_wait_s=(call_sync_wait_s(profile, sum(plan.collective_counts().values()),
                                           nodes_compute_s)  # as the solver prices it
                          if profile is not None and plan.world_size > 1 else 0.0),
        fair_share_saving_s=(nodes_compute_s - profile.shared_core_compute_s(nodes_compute_s)
                             if profile is not None else 0.0),
    )


def _talks(collective: CollectiveDecision) -> bool:
    """Whether a resharding talks to other ranks; one that does not (a local slice, zeros on the ranks
    other than 0) runs on the rank like any op, and counts as compute."""
    return any(is_collective_step(step) for step in collective.steps)


def _by_layer(plan: Plan, nodes: tuple[NodeEstimate, ...]) -> tuple[LayerEstimate, ...]:
    compute: dict[str, float] = {}
    comm: dict[str, float] = {}
    counts: dict[str, int] = {}
    collectives: dict[str, int] = {}
    layer_by_node = {n.name: n.layer for n in nodes}
    for node in nodes:  # first appearance orders the layers: execution order
        compute[node.layer] = compute.get(node.layer, 0.0) + node.compute_s
        counts[node.layer] = counts.get(node.layer, 0) + 1
    for collective in filter(_talks, plan.collectives):
        layer = layer_by_node.get(collective.producer, layer_of(collective.module))
        comm[layer] = comm.get(layer, 0.0) + collective.time_s
        collectives[layer] = collectives.get(layer, 0) + 1
        compute.setdefault(layer, 0.0)
    return tuple(
        LayerEstimate(layer, compute[layer], comm.get(layer, 0.0), counts.get(layer, 0), collectives.get(layer, 0))
        for layer in compute
    )


# ------------------------------------------------------------------------------ activations

def _has_shapes(plan: Plan) -> bool:
    return any(node.dtype for node in plan.nodes)


def _activation_peak(plan: Plan) -> tuple[int | None, str]:
    """(peak bytes of live activations on the largest rank, the node after which it is reached).

    Time runs in half steps: node i runs at 2i (its output is allocated while its inputs are
    still alive), the collectives on its output at 2i + 1 (after the inputs read only by node i
    are freed); a buffer is freed after the last step that reads it.
    """
    if not _has_shapes(plan):
        return None, ""
    world_size = plan.world_size
    position = {node.name: index for index, node in enumerate(plan.nodes)}
    end = 2 * len(plan.nodes)
    by_name: dict[str, NodeDecision] = {node.name: node for node in plan.nodes}
    copies = {(c.producer, c.dst): c for c in plan.collectives if any(step is not ReshardKind.SLICE for step in c.steps)}

    size: dict[str, int] = {}  # buffer -> bytes on the largest rank
    born: dict[str, int] = {}
    last_use: dict[str, int] = {}
    buffer_of: dict[str, str] = {}  # node name -> the buffer holding its output (views share one)

    def use(buffer: str | None, step: int) -> None:
        if buffer is not None:
            last_use[buffer] = max(last_use.get(buffer, step), step)

    for producer_name, dst in copies:
        producer = by_name.get(producer_name)
        if producer is None:
            continue
        key = f"{producer_name}->{dst}"  # a new buffer: all-gather, all-reduce, zeros...
        size[key] = local_nbytes(producer.shape, producer.dtype, dst, world_size)
        born[key] = 2 * position[producer_name] + 1

    for index, node in enumerate(plan.nodes):
        if node.op == "placeholder":
            if node.target:  # a parameter, buffer or constant: counted apart from activations
                continue
            buffer_of[node.name] = node.name
            size[node.name] = local_nbytes(node.shape, node.dtype, node.output, world_size)
            born[node.name] = 0
            use(node.name, end)  # a user input: the caller holds it for the whole forward
            continue
        step = end if node.op == "output" else 2 * index  # outputs are held by the caller
        read: list[str | None] = []
        for slot, producer_name in enumerate(node.input_nodes):
            producer = by_name.get(producer_name)
            wanted = node.inputs[slot] if slot < len(node.inputs) else None
            if producer is not None and wanted is not None and (producer_name, wanted) in copies:
                buffer: str | None = f"{producer_name}->{wanted}"
                use(buffer_of.get(producer_name), 2 * position[producer_name] + 1)  # read by the collective
            else:
                buffer = buffer_of.get(producer_name)
            use(buffer, step)
            read.append(buffer)
        if node.op == "output":
            continue
        if _launches_no_kernel(node.op) and read and read[0] is not None:
            buffer_of[node.name] = read[0]  # a view: same storage as its input
            continue
        buffer_of[node.name] = node.name
        size[node.name] = local_nbytes(node.shape, node.dtype, node.output, world_size)
        born[node.name] = step
        use(node.name, step)  # an unused output is freed right away

    delta = [0] * (end + 2)
    for buffer, nbytes in size.items():
        delta[born[buffer]] += nbytes
        delta[max(last_use.get(buffer, born[buffer]), born[buffer]) + 1] -= nbytes
    live, peak, peak_step = 0, 0, 0
    for step in range(end + 1):
        live += delta[step]
        if live > peak:
            peak, peak_step = live, step
    after = plan.nodes[min(peak_step // 2, len(plan.nodes) - 1)].name if plan.nodes else ""
    return peak, after
