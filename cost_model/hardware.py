"""Hardware and topology profiles: data with units and sources.

A :class:`Hardware` describes one kind of device (its dense peak throughput per dtype, its memory
bandwidth and capacity, the floor time of one kernel) and the two kinds of link a device mesh can
use: ``intra_node`` (devices in one server: NVLink/NVSwitch, or PCIe) and ``inter_node`` (the
network between servers). Every number carries its unit in its field name and cites its source in
a comment; profiles are frozen and round-trip through JSON (:meth:`Hardware.to_json`,
:meth:`Hardware.from_json`).

Units (decimal, as datasheets use them):

* ``*_tflops``: 10^12 floating-point operations per second, dense (no 2:4 sparsity);
* ``*_gbps``: 10^9 *bytes* per second (GB/s, not gigabits);
* ``*_gib``: 2^30 bytes (device memory sold as "80 GB" is binary: an 80 GB H100 reports
  81,559 MiB in nvidia-smi, so datasheet capacities are used as GiB);
* ``*_s``: seconds.

Link bandwidth is the per-GPU, per-direction bandwidth that nccl-tests calls *bus bandwidth*
("the speed of the hardware bottleneck: NVLink, PCI, QPI, or network", nccl-tests
doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), so a
collective's time is the published formula with ``B = bandwidth_gbps * 1e9``.

Link latency follows NCCL's own tuning model (``src/graph/tuning.cc`` in
https://github.com/NVIDIA/nccl, NCCL >= 2.18): a fixed ``baseLat`` per collective call plus a
hardware latency ``hwLat`` per algorithm step, both in microseconds, per link kind (NVLink, PCI,
network). We take the LL-protocol ring values, the protocol NCCL picks for the small messages where
latency matters:

====================  ==============  ==========================
quantity              value (us)      tuning.cc entry
====================  ==============  ==========================
base, per collective  6.6             ``baseLat[Ring][LL]``
per step, NVLink      0.6             ``hwLat[NVLINK][Ring][LL]``
per step, PCIe        1.0             ``hwLat[PCI][Ring][LL]``
per step, network     2.7             ``hwLat[NET][Ring][LL]``
====================  ==============  ==========================

Peak throughputs are datasheet peaks. ``achievable_fraction_compute`` and
``achievable_fraction_memory`` default to 1.0 (no derating) for every datasheet profile: a derating
without a measurement behind it would be a fudge factor. ``autotp calibrate`` measures the local
machine and writes a profile whose numbers are measured, not quoted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .collective_forms import FORM_TABLE, CollectiveForm

__all__ = [
    "HARDWARE_JSON_VERSION",
    "KNOWN_HARDWARE",
    "FIRST_CALL_KINDS",
    "OP_FAMILIES",
    "OP_FIXED_COSTS",
    "RUNTIME_MODES",
    "SMALL_ALL_REDUCE_ALGORITHMS",
    "Hardware",
    "LinkProfile",
    "get_hardware",
    "shared_core_compute_s",
]

OP_FAMILIES = ("convolution", "pooling", "batch_norm", "attention")
"""Op families priced with a fixed cost per call of their own (``Hardware.op_fixed_s``, measured by
``autotp calibrate``): library kernels that set up a primitive or a plan on every call."""

OP_FIXED_COSTS = (*OP_FAMILIES, "attention_call", "attention_math")
"""What ``Hardware.op_fixed_s`` names: each op family's fixed cost (attention's per block of queries its CPU flash
kernel runs), and two more of attention: ``"attention_call"``, what a flash call pays once besides its blocks
(choosing its kernel, turning a boolean mask into an additive one), and ``"attention_math"``, what a call PyTorch
runs in its composite math kernel instead pays once (about twenty ATen ops: on a CPU, keys and values with fewer
heads than the queries and no ``enable_gqa``)."""

FIRST_CALL_KINDS = ("kernel", *OP_FAMILIES)
"""What ``Hardware.first_call_s`` names: ``"kernel"`` (any op of no family measured on its own) and the op
families."""

RUNTIME_MODES = ("eager", "compiled", "cuda_graph")
"""How a rank-local graph is run, which decides what each node costs on the host (see
:class:`Hardware`): ``"eager"`` dispatches every ATen node through PyTorch one by one (the
GraphModule call autotp's runtime makes); ``"compiled"`` runs Inductor's generated code, which
calls its kernels directly (no ATen dispatch per node, views folded into indexing);
``"cuda_graph"`` replays a captured CUDA graph: one host launch per call, kernels back to back."""

# Version of the JSON form written by Hardware.to_json; bump it when fields change meaning.
HARDWARE_JSON_VERSION = 1

_US = 1e-6  # seconds per microsecond

SMALL_ALL_REDUCE_ALGORITHMS = tuple(str(form) for form in CollectiveForm)
"""How the runtime runs an inference all-reduce, the names of :class:`~.collective_forms.CollectiveForm`: the
backend's own all-reduce, the one-shot exchange round on gloo, shared memory on one x86-64 host, symmetric
memory on CUDA (when each applies, its cost and what calibration fits: :data:`~.collective_forms.FORM_TABLE`)."""

# Host/runtime fields of Hardware that are non-negative numbers with a 0.0 default.
_HOST_TIME_FIELDS = (
    "host_dispatch_s",
    "graph_launch_s",
    "model_call_s",
    "collective_wait_s",
    "call_sync_wait_s",
    "call_sync_wait_per_compute",
    "call_sync_wait_compute_range_s",
    "core_share_range_s",
    "core_share_call_s",
    "gemm_half_efficiency_dim",
    "transcendental_element_s",
    "shared_memory_cold_call_s",
)

_RETIRED_FIELDS = ("kernel_extra_fraction", "kernel_extra_cap_s")
"""Fields of profiles from earlier releases of ``autotp calibrate`` that this release no longer prices: an extra per
kernel in a graph up to a cap, which the calibration replaced by one in-graph scale on every single-op price
(``cost_model.graph_calibration.fit_in_graph_scale``) and then left at 0. A profile that carries them at 0 loads
as before; one that carries a non-zero extra is refused (:meth:`Hardware.from_dict`)."""


def _checked_named_seconds(owner: str, field: str, pairs: Any, names: tuple[str, ...] | None = None
                           ) -> tuple[tuple[str, float], ...]:
    """``Hardware.<field>`` (``op_fixed_s``, ``op_element_s``, ``first_call_s``) as a tuple of ``(name, seconds)``,
    each name once and a non-empty string, one of ``names`` when given, seconds at least 0."""
    try:
        pairs = tuple((name, seconds) for name, seconds in pairs)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.{field} must be (name, seconds) pairs, got {pairs!r}") from None
    for name, seconds in pairs:
        if names is not None and name not in names:
            what = "the fixed costs are" if names == OP_FIXED_COSTS else "the names it takes are"
            raise ValueError(f"{owner}.{field} names {name!r}; {what}: {', '.join(names)}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{owner}.{field} names must be ATen op names such as 'tanh', got {name!r}")
        _check_positive_number(owner, f"{field}[{name!r}]", seconds, allow_zero=True)
    listed = [name for name, _ in pairs]
    if len(set(listed)) != len(listed):
        raise ValueError(f"{owner}.{field} names one twice: {listed}")
    return pairs


def _named_seconds_from_json(field: str, data: Any) -> tuple[tuple[str, float], ...]:
    """A ``(name, seconds)`` field from its JSON object (validated where the profile is built)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"field {field!r} must be an object from name to seconds, got {type(data).__name__}")
    return tuple(data.items())


def _checked_busy_scale(owner: str, points: Any) -> tuple[tuple[int, float], ...]:
    """``busy_compute_scale`` as a tuple of ``(busy ranks, relative time)``, busy ranks ascending and >= 1."""
    try:
        checked = tuple((int(busy), float(scale)) for busy, scale in points)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.busy_compute_scale must be (busy ranks, relative time) pairs, got {points!r}") from None
    busy = [k for k, _ in checked]
    if any(k < 1 for k in busy) or busy != sorted(set(busy)) or any(
            not math.isfinite(s) or s <= 0 for _, s in checked):
        raise ValueError(f"{owner}.busy_compute_scale needs distinct busy-rank counts >= 1 in ascending order and "
                         f"positive finite times, got {points!r}; run `autotp calibrate` again")
    return checked


def _busy_scale_from_json(data: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(data, list) or any(not isinstance(p, Mapping) or set(p) != {"busy_ranks", "relative_time"}
                                         for p in data):
        raise ValueError("field 'busy_compute_scale' must be a list of {\"busy_ranks\": k, \"relative_time\": t}")
    return tuple((p["busy_ranks"], p["relative_time"]) for p in data)


def _check_known_fields(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """ValueError naming a field the profile does not have (a typo would otherwise be silently ignored)."""
    import difflib

    unknown = [key for key in data if key not in known]
    if unknown:
        close = {key: difflib.get_close_matches(str(key), known, n=1) for key in unknown}
        named = ", ".join(f"{key!r}" + (f" (did you mean {close[key][0]!r}?)" if close[key] else "") for key in unknown)
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {named} in {where}; "
                         f"its fields are: {', '.join(known)}")


def _check_positive_number(owner: str, field_name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{field_name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{field_name} must be {bound}, got {value!r}")


def _checked_curve(owner: str, curve: Any, field_name: str = "memory_bandwidth_curve",
                   value: str = "bandwidth_gbps", allow_zero: bool = False) -> tuple[tuple[float, float], ...]:
    """``curve`` as a tuple of ``(working_set_bytes, value)`` pairs, ascending in bytes;
    ValueError naming what is wrong otherwise."""
    try:
        points = tuple((size, y) for size, y in curve)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.{field_name} must be (working_set_bytes, {value}) pairs, got {curve!r}") from None
    for index, (size, y) in enumerate(points):
        _check_positive_number(owner, f"{field_name}[{index}] working_set_bytes", size)
        _check_positive_number(owner, f"{field_name}[{index}] {value}", y, allow_zero=allow_zero)
    if any(later[0] <= earlier[0] for earlier, later in zip(points, points[1:])):
        raise ValueError(f"{owner}.{field_name} must be in ascending working_set_bytes, each size once; "
                         f"got sizes {[size for size, _ in points]}")
    return points


def _curve_from_json(data: Any, field_name: str = "memory_bandwidth_curve",
                     value: str = "bandwidth_gbps") -> tuple[tuple[float, float], ...]:
    """The JSON form of a working-set curve (a list of ``{"working_set_bytes", value}`` objects)."""
    if not isinstance(data, list):
        raise ValueError(f"{field_name} must be a list of {{'working_set_bytes', '{value}'}} "
                         f"objects, got {type(data).__name__}")
    points = []
    for index, point in enumerate(data):
        if not isinstance(point, Mapping):
            raise ValueError(f"{field_name}[{index}] must be an object, got {point!r}")
        _check_known_fields(point, ("working_set_bytes", value), f"{field_name}[{index}]")
        if "working_set_bytes" not in point or value not in point:
            raise ValueError(f"{field_name}[{index}] needs 'working_set_bytes' and '{value}', got {dict(point)!r}")
        points.append((point["working_set_bytes"], point[value]))
    return tuple(points)


@dataclass(frozen=True)
class LinkProfile:
    """One kind of link between devices, as seen by one GPU.

    ``bandwidth_gbps``: GB/s per direction per GPU, i.e. the bus bandwidth of nccl-tests
    (doc/PERFORMANCE.md): the hardware peak a collective can approach.
    ``latency_s``: alpha, seconds per message step of a collective algorithm (NCCL's ``hwLat``).
    ``base_latency_s``: seconds paid once per collective call, whatever the group size (NCCL's
    ``baseLat``); 0.0 makes :func:`collective_time_s` exactly the textbook alpha-beta formula.
    ``burst_bytes``: bytes a message gets across an idle link before its rate applies (a token bucket's burst,
    [TBF]); a one-way send (:func:`~.collectives.p2p_time_s`) pays the rate on the bytes beyond it. 0.0 for every
    link but a measured ``Hardware.inter_node_send``; collectives, which keep the link busy both ways, ignore it.

    [TBF] tc-tbf(8), the Linux token bucket filter: a bucket of ``burst`` bytes refilled at ``rate``; a packet
    leaves when the bucket holds its size.
    """

    name: str
    bandwidth_gbps: float
    latency_s: float
    base_latency_s: float = 0.0
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        owner = f"LinkProfile({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LinkProfile.name must be a non-empty string, got {self.name!r}")
        _check_positive_number(owner, "bandwidth_gbps", self.bandwidth_gbps)
        _check_positive_number(owner, "latency_s", self.latency_s, allow_zero=True)
        _check_positive_number(owner, "base_latency_s", self.base_latency_s, allow_zero=True)
        _check_positive_number(owner, "burst_bytes", self.burst_bytes, allow_zero=True)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """``bandwidth_gbps`` in bytes per second."""
        return self.bandwidth_gbps * 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency_s": self.latency_s,
            "base_latency_s": self.base_latency_s,
            **({"burst_bytes": self.burst_bytes} if self.burst_bytes else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "link") -> LinkProfile:
        if not isinstance(data, Mapping):
            raise ValueError(f"field {where!r} must be a JSON object, got {type(data).__name__}")
        _check_known_fields(data, ("name", "bandwidth_gbps", "latency_s", "base_latency_s", "burst_bytes"),
                            f"link {where!r}")
        for key in ("name", "bandwidth_gbps", "latency_s"):
            if key not in data:
                raise ValueError(f"missing field {where}.{key!r}")
        try:
            return cls(
                name=data["name"],
                bandwidth_gbps=data["bandwidth_gbps"],
                latency_s=data["latency_s"],
                base_latency_s=data.get("base_latency_s", 0.0),
                burst_bytes=data.get("burst_bytes", 0.0),
            )
        except ValueError as error:
            raise ValueError(f"bad field {where!r}: {error}") from None


def shared_core_compute_s(compute_s: float, core_share: float, range_s: float, fair_core_share: float) -> float:
    """Wall seconds of compute priced at ``compute_s`` with ``core_share`` of a core: as priced up to ``range_s``
    (the longest compute the share was measured on; 0.0: no range), the compute beyond at ``fair_core_share``
    (:attr:`Hardware.core_share_range_s`)."""
    beyond_s = compute_s - range_s
    if not range_s or beyond_s <= 0:
        return compute_s
    return range_s + beyond_s * core_share / fair_core_share


@dataclass(frozen=True)
class Hardware:
    """One device kind and the links between devices; every field carries its unit.

    ``peak_tflops``: dense peak by dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``, and
    ``"float64"`` where the datasheet gives it), TFLOP/s. ``"float32"`` is the non-tensor-core
    FP32 rate, because PyTorch runs float32 matmuls in full FP32 unless the user opts into TF32
    (``torch.backends.cuda.matmul.allow_tf32`` defaults to False).
    ``memory_bandwidth_gbps``: device memory (HBM/GDDR/DRAM) bandwidth, GB/s.
    ``memory_gib``: device memory capacity, GiB.
    ``kernel_floor_s``: time of the shortest kernel (launch and scheduling), seconds.
    ``view_op_s``: host time of an op that launches no kernel (a view such as ``transpose`` or
    ``getitem``: dispatch only), seconds. 0.0 for GPU profiles, where the host issues it while
    earlier kernels run, so it adds nothing to the device's time; on a CPU the host *is* the
    device and every op's dispatch adds up, so ``autotp calibrate`` measures it.
    ``intra_node`` / ``inter_node``: links inside a node and between nodes.
    ``devices_per_node``: devices that share ``intra_node`` links.
    ``achievable_fraction_compute`` / ``achievable_fraction_memory``: fraction of the peak that
    kernels reach; 1.0 (datasheet peak, no derating) unless a calibration measured it.
    ``source``: where the numbers come from (datasheets, or "calibrated on <host>").

    Host and runtime terms (all optional in JSON; a profile written before they existed loads with
    the defaults, which price exactly as before: no host term beyond ``kernel_floor_s`` and
    ``view_op_s``, datasheet GEMM rates at every shape):

    ``runtime_mode``: one of :data:`RUNTIME_MODES` (default ``"eager"``), how the rank-local
    graph runs; it selects which of the host terms below a node pays
    (:func:`~.runtime.node_host_s`).
    ``host_dispatch_s``: host seconds per kernel node in ``"eager"`` mode (the FX call, ATen
    dispatch and kernel launch of one op), as measured in a real graph (``autotp calibrate``
    fits it over graphs of different sizes). ``host_is_device``: True on a CPU, where the host
    *is* the device, so the dispatch adds to the kernel's time; False on a GPU, where the host
    runs ahead and a node takes the longer of its kernel and its dispatch. A calibrated CPU
    profile puts a node's whole fixed cost here and sets ``kernel_floor_s`` to 0.
    ``graph_launch_s``: host seconds per call of a rank-local graph (the Python call of the
    module; in ``"cuda_graph"`` mode the replay launch of the captured graph).
    ``model_call_s``: host seconds a compiled model's call adds to its rank-local graph's call (its inputs
    flattened and checked, its weights gathered, its outputs built; the code cold after a wait), measured by
    ``autotp calibrate`` on a compiled model (:mod:`autotp.calibration.model_call`); 0.0 in the datasheet
    profiles.
    ``collective_wait_s``: seconds a collective waits in a graph beyond its alpha-beta time (the
    skew between ranks arriving at a blocking collective), fitted in a graph, not back to back.
    ``call_sync_wait_s``: seconds the first collective of a call waits, once per call of a graph
    that has collectives, for ranks that entered the call out of step (they left the barrier or
    the host work before the call at different times: on a host with more ranks than cores, a
    rank may wait most of a time slice for a core); the ranks then run in step from one
    collective to the next, and each collective pays ``collective_wait_s``. Fitted together with
    it. ``call_sync_wait_per_compute``: seconds that call also waits per second of its compute
    (ranks drift apart while they compute between collectives: the longer a rank computes, the
    likelier it loses its core for a time slice to another rank or process); 0.0 on GPUs.
    ``call_sync_wait_compute_range_s``: the largest compute of the graphs that wait was fitted on; a call's
    compute beyond it adds no more wait (0.0: no bound, as profiles written before it priced). A scheduler that
    shares cores fairly evens the ranks' progress out over a long compute, so their drift is bounded, and a line
    fitted on graphs of a few milliseconds is not carried to a model of a hundred (on this project's 2-core VM,
    at tp 4, a slope of 0.29 priced a 100 ms forward's wait at 30 ms, where its whole communication measured
    5.5-6.5 ms).
    ``gemm_half_efficiency_dim``: GEMM rate as a function of shape: a GEMM whose smallest dim
    (of m, n, k) is ``d`` runs at ``d / (d + gemm_half_efficiency_dim)`` of the peak (0.0: the
    peak at every shape); :func:`~.compute.gemm_efficiency`.
    ``op_fixed_s``: ``(name, seconds)`` pairs, one per :data:`OP_FIXED_COSTS` entry measured: the
    fixed cost one call of an op of that family pays beyond its roofline and a plain kernel's (library
    kernels that set up a primitive per call: a CPU convolution, about 40 us on a 2-core VM at any size,
    where an add of the same tensor takes 1.5 us; attention per block of queries, plus once per call);
    ``autotp calibrate`` times tiny instances of each in a loop; empty: none (every named profile).
    :meth:`op_fixed_cost_s` reads it.
    ``first_call_s``: ``(kind, seconds)`` pairs, ``"kernel"`` or an :data:`OP_FAMILIES` entry: what the first
    call of a kernel in a call of a graph costs beyond a call of it back to back, once per call of the graph
    for each kernel it runs (:data:`FIRST_CALL_KINDS`; an op of a family measured on its own pays its
    family's figure, every other op the ``"kernel"`` one). A call that starts after the ranks met and waited
    finds the code and state of every kernel cold: on a 2-core VM a CNN's nodes took 0.385 ms back to back and
    0.532 after a common start, the first oneDNN convolution 59 us more, the first call of each other kernel
    3-27 us more, its later calls 0-7. ``autotp calibrate`` times ops after a common start and back to back;
    empty: none (every named profile). :meth:`first_call_cost_s` reads it.
    ``transcendental_element_s``: seconds per element of a transcendental elementwise op (exp,
    tanh, silu, ...) when its arithmetic, not its bytes, bounds it (0.0: never compute bound).
    ``op_element_s``: ``(op name, seconds per element)`` pairs, the ATen op's name (``"tanh"``,
    ``"max_pool2d"``...): the rate of an op whose arithmetic per element, not its bytes, can bound it. A
    transcendental op named here is priced at its own rate, any other at ``transcendental_element_s``; their
    rates differ several times over (on a 2-core VM, one thread: tanh 2.7-3.0 ns per element, erf 1.4, exp 0.9,
    gelu 0.6, silu and sigmoid 0.45), so one figure for all prices GPT-2's tanh-approximated GELU at a third of
    its time. A pooling op's rate is per element of its windows (output elements times window size): max
    pooling compares with a branch per element, about 5 ns on that VM on fresh data, 30 times its bytes' time; a
    pooling op not named here is priced by its bytes. ``autotp calibrate`` measures each; empty: every
    transcendental op at ``transcendental_element_s`` (every named profile).
    ``shared_memory_cold_call_s``: what one shared-memory collective pays beyond its back-to-back
    time when the graph's working set has pushed its slots (and their page-table entries) out of
    the caches since their last use: about the same at every size on a 2-core VM (copying a slot in
    and summing two after a 128 MiB stream: +77 us at 4 KiB, +81 us at 24 KiB, +92 us at 384 KiB),
    so a decode step's small all-reduces cost several times their back-to-back time. Added to every
    shared-memory collective; ``autotp calibrate`` writes the figure at its largest working set
    (DRAM, as ``memory_bandwidth_gbps``), and each graph is priced with the value
    ``shared_memory_cold_curve`` gives at its own working set; 0.0: not measured.
    ``shared_memory_cold_curve``: ``(working_set_bytes, seconds)`` points, ascending in bytes: that
    extra measured after a stream of each working set (``autotp calibrate``: +1 us after 2 MiB,
    +25 us after 32-128 MiB, +52 us after 256 MiB on the same VM). The cost pass sets
    ``shared_memory_cold_call_s`` from it at each graph's working set
    (:func:`~.bandwidth.at_working_set`); without a curve the field is used as it is.

    Working set and small collectives (optional in JSON; absent, they price as before):

    ``memory_bandwidth_curve``: ``(working_set_bytes, bandwidth_gbps)`` points, ascending in
    bytes, measured per rank with every rank busy (``autotp calibrate``): the bandwidth a rank
    gets when the data it touches per call is that large (cache-resident data moves faster than
    DRAM). Empty (GPU profiles): ``memory_bandwidth_gbps`` at every size. The cost pass prices a
    graph at the bandwidth of its own working set (:func:`~.bandwidth.at_working_set`), so
    ``memory_bandwidth_gbps`` is then that graph's figure; a calibrated profile stores its
    largest-working-set (DRAM) figure there.
    ``gemv_bandwidth_curve``: the same for a matrix-vector product (a GEMM with a dim of 1: decode's linears at
    one token), ``(working_set_bytes, bandwidth_gbps)`` of the matrices' bytes over the time BLAS takes to
    multiply them by a vector (``autotp calibrate``): it streams the matrix once, at a pace of its own (on this
    project's VM about half of what a copy moves at DRAM working sets, where a sum, which reads only, reads as
    fast as the copy moves). ``gemv_bandwidth_gbps``: that rate, the figure at the largest
    working set as ``memory_bandwidth_gbps`` is, resolved per graph from the curve the same way; 0.0 (not
    measured, every named profile): a matrix-vector product at ``memory_bandwidth_gbps``, as before.
    ``small_all_reduce``: a :class:`~.collective_forms.CollectiveForm` (or its name), how the runtime runs
    an inference all-reduce; shared memory on gloo profiles calibrated on one x86-64 host, one-shot on
    other gloo profiles, symmetric memory on the named NVSwitch GPU profiles (H100, H200, A100), the
    backend's ring on other NCCL ones. A profile written before the field existed reads one-shot when
    ``host_is_device`` (a CPU profile: gloo) and ring otherwise.
    ``shared_memory_link``: the shared-memory all-reduce's own latency and bandwidth (fitted by
    ``autotp calibrate`` to its row's terms in :data:`~.collective_forms.FORM_TABLE`); required with
    the shared-memory form, None otherwise.
    ``inter_node_send``: one rank's send to another node, alone on the link (``autotp calibrate`` across hosts: the
    line through one-way sends after the link idled, its slope the bandwidth, where it meets the axis the latency,
    or the burst where it meets it below; :func:`~.calibrate.fit_send_link`), what point-to-point sends between
    nodes are priced on (:meth:`send_link`, :func:`~.collectives.send_parts`); None (datasheet profiles, and
    calibrations before it was measured): ``inter_node``. A collective of two nodes sends both ways at once:
    between two emulated hosts one 4 MiB send took 2.0 ms, an all-gather of 2 MiB each way 4.8 ms (docs: Layouts on
    a two-host network).

    ``core_share`` (optional in JSON; 1.0 when absent and for every named profile): the share of
    a core one rank got while every rank of the group computed, in (0, 1]. ``autotp calibrate``
    measures it (about 1/2 for four single-thread ranks on two cores) and has already divided the
    work terms by it: ``peak_tflops``, ``memory_bandwidth_gbps`` and ``memory_bandwidth_curve``
    are the rates a rank gets with the others busy, ``view_op_s``, ``host_dispatch_s``,
    ``graph_launch_s``, ``model_call_s`` and ``transcendental_element_s`` the times. :meth:`alone` undoes it for a
    graph that one rank runs while the others wait (generation without collectives on a CPU group).
    ``core_share_range_s`` (0.0: the share holds for any compute, as profiles written before it priced) and
    ``fair_core_share`` (1.0 when absent): the share holds for a call's compute up to the longest compute of the
    graphs it was measured on, and the compute beyond runs at the fair share (the cores over the ranks' threads),
    :meth:`shared_core_compute_s`. Ranks that start a call together lose cores to each other in time slices, and a
    short call ends before the scheduler has evened their progress out; a long one runs at about the fair share
    (on this project's 2-core VM at tp 4: calibration graphs of up to 6 ms of work at shares of 0.33-0.38, the
    forwards of the two wide models, 20-25 ms of work, at 0.45-0.48 of the fair 0.5).
    ``core_share_call_s``: the wall seconds a call loses once to ranks that start it together on shared cores
    (each waits for a core while the others run their first time slice), fitted with the share as a line over the
    calibration graphs (:func:`~.graph_calibration.fit_core_share`); 0.0 in every named profile and alone.

    Concurrent compute (optional in JSON; absent, every rank is priced as if all computed at once, as before):
    ``ranks_per_machine``: consecutive ranks that share one machine's cores and memory (0: a node's,
    ``devices_per_node``; more when several emulated hosts run on one machine: ``autotp calibrate`` under a
    launcher counts the ranks under one kernel). ``busy_compute_scale``: ``(busy ranks, relative time)`` points,
    a rank's wall time for a fixed compute while that many ranks of its machine compute at once (the others
    waiting), over its time with every rank of the machine busy (the rates of this profile), measured by ``autotp
    calibrate`` (:func:`autotp.calibration.concurrency.measure_busy_scale`). On 4 single-thread ranks on 2 cores
    one or two busy ranks each get a whole core, about 0.5 of the all-busy time; on hosts with a core per rank
    every point is about 1. The mesh search prices a pipeline stage that runs while the other stages wait (one
    request through ``pp`` stages) at its busy ranks' point (:meth:`busy_scale`).
    """

    name: str
    peak_tflops: Mapping[str, float]
    memory_bandwidth_gbps: float
    memory_gib: float
    kernel_floor_s: float
    intra_node: LinkProfile
    inter_node: LinkProfile
    devices_per_node: int
    achievable_fraction_compute: float = 1.0
    achievable_fraction_memory: float = 1.0
    source: str = field(default="", compare=False)
    view_op_s: float = 0.0
    runtime_mode: str = "eager"
    host_dispatch_s: float = 0.0
    host_is_device: bool = False
    graph_launch_s: float = 0.0
    model_call_s: float = 0.0
    collective_wait_s: float = 0.0
    call_sync_wait_s: float = 0.0
    call_sync_wait_per_compute: float = 0.0
    call_sync_wait_compute_range_s: float = 0.0
    core_share_range_s: float = 0.0
    core_share_call_s: float = 0.0
    gemm_half_efficiency_dim: float = 0.0
    transcendental_element_s: float = 0.0
    op_element_s: tuple[tuple[str, float], ...] = ()
    shared_memory_cold_call_s: float = 0.0
    op_fixed_s: tuple[tuple[str, float], ...] = ()
    first_call_s: tuple[tuple[str, float], ...] = ()
    shared_memory_cold_curve: tuple[tuple[float, float], ...] = ()
    memory_bandwidth_curve: tuple[tuple[float, float], ...] = ()
    gemv_bandwidth_gbps: float = 0.0
    gemv_bandwidth_curve: tuple[tuple[float, float], ...] = ()
    small_all_reduce: str = CollectiveForm.RING
    shared_memory_link: LinkProfile | None = None
    inter_node_send: LinkProfile | None = None
    core_share: float = 1.0
    fair_core_share: float = 1.0
    ranks_per_machine: int = 0
    busy_compute_scale: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        owner = f"Hardware({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Hardware.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_tflops, Mapping) or not self.peak_tflops:
            raise ValueError(
                f"{owner}.peak_tflops must be a non-empty mapping from dtype name to TFLOP/s, "
                f"e.g. {{'float32': 66.9, 'bfloat16': 989.4}}; got {self.peak_tflops!r}"
            )
        for dtype_name, tflops in self.peak_tflops.items():
            if not isinstance(dtype_name, str):
                raise ValueError(f"{owner}.peak_tflops keys must be dtype names, got {dtype_name!r}")
            _check_positive_number(owner, f"peak_tflops[{dtype_name!r}]", tflops)
        # Freeze the mapping: a frozen dataclass must not hold a dict someone can still mutate.
        object.__setattr__(self, "peak_tflops", MappingProxyType(dict(self.peak_tflops)))
        _check_positive_number(owner, "memory_bandwidth_gbps", self.memory_bandwidth_gbps)
        _check_positive_number(owner, "memory_gib", self.memory_gib)
        _check_positive_number(owner, "kernel_floor_s", self.kernel_floor_s, allow_zero=True)
        _check_positive_number(owner, "view_op_s", self.view_op_s, allow_zero=True)
        if self.runtime_mode not in RUNTIME_MODES:
            raise ValueError(f"{owner}.runtime_mode must be one of {', '.join(map(repr, RUNTIME_MODES))}, "
                             f"got {self.runtime_mode!r}; e.g. dataclasses.replace(profile, runtime_mode='cuda_graph')")
        if not isinstance(self.host_is_device, bool):
            raise ValueError(f"{owner}.host_is_device must be True or False, got {self.host_is_device!r}")
        for host_field in _HOST_TIME_FIELDS:
            _check_positive_number(owner, host_field, getattr(self, host_field), allow_zero=True)
        if self.small_all_reduce not in SMALL_ALL_REDUCE_ALGORITHMS:
            raise ValueError(f"{owner}.small_all_reduce must be one of "
                             f"{', '.join(map(repr, SMALL_ALL_REDUCE_ALGORITHMS))}, got {self.small_all_reduce!r}")
        if self.shared_memory_link is not None and not isinstance(self.shared_memory_link, LinkProfile):
            raise ValueError(f"{owner}.shared_memory_link must be a LinkProfile or None")
        if self.inter_node_send is not None and not isinstance(self.inter_node_send, LinkProfile):
            raise ValueError(f"{owner}.inter_node_send must be a LinkProfile or None")
        form = FORM_TABLE[CollectiveForm.from_name(self.small_all_reduce)]
        object.__setattr__(self, "small_all_reduce", form.form)  # typed, whether given as the form or its name
        if form.link_field is not None and getattr(self, form.link_field) is None:
            raise ValueError(f"{owner}.small_all_reduce='{form.form}' needs {form.link_field} (its latency and "
                             f"bandwidth, measured by `autotp calibrate`); or use small_all_reduce='{form.across_nodes}'")
        object.__setattr__(self, "op_fixed_s", _checked_named_seconds(owner, "op_fixed_s", self.op_fixed_s,
                                                                      OP_FIXED_COSTS))
        object.__setattr__(self, "first_call_s", _checked_named_seconds(owner, "first_call_s", self.first_call_s,
                                                                        FIRST_CALL_KINDS))
        object.__setattr__(self, "op_element_s", _checked_named_seconds(
            owner, "op_element_s", self.op_element_s))
        object.__setattr__(self, "memory_bandwidth_curve", _checked_curve(owner, self.memory_bandwidth_curve))
        _check_positive_number(owner, "gemv_bandwidth_gbps", self.gemv_bandwidth_gbps, allow_zero=True)
        object.__setattr__(self, "gemv_bandwidth_curve",
                           _checked_curve(owner, self.gemv_bandwidth_curve, "gemv_bandwidth_curve"))
        object.__setattr__(self, "shared_memory_cold_curve", _checked_curve(
            owner, self.shared_memory_cold_curve, "shared_memory_cold_curve", "seconds", allow_zero=True))
        for link_field in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, link_field), LinkProfile):
                raise ValueError(f"{owner}.{link_field} must be a LinkProfile")
        if (
            isinstance(self.devices_per_node, bool)
            or not isinstance(self.devices_per_node, int)
            or self.devices_per_node < 1
        ):
            raise ValueError(f"{owner}.devices_per_node must be an int >= 1, got {self.devices_per_node!r}")
        for fraction_field in ("achievable_fraction_compute", "achievable_fraction_memory", "core_share",
                               "fair_core_share"):
            value = getattr(self, fraction_field)
            _check_positive_number(owner, fraction_field, value)
            if value > 1:
                raise ValueError(f"{owner}.{fraction_field} must be in (0, 1], got {value!r}")
        if self.core_share > self.fair_core_share:
            raise ValueError(f"{owner}.core_share ({self.core_share!r}) cannot exceed fair_core_share "
                             f"({self.fair_core_share!r}): no rank gets more than the fair share while every rank "
                             "computes")
        if isinstance(self.ranks_per_machine, bool) or not isinstance(self.ranks_per_machine, int) \
                or self.ranks_per_machine < 0:
            raise ValueError(f"{owner}.ranks_per_machine must be an int >= 0 (0: one machine per node), got "
                             f"{self.ranks_per_machine!r}")
        object.__setattr__(self, "busy_compute_scale", _checked_busy_scale(owner, self.busy_compute_scale))

    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                tuple(sorted(self.peak_tflops.items())),
                self.memory_bandwidth_gbps,
                self.memory_gib,
                self.kernel_floor_s,
                self.view_op_s,
                self.intra_node,
                self.inter_node,
                self.devices_per_node,
                self.achievable_fraction_compute,
                self.achievable_fraction_memory,
                self.runtime_mode,
                self.host_is_device,
                *(getattr(self, host_field) for host_field in _HOST_TIME_FIELDS),
                self.op_fixed_s,
                self.op_element_s,
                self.first_call_s,
                self.memory_bandwidth_curve,
                self.gemv_bandwidth_gbps,
                self.gemv_bandwidth_curve,
                self.shared_memory_cold_curve,
                self.small_all_reduce,
                self.shared_memory_link,
                self.inter_node_send,
                self.core_share,
                self.fair_core_share,
                self.ranks_per_machine,
                self.busy_compute_scale,
            )
        )

    def alone(self) -> Hardware:
        """This profile as one rank sees it while the other ranks of its group wait: the work terms at
        a whole core (each rate divided, each time multiplied by ``core_share``; see the class
        docstring), without the share's range and its loss per call (a rank alone takes no turns). The profile
        itself when there is nothing to undo. Links and the per-collective wait are unchanged (a graph run alone
        issues no collective)."""
        share = self.core_share
        if share == 1.0 and not self.core_share_range_s and not self.core_share_call_s:
            return self
        return replace(
            self,
            name=f"{self.name}-alone",
            peak_tflops={dtype: tflops / share for dtype, tflops in self.peak_tflops.items()},
            memory_bandwidth_gbps=self.memory_bandwidth_gbps / share,
            memory_bandwidth_curve=tuple((size, gbps / share) for size, gbps in self.memory_bandwidth_curve),
            gemv_bandwidth_gbps=self.gemv_bandwidth_gbps / share,
            gemv_bandwidth_curve=tuple((size, gbps / share) for size, gbps in self.gemv_bandwidth_curve),
            view_op_s=self.view_op_s * share,
            op_fixed_s=tuple((family, seconds * share) for family, seconds in self.op_fixed_s),
            first_call_s=tuple((kind, seconds * share) for kind, seconds in self.first_call_s),
            host_dispatch_s=self.host_dispatch_s * share,
            graph_launch_s=self.graph_launch_s * share,
            model_call_s=self.model_call_s * share,
            transcendental_element_s=self.transcendental_element_s * share,
            op_element_s=tuple((op, seconds * share) for op, seconds in self.op_element_s),
            core_share=1.0,
            core_share_range_s=0.0,
            core_share_call_s=0.0,
            fair_core_share=1.0,
            busy_compute_scale=(),
            source=f"{self.source}; work terms at a whole core (one rank alone; measured share {share:.2f})",
        )

    def shared_core_compute_s(self, compute_s: float) -> float:
        """Wall seconds of a call whose compute, priced at ``core_share``, is ``compute_s``: as priced up to
        ``core_share_range_s``, and the compute beyond at ``fair_core_share`` (class docstring). ``compute_s``
        itself without a range."""
        return shared_core_compute_s(compute_s, self.core_share, self.core_share_range_s, self.fair_core_share)

    def machine_ranks(self) -> int:
        """Consecutive ranks that share one machine's cores: ``ranks_per_machine``, else a node's."""
        return self.ranks_per_machine or self.devices_per_node

    def busy_scale(self, busy_ranks: int) -> float:
        """A rank's compute time while ``busy_ranks`` ranks of its machine compute at once, relative to the
        profile's rates (those with every rank of the machine busy): ``busy_compute_scale`` interpolated
        linearly between its points, its first and last value outside them; 1.0 when not measured."""
        points = self.busy_compute_scale
        if not points:
            return 1.0
        if busy_ranks <= points[0][0]:
            return points[0][1]
        for (k0, s0), (k1, s1) in zip(points, points[1:]):
            if busy_ranks <= k1:
                return s0 + (s1 - s0) * (busy_ranks - k0) / (k1 - k0)
        return points[-1][1]

    def element_rate_s(self, op_name: str | None = None, default: float | None = None) -> float:
        """Seconds per element of the op ``op_name`` (``op_element_s``); for an op not measured by name (and for
        ``None``), ``default``, or ``transcendental_element_s`` when no default is given."""
        return next((seconds for name, seconds in self.op_element_s if name == op_name),
                    self.transcendental_element_s if default is None else default)

    def op_fixed_cost_s(self, name: str) -> float:
        """The seconds of the fixed cost ``name`` (an :data:`OP_FIXED_COSTS` entry; ``op_fixed_s``, 0.0 when not
        measured)."""
        return next((seconds for measured, seconds in self.op_fixed_s if measured == name), 0.0)

    def fixed_costs_s(self, counts: Iterable[tuple[str, float]]) -> float:
        """The seconds of the fixed costs one call pays, from ``(name, times)`` pairs
        (:func:`~.compute.fixed_costs`)."""
        return sum(times * self.op_fixed_cost_s(name) for name, times in counts)

    def first_call_cost_s(self, family: str | None) -> float:
        """What the first call of a kernel of ``family`` (None: of no family) in a call of a graph costs beyond a
        call back to back (``first_call_s``: the family's figure, else the ``"kernel"`` one; 0.0 when not
        measured)."""
        table = dict(self.first_call_s)
        return table.get(family, table.get("kernel", 0.0)) if family is not None else table.get("kernel", 0.0)

    def link(self, *, spans_nodes: bool) -> LinkProfile:
        """The link a collective uses: ``inter_node`` when its group spans nodes."""
        return self.inter_node if spans_nodes else self.intra_node

    def send_link(self, *, spans_nodes: bool) -> LinkProfile:
        """The link a point-to-point send uses: ``inter_node_send`` (else ``inter_node``) between nodes,
        ``intra_node`` inside one."""
        if not spans_nodes:
            return self.intra_node
        return self.inter_node_send if self.inter_node_send is not None else self.inter_node

    @property
    def symmetric_memory_link(self) -> LinkProfile:
        """``intra_node`` as the one-shot all-reduce in symmetric memory uses it (``small_all_reduce=
        CollectiveForm.SYMMETRIC_MEMORY``): the same latency per signal and bandwidth per direction, and one kernel
        launch (``kernel_floor_s``) per call in place of NCCL's base latency."""
        return replace(self.intra_node, name=f"{self.intra_node.name}-symmetric-memory",
                       base_latency_s=self.kernel_floor_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": HARDWARE_JSON_VERSION,
            "name": self.name,
            "peak_tflops": dict(self.peak_tflops),
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "memory_gib": self.memory_gib,
            "kernel_floor_s": self.kernel_floor_s,
            "view_op_s": self.view_op_s,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "devices_per_node": self.devices_per_node,
            "achievable_fraction_compute": self.achievable_fraction_compute,
            "achievable_fraction_memory": self.achievable_fraction_memory,
            "runtime_mode": self.runtime_mode,
            "host_is_device": self.host_is_device,
            **{host_field: getattr(self, host_field) for host_field in _HOST_TIME_FIELDS},
            **({"op_fixed_s": dict(self.op_fixed_s)} if self.op_fixed_s else {}),
            **({"first_call_s": dict(self.first_call_s)} if self.first_call_s else {}),
            **({"op_element_s": dict(self.op_element_s)}
               if self.op_element_s else {}),
            "memory_bandwidth_curve": [{"working_set_bytes": size, "bandwidth_gbps": gbps}
                                       for size, gbps in self.memory_bandwidth_curve],
            **({"gemv_bandwidth_gbps": self.gemv_bandwidth_gbps,
                "gemv_bandwidth_curve": [{"working_set_bytes": size, "bandwidth_gbps": gbps}
                                         for size, gbps in self.gemv_bandwidth_curve]}
               if self.gemv_bandwidth_gbps or self.gemv_bandwidth_curve else {}),
            "small_all_reduce": self.small_all_reduce,
            **({"shared_memory_link": self.shared_memory_link.to_dict()} if self.shared_memory_link else {}),
            **({"inter_node_send": self.inter_node_send.to_dict()} if self.inter_node_send else {}),
            **({"shared_memory_cold_curve": [{"working_set_bytes": size, "seconds": seconds}
                                             for size, seconds in self.shared_memory_cold_curve]}
               if self.shared_memory_cold_curve else {}),
            "core_share": self.core_share,
            "fair_core_share": self.fair_core_share,
            **({"ranks_per_machine": self.ranks_per_machine} if self.ranks_per_machine else {}),
            **({"busy_compute_scale": [{"busy_ranks": busy, "relative_time": scale}
                                       for busy, scale in self.busy_compute_scale]}
               if self.busy_compute_scale else {}),
            "source": self.source,
        }

    def to_json(self) -> str:
        """JSON text of this profile (with a ``version`` field); :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hardware:
        """Build a profile from the dict form of :meth:`to_dict`; ValueError names a bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a hardware profile must be a JSON object, got {type(data).__name__}")
        version = data.get("version", HARDWARE_JSON_VERSION)
        if version != HARDWARE_JSON_VERSION:
            raise ValueError(
                f"field 'version' is {version!r}; this autotp reads hardware profiles of version "
                f"{HARDWARE_JSON_VERSION}"
            )
        required = (
            "name",
            "peak_tflops",
            "memory_bandwidth_gbps",
            "memory_gib",
            "kernel_floor_s",
            "intra_node",
            "inter_node",
            "devices_per_node",
        )
        optional = ("version", "view_op_s", "achievable_fraction_compute", "achievable_fraction_memory", "source",
                    "runtime_mode", "host_is_device", *_HOST_TIME_FIELDS, "op_fixed_s", "op_element_s", "first_call_s",
                    "memory_bandwidth_curve", "gemv_bandwidth_gbps", "gemv_bandwidth_curve",
                    "small_all_reduce", "shared_memory_link", "inter_node_send", "shared_memory_cold_curve", "core_share",
                    "fair_core_share", "ranks_per_machine", "busy_compute_scale")
        _check_known_fields(data, required + optional + _RETIRED_FIELDS, "the hardware profile")
        retired = {field: data[field] for field in _RETIRED_FIELDS if data.get(field)}
        if retired:
            fields = ", ".join(f"{field!r} = {value}" for field, value in retired.items())
            raise ValueError(
                f"field {fields}: an extra per kernel in a graph, which profiles of earlier releases of `autotp "
                f"calibrate` priced and this release does not (its calibration scales every single-op price by one "
                f"factor fitted on rank-local graphs); run `autotp calibrate` again to measure this machine")
        for key in required:
            if key not in data:
                raise ValueError(f"missing field {key!r} (a profile needs: {', '.join(required)})")
        if not isinstance(data["peak_tflops"], Mapping):
            raise ValueError(
                f"field 'peak_tflops' must be an object from dtype name to TFLOP/s, "
                f"got {type(data['peak_tflops']).__name__}"
            )
        intra_node = LinkProfile.from_dict(data["intra_node"], where="intra_node")
        inter_node = LinkProfile.from_dict(data["inter_node"], where="inter_node")
        shared_memory_link = (LinkProfile.from_dict(data["shared_memory_link"], where="shared_memory_link")
                              if data.get("shared_memory_link") is not None else None)
        inter_node_send = (LinkProfile.from_dict(data["inter_node_send"], where="inter_node_send")
                           if data.get("inter_node_send") is not None else None)
        try:
            return cls(
                name=data["name"],
                peak_tflops=dict(data["peak_tflops"]),
                memory_bandwidth_gbps=data["memory_bandwidth_gbps"],
                memory_gib=data["memory_gib"],
                kernel_floor_s=data["kernel_floor_s"],
                view_op_s=data.get("view_op_s", 0.0),
                intra_node=intra_node,
                inter_node=inter_node,
                devices_per_node=data["devices_per_node"],
                achievable_fraction_compute=data.get("achievable_fraction_compute", 1.0),
                achievable_fraction_memory=data.get("achievable_fraction_memory", 1.0),
                source=data.get("source", ""),
                # absent in profiles written before the host terms existed: their defaults
                runtime_mode=data.get("runtime_mode", "eager"),
                host_is_device=data.get("host_is_device", False),
                **{host_field: data.get(host_field, 0.0) for host_field in _HOST_TIME_FIELDS},
                op_fixed_s=_named_seconds_from_json("op_fixed_s", data.get("op_fixed_s", {})),
                first_call_s=_named_seconds_from_json("first_call_s", data.get("first_call_s", {})),
                op_element_s=_named_seconds_from_json(
                    "op_element_s", data.get("op_element_s", {})),
                # absent in profiles written before the working-set curve and the one-shot pricing
                memory_bandwidth_curve=_curve_from_json(data.get("memory_bandwidth_curve", [])),
                # absent in profiles written before it was measured: matrix-vector products at the copy's rate
                gemv_bandwidth_gbps=data.get("gemv_bandwidth_gbps", 0.0),
                gemv_bandwidth_curve=_curve_from_json(data.get("gemv_bandwidth_curve", []), "gemv_bandwidth_curve"),
                small_all_reduce=data.get("small_all_reduce", CollectiveForm.ONE_SHOT
                                          if data.get("host_is_device", False) is True else CollectiveForm.RING),
                shared_memory_link=shared_memory_link,
                inter_node_send=inter_node_send,
                shared_memory_cold_curve=_curve_from_json(data.get("shared_memory_cold_curve", []),
                                                          "shared_memory_cold_curve", "seconds"),
                # absent in profiles written before it was recorded: work terms taken as measured alone
                core_share=data.get("core_share", 1.0),
                fair_core_share=data.get("fair_core_share", 1.0),
                # absent in profiles written before they were measured: every rank priced as if all computed
                ranks_per_machine=data.get("ranks_per_machine", 0),
                busy_compute_scale=_busy_scale_from_json(data.get("busy_compute_scale", [])),
            )
        except ValueError as error:
            raise ValueError(f"bad field: {error}") from None

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        """Inverse of :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON: {error}") from None
        return cls.from_dict(data)


# --------------------------------------------------------------------------------------------
# Links. Latencies: NCCL src/graph/tuning.cc (see module docstring), LL protocol, ring.
# --------------------------------------------------------------------------------------------

_NCCL_BASE_LATENCY_S = 6.6 * _US  # baseLat[Ring][LL], us -> s; NCCL src/graph/tuning.cc

NVLINK4_NVSWITCH = LinkProfile(
    name="nvlink4-nvswitch",
    # 900 GB/s bidirectional per H100/H200 SXM GPU (18 NVLink4 links x 50 GB/s) = 450 GB/s per
    # direction. NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ ;
    # NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/
    bandwidth_gbps=450.0,
    latency_s=0.6 * _US,  # hwLat[NVLINK][Ring][LL]; NCCL src/graph/tuning.cc
    base_latency_s=_NCCL_BASE_LATENCY_S,
)

NVLINK3_NVSWITCH = LinkProfile(
    name="nvlink3-nvswitch",
    # 600 GB/s bidirectional per A100 SXM GPU (12 NVLink3 links x 50 GB/s) = 300 GB/s per direction.
    # NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/
    # pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    bandwidth_gbps=300.0,
    latency_s=0.6 * _US,  # hwLat[NVLINK][Ring][LL]; NCCL src/graph/tuning.cc
    base_latency_s=_NCCL_BASE_LATENCY_S,
)

PCIE_GEN4_X16 = LinkProfile(
    name="pcie-gen4-x16",
    # "PCIe Gen4 x16: 64GB/s bidirectional" = 32 GB/s per direction. NVIDIA L40S datasheet,
    # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 (the L40S has no NVLink).
    bandwidth_gbps=32.0,
    latency_s=1.0 * _US,  # hwLat[PCI][Ring][LL]; NCCL src/graph/tuning.cc
    base_latency_s=_NCCL_BASE_LATENCY_S,
)

INFINIBAND_NDR = LinkProfile(
    name="infiniband-ndr-400",
    # 400 Gb/s per port = 50 GB/s per direction, one ConnectX-7 NDR port per GPU as in DGX H100
    # (8 x 400 Gb/s compute fabric). NVIDIA DGX H100 user guide, hardware overview,
    # https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
    bandwidth_gbps=50.0,
    latency_s=2.7 * _US,  # hwLat[NET][Ring][LL]; NCCL src/graph/tuning.cc
    base_latency_s=_NCCL_BASE_LATENCY_S,
)

INFINIBAND_HDR = LinkProfile(
    name="infiniband-hdr-200",
    # 200 Gb/s per port = 25 GB/s per direction, one ConnectX-6 HDR port per GPU as in DGX A100
    # (8 x 200 Gb/s compute fabric). NVIDIA DGX A100 user guide, hardware overview,
    # https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html
    bandwidth_gbps=25.0,
    latency_s=2.7 * _US,  # hwLat[NET][Ring][LL]; NCCL src/graph/tuning.cc
    base_latency_s=_NCCL_BASE_LATENCY_S,
)

# Floor of one GPU kernel: launching and scheduling a kernel costs a few microseconds even when it
# does no work (NVIDIA Technical Blog, "Getting Started with CUDA Graphs",
# https://developer.nvidia.com/blog/cuda-graphs/ , measures a few us per short kernel launched
# back to back). 4 us, rounded; a calibrated profile replaces it with a measured value.
_GPU_KERNEL_FLOOR_S = 4.0 * _US

# Host time of one ATen node run eagerly from an FX graph on a GPU: the CUDA driver and runtime
# spend about 4-6 us of host time per kernel launch (measured per cudaLaunchKernel in "pegainfer
# (3): From Launch Overhead to CUDA Graph", https://susun-blog.com/blog/pegainfer-3-cuda-graph ;
# NVIDIA's "Getting Started with CUDA Graphs", https://developer.nvidia.com/blog/cuda-graphs/ ,
# shows the same few-us launch cost per short kernel), and before it the graph's Python call of
# the op and PyTorch's dispatcher run (a few us more: `autotp calibrate` measures 6-20 us per op
# for that path on this project's CPU, where no launch follows). 10 us in all, rounded; the host
# runs ahead of the GPU, so a node takes the longer of this and its kernel (host_is_device=False).
_GPU_EAGER_DISPATCH_S = 10.0 * _US

# Host time of one call of a rank-local graph. A captured CUDA graph replays with one
# cudaGraphLaunch, whose host cost for a straight-line graph does not grow with its node count
# from CUDA 12.6 on (NVIDIA Technical Blog, "Constant Time Launch for Straight-Line CUDA Graphs
# and Other Performance Enhancements", https://developer.nvidia.com/blog/constant-time-launch-for-
# straight-line-graphs-and-other-performance-enhancements/ ) and is a few microseconds; with
# PyTorch's Python call of the module and of CUDAGraph.replay(), 10 us, rounded.
_GPU_GRAPH_LAUNCH_S = 10.0 * _US

# On one NVSwitch node autotp's runtime sums an all-reduce of at most 256 KiB with PyTorch's one-shot kernel
# on symmetric memory (autotp/runtime/collectives/symmetric_memory.py; priced in cost_model/collectives.py), as vLLM's and
# SGLang's custom all-reduce do for small messages; larger ones and groups across nodes keep NCCL.
_GPU_SMALL_ALL_REDUCE = CollectiveForm.SYMMETRIC_MEMORY

# GPU profiles price a plan as replayed from a CUDA graph, as serving engines run decode (vLLM
# captures CUDA graphs of its decode steps by default, https://docs.vllm.ai/en/latest/design/cuda_graphs/ ):
# each node then costs its kernel, so the planner weighs the device work a split divides. The
# eager terms stay in the profile: dataclasses.replace(profile, runtime_mode="eager") prices the
# op-by-op runtime, and autotp.estimate(plan) shows the host time of both.
_GPU_RUNTIME_MODE = "cuda_graph"

# Hopper (H100 SXM5 / H200 SXM5, same GH100 compute) dense peaks, TFLOP/s. NVIDIA H100 Tensor
# Core GPU Architecture whitepaper, Table 3 (H100 SXM5), https://resources.nvidia.com/
# en-us-tensor-core/gtc22-whitepaper-hopper ; the datasheet lists BF16/FP16 1979 TFLOPS *with*
# 2:4 sparsity, i.e. 989.4 dense.
_HOPPER_SXM_PEAK_TFLOPS = {
    "float64": 66.9,  # FP64 Tensor Core
    "float32": 66.9,  # FP32 (non-tensor; TF32 is opt-in in PyTorch)
    "bfloat16": 989.4,  # BF16 Tensor Core, dense
    "float16": 989.4,  # FP16 Tensor Core, dense
}

_H100_SOURCE = (
    "NVIDIA H100 datasheet and Hopper whitepaper (peaks, 3.35 TB/s HBM3, 80 GB, NVLink4 900 GB/s "
    "bidirectional); NCCL src/graph/tuning.cc (link latencies); DGX H100 user guide (NDR IB)"
)

H100_SXM = Hardware(
    name="h100-sxm",
    peak_tflops=_HOPPER_SXM_PEAK_TFLOPS,
    memory_bandwidth_gbps=3350.0,  # HBM3 3.35 TB/s; NVIDIA H100 datasheet (SXM)
    memory_gib=80.0,  # 80 GB HBM3; NVIDIA H100 datasheet (SXM)
    kernel_floor_s=_GPU_KERNEL_FLOOR_S,
    host_dispatch_s=_GPU_EAGER_DISPATCH_S,
    graph_launch_s=_GPU_GRAPH_LAUNCH_S,
    runtime_mode=_GPU_RUNTIME_MODE,
    small_all_reduce=_GPU_SMALL_ALL_REDUCE,
    intra_node=NVLINK4_NVSWITCH,
    inter_node=INFINIBAND_NDR,
    devices_per_node=8,  # HGX/DGX H100: 8 GPUs on one NVSwitch fabric; DGX H100 user guide
    source=_H100_SOURCE,
)

# A cluster of DGX H100 nodes: 8 H100 SXM per node on NVSwitch (NVLink4, 450 GB/s per direction per
# GPU), nodes joined by a rail-optimised NDR InfiniBand fabric: 8 ConnectX-7 ports of 400 Gb/s per
# node, one per GPU = 50 GB/s per direction per GPU (DGX H100 user guide; NVIDIA DGX SuperPOD
# reference architecture, DGX H100, "compute fabric": https://docs.nvidia.com/dgx-superpod/
# reference-architecture-scalable-infrastructure-h100/latest/network-fabrics.html). A group of more
# than 8 consecutive ranks crosses nodes: its collectives run on `inter_node` (or hierarchically,
# see cost_model/collectives.py), 9x slower per byte than NVLink. The device and link figures are
# those of h100-sxm (whose inter_node is the same fabric); this name says the plan was costed for
# several nodes.
H100_MULTINODE = Hardware(
    name="h100-multinode",
    peak_tflops=_HOPPER_SXM_PEAK_TFLOPS,
    memory_bandwidth_gbps=3350.0,  # HBM3 3.35 TB/s; NVIDIA H100 datasheet (SXM)
    memory_gib=80.0,  # 80 GB HBM3; NVIDIA H100 datasheet (SXM)
    kernel_floor_s=_GPU_KERNEL_FLOOR_S,
    host_dispatch_s=_GPU_EAGER_DISPATCH_S,
    graph_launch_s=_GPU_GRAPH_LAUNCH_S,
    runtime_mode=_GPU_RUNTIME_MODE,
    small_all_reduce=_GPU_SMALL_ALL_REDUCE,
    intra_node=NVLINK4_NVSWITCH,
    inter_node=INFINIBAND_NDR,
    devices_per_node=8,  # DGX H100 nodes, 8 GPUs each; DGX H100 user guide
    source=_H100_SOURCE,
)

H200 = Hardware(
    name="h200",
    peak_tflops=_HOPPER_SXM_PEAK_TFLOPS,  # same GH100 compute as H100 SXM; NVIDIA H200 datasheet
    memory_bandwidth_gbps=4800.0,  # HBM3e 4.8 TB/s; NVIDIA H200 datasheet (SXM)
    memory_gib=141.0,  # 141 GB HBM3e; NVIDIA H200 datasheet (SXM)
    kernel_floor_s=_GPU_KERNEL_FLOOR_S,
    host_dispatch_s=_GPU_EAGER_DISPATCH_S,
    graph_launch_s=_GPU_GRAPH_LAUNCH_S,
    runtime_mode=_GPU_RUNTIME_MODE,
    small_all_reduce=_GPU_SMALL_ALL_REDUCE,
    intra_node=NVLINK4_NVSWITCH,
    inter_node=INFINIBAND_NDR,
    devices_per_node=8,  # HGX H200: 8 GPUs on one NVSwitch fabric
    source=(
        "NVIDIA H200 datasheet (4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s bidirectional), Hopper "
        "whitepaper (peaks); NCCL src/graph/tuning.cc (link latencies)"
    ),
)

A100_SXM = Hardware(
    name="a100-sxm",
    # Dense peaks, TFLOP/s; NVIDIA A100 datasheet (SXM, 80 GB): FP64 Tensor Core 19.5,
    # FP32 19.5, BF16/FP16 Tensor Core 312 (624 with sparsity).
    peak_tflops={"float64": 19.5, "float32": 19.5, "bfloat16": 312.0, "float16": 312.0},
    memory_bandwidth_gbps=2039.0,  # HBM2e 2,039 GB/s; NVIDIA A100 datasheet (80 GB SXM)
    memory_gib=80.0,  # 80 GB HBM2e; NVIDIA A100 datasheet
    kernel_floor_s=_GPU_KERNEL_FLOOR_S,
    host_dispatch_s=_GPU_EAGER_DISPATCH_S,
    graph_launch_s=_GPU_GRAPH_LAUNCH_S,
    runtime_mode=_GPU_RUNTIME_MODE,
    small_all_reduce=_GPU_SMALL_ALL_REDUCE,
    intra_node=NVLINK3_NVSWITCH,
    inter_node=INFINIBAND_HDR,
    devices_per_node=8,  # HGX/DGX A100: 8 GPUs on one NVSwitch fabric; DGX A100 user guide
    source=(
        "NVIDIA A100 datasheet (peaks, 2,039 GB/s HBM2e, 80 GB, NVLink3 600 GB/s bidirectional); "
        "NCCL src/graph/tuning.cc (link latencies); DGX A100 user guide (HDR IB)"
    ),
)

# A cluster of DGX A100 nodes: 8 A100 SXM 80 GB per node on NVSwitch (NVLink3, 300 GB/s per
# direction per GPU), nodes joined by HDR InfiniBand: 8 ConnectX-6 ports of 200 Gb/s per node,
# one per GPU = 25 GB/s per direction per GPU (DGX A100 user guide; NVIDIA DGX SuperPOD reference
# architecture, DGX A100: https://docs.nvidia.com/dgx-superpod-reference-architecture-dgx-a100.pdf).
A100_MULTINODE = replace(
    A100_SXM,  # the same devices, links and node size; named for the cluster it describes
    name="a100-multinode",
    source=(
        "NVIDIA A100 datasheet (peaks, HBM2e, NVLink3); DGX A100 user guide and DGX SuperPOD "
        "reference architecture (8 x 200 Gb/s HDR InfiniBand per node, one port per GPU); "
        "NCCL src/graph/tuning.cc (link latencies)"
    ),
)

PCIE_GPU = Hardware(
    name="pcie-gpu",
    # NVIDIA L40S, dense peaks, TFLOP/s; L40S datasheet: FP32 91.6, BF16/FP16 Tensor Core 362.05
    # (733 with sparsity). The datasheet gives no FP64 figure; compute capability 8.9 (Ada) does
    # 2 FP64 vs 128 FP32 results per clock per SM (CUDA C++ Programming Guide, "Throughput of
    # Native Arithmetic Instructions"), so FP64 = 91.6 / 64.
    peak_tflops={"float64": 91.6 / 64, "float32": 91.6, "bfloat16": 362.05, "float16": 362.05},
    memory_bandwidth_gbps=864.0,  # GDDR6 864 GB/s; NVIDIA L40S datasheet
    memory_gib=48.0,  # 48 GB GDDR6; NVIDIA L40S datasheet
    kernel_floor_s=_GPU_KERNEL_FLOOR_S,
    host_dispatch_s=_GPU_EAGER_DISPATCH_S,
    graph_launch_s=_GPU_GRAPH_LAUNCH_S,
    runtime_mode=_GPU_RUNTIME_MODE,
    intra_node=PCIE_GEN4_X16,
    inter_node=INFINIBAND_NDR,
    devices_per_node=8,  # a common 8-GPU PCIe server (e.g. NVIDIA-Certified L40S OVX systems)
    source=(
        "NVIDIA L40S datasheet (peaks, 864 GB/s GDDR6, 48 GB, PCIe Gen4 x16 64 GB/s bidirectional, "
        "no NVLink); NCCL src/graph/tuning.cc (link latencies)"
    ),
)

# A generic CPU host running gloo over loopback. PLACEHOLDERS, not measurements: plausible
# round numbers for a 16-core AVX2/AVX-512 server, to be replaced by `autotp calibrate`, which
# measures matmul throughput, memory bandwidth and gloo alpha/beta on the machine at hand.
CPU_GLOO = Hardware(
    name="cpu-gloo",
    # placeholder: 16 cores x ~3 GHz x 32 FP32 FLOP/cycle (2 FMA units x 8 lanes x 2) ~ 1.5 TFLOP/s,
    # derated to 1.0; bf16/fp16 matmuls on CPUs without AMX run slower than fp32.
    peak_tflops={"float64": 0.5, "float32": 1.0, "bfloat16": 0.5, "float16": 0.25},
    memory_bandwidth_gbps=50.0,  # placeholder: a few DDR4/DDR5 channels
    memory_gib=64.0,  # placeholder
    kernel_floor_s=10.0 * _US,  # placeholder: PyTorch eager dispatch of one op on CPU
    intra_node=LinkProfile(
        name="gloo-loopback",
        bandwidth_gbps=5.0,  # placeholder: gloo TCP over loopback
        latency_s=30.0 * _US,  # placeholder: one gloo message round
    ),
    inter_node=LinkProfile(
        name="gloo-ethernet-10g",
        bandwidth_gbps=1.25,  # placeholder: 10 GbE = 1.25 GB/s
        latency_s=50.0 * _US,  # placeholder: TCP over Ethernet
    ),
    devices_per_node=8,  # placeholder: processes on one host
    host_is_device=True,  # on a CPU the host runs the kernels: dispatch and kernel add up
    small_all_reduce=CollectiveForm.ONE_SHOT,  # gloo: autotp's inference runtime sums small all-reduces in one round
    source="placeholders, not measurements; run `autotp calibrate` to measure this machine",
)

KNOWN_HARDWARE: Mapping[str, Hardware] = MappingProxyType(
    {hw.name: hw for hw in (H100_SXM, H200, A100_SXM, PCIE_GPU, H100_MULTINODE, A100_MULTINODE, CPU_GLOO)}
)


def load_hardware_json(path: str | os.PathLike[str]) -> Hardware:
    """Read a profile written by :meth:`Hardware.to_json` (or by ``autotp calibrate``)."""
    file_path = Path(path)
    try:
        text = file_path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read hardware profile {str(file_path)!r}: {error}") from None
    try:
        return Hardware.from_json(text)
    except ValueError as error:
        raise ValueError(f"hardware profile {str(file_path)!r}: {error}") from None


def get_hardware(spec: str | Hardware | os.PathLike[str]) -> Hardware:
    """Resolve ``hardware=`` arguments: a known name, a :class:`Hardware`, or a JSON file path.

    Raises ValueError for an unknown name (listing the known ones) and for a JSON file that is
    corrupt or lacks a field (naming the file and the field).
    """
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, str) and spec in KNOWN_HARDWARE:
        return KNOWN_HARDWARE[spec]
    if isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and (spec.endswith(".json") or os.path.isfile(spec))
    ):
        return load_hardware_json(spec)
    if isinstance(spec, str):
        raise ValueError(
            f"unknown hardware {spec!r}; known profiles: {', '.join(sorted(KNOWN_HARDWARE))}; "
            f"or pass a Hardware object or the path of a .json profile (from Hardware.to_json() "
            f"or `autotp calibrate`)"
        )
    raise TypeError(
        f"hardware must be a profile name, a Hardware, or a path to a .json profile; "
        f"got {type(spec).__name__}"
    )
