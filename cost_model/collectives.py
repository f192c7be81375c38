"""Time of a collective from the alpha-beta model of its algorithm.

One entry point, :func:`collective_time_s`. With ``p`` ranks in the group, ``n`` the bytes of the
FULL (unsharded) tensor, ``alpha`` the link's per-step latency (``LinkProfile.latency_s``) and
``B`` its per-direction bus bandwidth in bytes/s (``LinkProfile.bandwidth_gbps * 1e9``):

=============== ========= ============================================= ==============================
kind            algorithm time (before the per-call base latency)      source
=============== ========= ============================================= ==============================
all_reduce      ring      2(p-1)·alpha + 2(p-1)/p · n/B                 [PY09], [T05] (RS + AG); [NT]
all_reduce      tree      2·ceil(log2 p)·alpha + 2·n/B                  [SST09]; [NCCL]
all_gather      ring      (p-1)·alpha + (p-1)/p · n/B                   [T05] ring; [NT]
all_gather      tree      ceil(log2 p)·alpha + (p-1)/p · n/B            [T05] recursive doubling
reduce_scatter  ring      (p-1)·alpha + (p-1)/p · n/B                   [T05] ring / pairwise; [NT]
reduce_scatter  tree      ceil(log2 p)·alpha + (p-1)/p · n/B            [T05] recursive halving
all_to_all      ring      (p-1)·alpha + (p-1)/p · n/B                   [T05] pairwise exchange; [NT]
all_to_all      tree      ceil(log2 p)·alpha + ceil(log2 p)/2 · n/B     [T05] Bruck
broadcast       ring      (p-1)·alpha + n/B                             [NT] pipelined chain
broadcast       tree      ceil(log2 p)·(alpha + n/B)                    [T05] binomial tree
=============== ========= ============================================= ==============================

``n`` is the all-reduce buffer, the all-gather output, the reduce-scatter input, the all-to-all
data each rank holds (sends and receives), the broadcast buffer. The reduction arithmetic
(Thakur's gamma term) is not modelled: it is memory bound and overlaps the transfers. gloo (a CPU
profile) runs its reduce-scatter as an all-reduce of the whole ``n`` (:data:`GLOO_RUNS_AS`, measured), so a
CPU profile prices it, and ``autotp calibrate`` fits its samples, by the all-reduce row.

Every collective also pays ``LinkProfile.base_latency_s`` once per call (NCCL's ``baseLat``, the
fixed cost of launching the collective kernel, [NCCL]); with ``base_latency_s == 0`` the times
are exactly the table above. A group of one rank costs 0.0, and so does a zero-byte collective
(nothing is issued).

In a graph, a blocking collective also waits for the slowest rank to arrive: ranks drift apart
by the skew of their host work (scheduling, caches, the other processes of a shared machine),
and a collective acts as a barrier that each call pays again. Calibrating collectives back to
back, with the ranks already in step, misses that wait; :func:`collective_time_s` adds
``Hardware.collective_wait_s`` once per call, a wait that ``autotp calibrate`` fits from graphs
of compute and collectives timed per rank (0.0 in datasheet profiles: NCCL's ``baseLat``
already prices a GPU collective's launch, and GPU ranks stay in step within microseconds).
:func:`link_collective_time_s` is the bare link formula, without it.

The first collective of a call waits longer: the ranks enter the call out of step (they left the
barrier or the host work before it at different times; four ranks on two cores leave a barrier
two at a time), and that skew is paid once per call, where the following collectives only pay
the skew that builds up between two of them, which grows with the compute in between (the longer
a rank computes, the likelier it loses its core for a time slice to another rank or process).
:func:`call_sync_wait_s` prices both, once per call of a graph that has at least one collective:
``Hardware.call_sync_wait_s + Hardware.call_sync_wait_per_compute * min(compute,
Hardware.call_sync_wait_compute_range_s)`` (fitted with ``collective_wait_s`` over calibration graphs of
different numbers of collectives and compute, ``graph_calibration.fit_wait_terms``; the range is the largest
compute among them: the ranks' drift is bounded, and the line is not carried beyond the graphs it was fitted on);
a graph without collectives never waits for another rank.

``spans_nodes=True``: the group's ranks lie on several nodes. On a device profile (NCCL) two algorithms are
priced and the cheaper one is taken, as NCCL's tuner picks the fastest algorithm per call ([NCCL]); gloo (a
CPU profile, ``Hardware.host_is_device``) runs one flat ring over the group, so the flat form alone:

* flat: the ring or tree above with the ``inter_node`` link for every step (its bottleneck is each
  GPU's network port);
* hierarchical ([J18]; NCCL's tree and CollNet do the same split), when the group is ``k`` whole
  nodes of ``d = Hardware.devices_per_node`` consecutive ranks (:func:`hierarchical_parts`):
  all-reduce = reduce-scatter inside each node (``d`` ranks, ``n`` bytes, ``intra_node``) +
  all-reduce across nodes (``k`` ranks, ``n/d`` bytes, ``inter_node``; the ``d`` rails run at
  once, one NIC per GPU as in DGX H100/A100) + all-gather inside each node. All-gather is the
  inter-node all-gather of ``n/d`` then the intra-node one of ``n``; reduce-scatter the mirror.
  Each part is one collective call (pays its base latency). All-to-all and broadcast use the
  flat form only.

The forms below (and the backend's own, above) are the rows of one table,
:data:`~.collective_forms.FORM_TABLE`: when each applies, its cost (written once, priced here on numbers and
in :mod:`.symbolic` on expressions: :func:`form_link_time`), and what calibration fits for it.

**One-shot all-reduce** (``CollectiveForm.ONE_SHOT``: autotp's inference runtime on gloo,
``autotp.passes.small_collectives``): an all-reduce of at most :data:`ONE_SHOT_MAX_BYTES` over at least
:data:`ONE_SHOT_MIN_GROUP` ranks (:func:`uses_one_shot_all_reduce`, the condition the runtime itself
checks) runs as one ``all_to_all_single`` in which every rank sends its whole
tensor to every other rank and sums the ``p`` copies: ``(p-1)·alpha + (p-1)·n/B`` (the
all-to-all row above with ``p·n`` bytes per rank, [T05] pairwise exchange) instead of the ring's
``2(p-1)·alpha + 2(p-1)/p·n/B``; the local sum of ``p`` copies is memory bound and not priced,
as the ring's reduction is not. Flat link only (the runtime does not split it by node).

**Shared-memory all-reduce** (``CollectiveForm.SHARED_MEMORY``: autotp's inference
runtime on a gloo group whose ranks share one x86-64 host, :func:`uses_shared_memory_all_reduce`,
``autotp.runtime.collectives.shared_memory``): every all-reduce inside a node, at any size, on the profile's own
``Hardware.shared_memory_link`` (fitted by ``autotp calibrate``):
``base + (p-1)·alpha + (p+1)·n/B`` (its row's terms: each rank waits for the flags of
``p - 1`` others; it copies its ``n`` bytes in, reads the ``p`` copies and writes the sum). A group
that spans nodes cannot share memory: it is priced as the one-shot form the runtime falls back to.
In a graph whose working set pushes the slots out of the caches between two uses (a decode step
streaming hundreds of MiB of weights and cache), each call also pays
``Hardware.shared_memory_cold_call_s``, resolved at the graph's working set.

**Symmetric-memory all-reduce** (``CollectiveForm.SYMMETRIC_MEMORY``: autotp's inference
runtime where the ranks of a group share one host and their tensors are on CUDA devices,
:func:`uses_symmetric_memory_all_reduce`, ``autotp.runtime.collectives.symmetric_memory``): an all-reduce of at most
:data:`ONE_SHOT_MAX_BYTES` inside a node (:func:`symmetric_memory_takes`) runs as PyTorch's one-shot kernel on
symmetric memory (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``, [SYMM]): one kernel copies the tensor
into the rank's buffer, signals every peer and waits for their signals, loads the ``p - 1`` peers' buffers
over NVLink and sums them, then signals and waits once more before the buffer can be reused. Priced on
``Hardware.symmetric_memory_link`` (the ``intra_node`` link with one kernel launch, ``kernel_floor_s``, in
place of NCCL's per-call base): ``base + 2·alpha + (p-1)·n/B`` (its row's terms). vLLM's
and SGLang's custom all-reduce take the same form for small messages inside a node. Larger tensors and
groups that span nodes keep NCCL's ring or tree.

A group inside one node uses ``intra_node``. Which groups span nodes: :func:`group_spans_nodes`
(ranks laid out with the tensor-parallel dim fastest, as ``init_device_mesh`` does).

Point-to-point (a pipeline stage sending its activations to the next stage):
:func:`p2p_time_s` = base + alpha + n/B on the link between the two ranks ([T05]'s alpha-beta
model of one message); between nodes, where one-way sends were measured, the line through them (its burst
off the bytes) and at least a send's fixed cost inside a node (:func:`send_parts`).

Sources:

* [GLOO-RS] pytorch/pytorch pull request 118911, "ProcessGroupGloo::reduce_scatter_tensor_coalesced" (2024):
  gloo's reduce-scatter simulated as ``allreduce(input).chunk(world_size)[rank]``.
  https://github.com/pytorch/pytorch/pull/118911
* [H94] R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing
  20(3):389-398, 1994: a message of n bytes takes ``t0 + n / r_inf``.
* [T05] R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
  Operations in MPICH", Int. J. High Performance Computing Applications 19(1):49-66, 2005.
* [PY09] P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", J. Parallel and Distributed Computing 69(2):117-124, 2009 (ring all-reduce).
* [NT] nccl-tests, doc/PERFORMANCE.md: bus bandwidth = algbw x 2(p-1)/p (all-reduce),
  x (p-1)/p (all-gather, reduce-scatter, all-to-all), x 1 (broadcast).
  https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
* [SST09] P. Sanders, J. Speck, J. L. Träff, "Two-tree algorithms for full bandwidth broadcast,
  reduction and scan", Parallel Computing 35(12), 2009 (NCCL's double binary tree).
* [J18] X. Jia et al., "Highly Scalable Deep Learning Training System with Mixed-Precision:
  Training ImageNet in Four Minutes", arXiv:1807.11205, 2018, section 4.2 (hierarchical
  all-reduce: intra-node reduce, inter-node all-reduce, intra-node broadcast).
* [NCCL] NCCL src/graph/tuning.cc: tree algorithm bandwidth = 0.5 x bus bandwidth (so an
  all-reduce moves 2n/B), ``baseLat`` per call, ``hwLat`` per step.
* [SYMM] PyTorch, ``torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu``: the one-shot
  all-reduce kernel (a barrier on the signal pads, loads from every peer's buffer, a barrier again) and the
  ``symm_mem`` op schemas; ``torch.distributed._symmetric_memory`` (``empty``, ``rendezvous``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .collective_forms import (
    FORM_TABLE,
    NUMERIC,
    ONE_SHOT_MAX_BYTES,
    ONE_SHOT_MIN_GROUP,
    Arithmetic,
    CollectiveForm,
    link_time,
    runs_as,
)
from .hardware import Hardware, LinkProfile

__all__ = [
    "COLLECTIVE_ALGORITHMS",
    "COLLECTIVE_KINDS",
    "GLOO_RUNS_AS",
    "HAND_OUT_HEADER_BYTES",
    "HAND_OUT_LEAVES",
    "ONE_SHOT_MAX_BYTES",
    "ONE_SHOT_MIN_GROUP",
    "OUTPUT_SHAPE_DIMS",
    "SHAPE_ROW_BYTES",
    "backend_time",
    "binomial_broadcasts_s",
    "call_sync_wait_s",
    "collective_time_s",
    "form_link_time",
    "gloo_kind",
    "group_spans_nodes",
    "hierarchical_parts",
    "host_tree_children",
    "host_tree_deliveries_s",
    "link_collective_time_s",
    "p2p_time_s",
    "send_parts",
    "symmetric_memory_takes",
    "tree_sends_s",
    "uses_one_shot_all_reduce",
    "uses_shared_memory_all_reduce",
    "uses_symmetric_memory_all_reduce",
    "validate_collective",
]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
COLLECTIVE_ALGORITHMS = ("ring", "tree")


def uses_one_shot_all_reduce(group_size: int, nbytes: float) -> bool:
    """True when an all-reduce of ``nbytes`` (per rank) over ``group_size`` ranks takes the one-shot
    form on a runtime that has it (``FORM_TABLE[CollectiveForm.ONE_SHOT].takes``, which the runtime,
    ``autotp.passes.small_collectives``, and the pricing, :func:`collective_time_s`, both read)."""
    return FORM_TABLE[CollectiveForm.ONE_SHOT].takes("all_reduce", group_size, nbytes)


def uses_shared_memory_all_reduce(*, backend: str, one_host: bool, machine: str, device_type: str = "cpu") -> bool:
    """True when autotp's inference runtime sums a group's all-reduces through shared memory
    (``autotp.runtime.collectives.shared_memory``): a gloo group whose ranks all run on one host, on x86-64, with their
    tensors in host memory (``device_type`` "cpu"; CUDA tensors on a gloo group keep gloo's own collectives).
    The shared-memory row's group conditions (``FORM_TABLE[CollectiveForm.SHARED_MEMORY].takes_group``), which
    the runtime reads too."""
    return FORM_TABLE[CollectiveForm.SHARED_MEMORY].takes_group(backend=backend, one_host=one_host, machine=machine,
                                                                device_types={device_type})


def uses_symmetric_memory_all_reduce(*, one_host: bool, device_types: set[str] | frozenset[str],
                                     has_kernel: bool) -> bool:
    """True when autotp's inference runtime sums a group's small all-reduces in symmetric memory
    (``autotp.runtime.collectives.symmetric_memory``): every rank of the group runs on one host with its tensors on a
    CUDA device (``device_types``: the device types of the ranks' tensors), and this torch has the one-shot
    kernel (``has_kernel``: ``torch.ops.symm_mem.one_shot_all_reduce_copy_out``), whatever the backend (NCCL,
    or gloo with CUDA tensors). Which of those all-reduces take it: :func:`symmetric_memory_takes`. The
    symmetric-memory row's group conditions, which the runtime reads too."""
    return FORM_TABLE[CollectiveForm.SYMMETRIC_MEMORY].takes_group(one_host=one_host, device_types=device_types,
                                                                   has_kernel=has_kernel)


def symmetric_memory_takes(group_size: int, nbytes: float, dtype: Any = None) -> bool:
    """True when an all-reduce of ``nbytes`` (per rank) of ``dtype`` over ``group_size`` ranks runs through
    symmetric memory on a runtime that has it: at most :data:`ONE_SHOT_MAX_BYTES` (each rank loads ``p - 1``
    copies; beyond that NCCL's ring moves fewer bytes) of a dtype the kernel sums (float32, bfloat16).
    The symmetric-memory row's call condition, read by the runtime and by :func:`collective_time_s`."""
    return FORM_TABLE[CollectiveForm.SYMMETRIC_MEMORY].takes("all_reduce", group_size, nbytes, dtype)


def ceil_log2(group_size: int) -> int:
    """Rounds of a recursive-doubling / tree algorithm on ``group_size`` ranks: ceil(log2 p)."""
    return (group_size - 1).bit_length()


def alpha_beta_terms(kind: str, algorithm: str, group_size: Any, log2_steps: Any) -> tuple[Any, Any]:
    """(latency steps, bandwidth factor) of a collective: time = steps·alpha + factor·n/B.

    Pure arithmetic on ``group_size`` and ``log2_steps`` (ceil(log2 p)), so it serves numbers and
    sympy expressions alike; see the module docstring for the formulas and their sources.
    """
    p = group_size
    if kind == "all_reduce":
        if algorithm == "ring":  # [PY09]/[T05]: ring reduce-scatter then ring all-gather; [NT]
            return 2 * (p - 1), 2 * (p - 1) / p
        return 2 * log2_steps, 2  # [SST09] double binary tree; [NCCL] tree algbw = busbw / 2
    if kind in ("all_gather", "reduce_scatter"):
        if algorithm == "ring":  # [T05] ring; [NT] (p-1)/p
            return p - 1, (p - 1) / p
        return log2_steps, (p - 1) / p  # [T05] recursive doubling / recursive halving
    if kind == "all_to_all":
        if algorithm == "ring":  # [T05] pairwise exchange, p-1 rounds of n/p bytes; [NT] (p-1)/p
            return p - 1, (p - 1) / p
        return log2_steps, log2_steps / 2  # [T05] Bruck: log2 p rounds of n/2 bytes
    if kind == "broadcast":
        if algorithm == "ring":  # [NT] pipelined chain: busbw = algbw, p-1 hops of pipeline fill
            return p - 1, 1
        return log2_steps, log2_steps  # [T05] binomial tree: log2 p rounds of the whole buffer
    raise AssertionError(f"unreachable: kind {kind!r} was validated")


def validate_collective(kind: str, algorithm: str) -> None:
    """ValueError listing the valid kinds (or algorithms) when ``kind`` (or ``algorithm``) is unknown."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
    if algorithm not in COLLECTIVE_ALGORITHMS:
        raise ValueError(
            f"unknown collective algorithm {algorithm!r}; "
            f"valid algorithms: {', '.join(COLLECTIVE_ALGORITHMS)}"
        )


def _check_sizes(group_size: int, nbytes: float) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


def _on_group_link(kind: str, nbytes: Any, group_size: int, link: LinkProfile, algorithm: str,
                   arith: Arithmetic) -> Any:
    """The backend's ring or tree (module table) on one link, in ``arith``; 0 for a group of one rank."""
    if group_size == 1:
        return arith.real(arith.integer(0))
    steps, factor = alpha_beta_terms(kind, algorithm, arith.integer(group_size), arith.integer(ceil_log2(group_size)))
    return arith.real(link_time(link, steps, factor, nbytes))


GLOO_RUNS_AS = MappingProxyType({"reduce_scatter": "all_reduce"})
"""The collectives gloo runs as another kind over the same ``n`` bytes: PyTorch's gloo process group composes
``reduce_scatter_tensor`` from an all-reduce of the whole input, each rank keeping its chunk ([GLOO-RS]), twice a
ring reduce-scatter's traffic. Measured between two hosts at 200 Mbit/s (gloo, 2 ranks): 1 MiB and 4 MiB
reduce-scatters took 44.1 and 177.8 ms, the all-reduces 44.3 and 177.7, the all-gathers 22.2 and 90.3
(``benchmarks/gloo_collectives.py`` times them side by side on one host)."""


def gloo_kind(kind: str) -> str:
    """The kind whose terms price gloo's ``kind`` (:data:`GLOO_RUNS_AS`); a CPU profile's collectives and every
    calibration sample are gloo's."""
    return GLOO_RUNS_AS.get(kind, kind)


def backend_time(kind: str, nbytes: Any, group_size: int, hardware: Hardware, *, spans_nodes: bool,
                 algorithm: str, arith: Arithmetic) -> Any:
    """The backend's own collective (``CollectiveForm.RING``'s cost): the ring or tree on the group's link, and
    on a group of whole nodes the cheaper of that and the hierarchical form ([J18]; module docstring) where the
    backend splits a call by node (NCCL; gloo, on a CPU profile, runs one flat ring, and its reduce-scatter as an
    all-reduce: :func:`gloo_kind`), in ``arith`` (numbers or sympy expressions; no in-graph wait)."""
    if hardware.host_is_device:
        kind = gloo_kind(kind)
    flat = _on_group_link(kind, nbytes, group_size, hardware.link(spans_nodes=spans_nodes), algorithm, arith)
    # gloo (a CPU profile) runs its flat ring over the whole group; only NCCL splits a call by node
    hierarchical_backend = spans_nodes and not hardware.host_is_device
    parts = hierarchical_parts(kind, group_size, hardware.devices_per_node) if hierarchical_backend else None
    if parts is None:
        return flat
    hierarchical = arith.total(_on_group_link(part_kind, nbytes / divisor, part_group, getattr(hardware, link_field),
                                              algorithm, arith)
                               for part_kind, part_group, link_field, divisor in parts)
    return arith.minimum(flat, hierarchical)


def form_link_time(kind: str, nbytes: Any, group_size: int, hardware: Hardware, *, spans_nodes: bool,
                   algorithm: str, dtype: Any, arith: Arithmetic) -> Any:
    """One call's link time as the runtime runs it on ``hardware`` (no in-graph wait), in ``arith``: the row of
    the form that runs (the profile's ``small_all_reduce``, or its ``across_nodes`` form) prices a call it
    takes, :func:`backend_time` the others; a form that ``pays_cold_call`` adds
    ``Hardware.shared_memory_cold_call_s`` to each call of its kinds (resolved at the graph's working set,
    ``bandwidth.graph_profile``). :func:`collective_time_s` and :func:`.symbolic.symbolic_collective_time_s`
    are this over numbers and over sympy."""
    spec = runs_as(hardware.small_all_reduce, spans_nodes=spans_nodes)
    link_s = arith.real(arith.integer(0))
    if group_size > 1 and nbytes != 0:
        link_s = spec.time(kind, nbytes, group_size, dtype, group_link=hardware.link(spans_nodes=spans_nodes),
                           links=lambda field: getattr(hardware, field), arith=arith,
                           backend=lambda: backend_time(kind, nbytes, group_size, hardware, spans_nodes=spans_nodes,
                                                        algorithm=algorithm, arith=arith))
    if spec.pays_cold_call and kind in spec.kinds:
        link_s += hardware.shared_memory_cold_call_s
    return link_s


_FORM_LINKS = frozenset(spec.link_field for spec in FORM_TABLE.values() if spec.link_field is not None)
"""The links a form is priced on besides the group's (``FormSpec.link_field``), by name."""


def link_collective_time_s(
    kind: str,
    nbytes: float,
    group_size: int,
    link: LinkProfile,
    *,
    algorithm: str = "ring",
    small_all_reduce: str = CollectiveForm.RING,
    dtype: Any = None,
    **form_links: LinkProfile | None,
) -> float:
    """:func:`collective_time_s` on an explicit link instead of a hardware profile (no in-graph wait, no
    cold-cache cost, no hierarchical form).

    ``small_all_reduce``: the :class:`~.collective_forms.CollectiveForm` that runs (its row of
    :data:`~.collective_forms.FORM_TABLE`): a call it takes is priced by its row, on ``link`` or on the link
    the row names (``form_links``, by the row's ``link_field``: ``shared_memory_link=``,
    ``symmetric_memory_link=``; required then); the others as the backend's ring or tree on ``link``.
    ``dtype``: the tensor's, where known."""
    validate_collective(kind, algorithm)
    _check_sizes(group_size, nbytes)
    if set(form_links) - _FORM_LINKS:
        raise TypeError(f"link_collective_time_s() got unknown links {sorted(set(form_links) - _FORM_LINKS)}; the "
                        f"forms' links are {sorted(_FORM_LINKS)}")
    if group_size == 1 or nbytes == 0:
        return 0.0
    spec = FORM_TABLE[CollectiveForm.from_name(small_all_reduce)]
    return float(spec.time(kind, nbytes, group_size, dtype, group_link=link, links=form_links.get, arith=NUMERIC,
                           backend=lambda: _on_group_link(kind, nbytes, group_size, link, algorithm, NUMERIC)))


def collective_time_s(
    kind: str,
    nbytes: float,
    group_size: int,
    hardware: Hardware,
    *,
    spans_nodes: bool = False,
    algorithm: str = "ring",
    dtype: Any = None,
) -> float:
    """Seconds for one collective of ``kind`` over ``group_size`` ranks, in a graph: the link's
    alpha-beta time plus the wait for the slowest rank (``Hardware.collective_wait_s``).

    ``nbytes``: bytes of the FULL (unsharded) tensor — the all-reduce buffer, the all-gather
    output, the reduce-scatter input, the all-to-all data per rank, the broadcast buffer.
    ``spans_nodes``: the group crosses nodes, so the ``inter_node`` link is the bottleneck.
    ``algorithm``: ``"ring"`` or ``"tree"`` (formulas and sources in the module docstring).
    ``dtype``: the tensor's dtype where known (the symmetric-memory kernel sums some dtypes only).
    The form that runs is the profile's ``small_all_reduce`` (or its ``across_nodes`` form), priced by its
    row of :data:`~.collective_forms.FORM_TABLE`, as :func:`.symbolic.symbolic_collective_time_s` does.
    """
    validate_collective(kind, algorithm)
    _check_sizes(group_size, nbytes)
    link_s = form_link_time(kind, nbytes, group_size, hardware, spans_nodes=spans_nodes, algorithm=algorithm,
                            dtype=dtype, arith=NUMERIC)
    # in a graph, the wait for the slowest rank: once per call of the collective (see module docstring)
    return link_s + hardware.collective_wait_s if link_s else 0.0


def call_sync_wait_s(hardware: Hardware, collectives: int, compute_s: float) -> float:
    """Seconds one call of a rank-local graph with ``collectives`` collectives and ``compute_s`` of compute
    waits for ranks out of step beyond its collectives' own waits: ``Hardware.call_sync_wait_s`` once
    plus ``Hardware.call_sync_wait_per_compute`` times ``compute_s``, up to
    ``Hardware.call_sync_wait_compute_range_s`` of it where set (module docstring); 0.0 without collectives."""
    if collectives < 0 or not math.isfinite(compute_s) or compute_s < 0:
        raise ValueError(f"need a count of collectives >= 0 and compute_s >= 0, got {collectives!r} and {compute_s!r}")
    if not collectives:
        return 0.0
    bound = hardware.call_sync_wait_compute_range_s
    return hardware.call_sync_wait_s + hardware.call_sync_wait_per_compute * (min(compute_s, bound) if bound else compute_s)


def hierarchical_parts(kind: str, group_size: int, devices_per_node: int) -> tuple[tuple[str, int, str, int], ...] | None:
    """The parts of the hierarchical form of ``kind`` over ``group_size`` ranks ([J18]), or None.

    Each part is ``(collective kind, ranks, Hardware link field, divisor of n)``. None when the
    group is not a whole number (> 1) of nodes of ``devices_per_node`` ranks, or ``kind`` has no
    hierarchical form here (all-to-all, broadcast).
    """
    d = devices_per_node
    if d < 2 or group_size <= d or group_size % d:
        return None
    k = group_size // d
    if kind == "all_reduce":
        return (("reduce_scatter", d, "intra_node", 1), ("all_reduce", k, "inter_node", d),
                ("all_gather", d, "intra_node", 1))
    if kind == "all_gather":
        return (("all_gather", k, "inter_node", d), ("all_gather", d, "intra_node", 1))
    if kind == "reduce_scatter":
        return (("reduce_scatter", d, "intra_node", 1), ("reduce_scatter", k, "inter_node", d))
    return None


def group_spans_nodes(group_size: int, devices_per_node: int, world_size: int | None = None) -> bool:
    """True when some group of ``group_size`` consecutive ranks (out of ``world_size``) crosses a node.

    Ranks ``0..world_size-1`` are cut into groups of ``group_size`` consecutive ranks (the
    innermost mesh dim, as ``init_device_mesh`` lays ranks out) and nodes hold
    ``devices_per_node`` consecutive ranks each. ``world_size`` defaults to ``group_size`` (one
    group): it spans nodes exactly when it has more ranks than a node. A group size that does not
    divide ``devices_per_node`` makes some group straddle two nodes once there are several nodes.
    """
    world = group_size if world_size is None else world_size
    return any(start // devices_per_node != (start + group_size - 1) // devices_per_node
               for start in range(0, world, group_size))


def p2p_time_s(nbytes: float, hardware: Hardware, *, spans_nodes: bool) -> float:
    """Seconds to send ``nbytes`` from one rank to another, alone on the link: the send's fixed part, then its bytes
    at the link's rate (:func:`send_parts`; [H94]'s ``t0 + n / r``, [T05]'s alpha-beta).

    ``spans_nodes``: the two ranks are on different nodes (:meth:`~.hardware.Hardware.send_link`: a send's own
    link between nodes where measured, else ``inter_node``), else ``intra_node``. 0.0 for zero bytes.
    """
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if nbytes == 0:
        return 0.0
    fixed_s, at_rate = send_parts(nbytes, hardware, spans_nodes=spans_nodes)
    return float(fixed_s + at_rate / hardware.send_link(spans_nodes=spans_nodes).bandwidth_bytes_per_s)


def send_parts(nbytes: float, hardware: Hardware, *, spans_nodes: bool, sharing: int = 1) -> tuple[float, float]:
    """A point-to-point send of ``nbytes`` as (seconds before its bytes move at its link's rate, the bytes that
    do), its link :meth:`~.hardware.Hardware.send_link`'s: the link's base and per-step latency, then every byte.

    Between nodes where one-way sends were measured (``Hardware.inter_node_send``: the line through them), a send
    pays the line's latency and the bytes beyond the link's burst (``LinkProfile.burst_bytes``, shared by the
    ``sharing`` sends that leave one node at once), and at least the fixed cost of a send inside a node
    (``intra_node``'s base and per-step latency: the same calls and copies on both ranks): ``max(floor, latency +
    (n - burst) / B)``. A collective's fixed cost (``inter_node``'s) is not a send's: it waits on every rank of its
    group, both ways; between two emulated hosts a collective paid 0.7-1.6 ms where a stage's 64 KiB send took
    0.9 ms and a small one-way send 0.1-0.4 ms (docs: Layouts on a two-host network)."""
    link = hardware.send_link(spans_nodes=spans_nodes)
    fixed_s = link.base_latency_s + link.latency_s
    if not spans_nodes or hardware.inter_node_send is None:
        return fixed_s, float(nbytes)
    at_rate = max(0.0, nbytes - link.burst_bytes / max(1, sharing))
    floor_s = hardware.intra_node.base_latency_s + hardware.intra_node.latency_s
    return max(fixed_s, floor_s - at_rate / link.bandwidth_bytes_per_s), at_rate


def _binomial_children(ranks: Sequence[int], root: int) -> dict[int, list[int]]:
    """Whom each rank sends to in gloo's binomial broadcast: virtual rank ``v`` (renumbered from the root) sends to
    ``v + 2^i`` in round ``i`` while ``v < 2^i``."""
    size, start = len(ranks), list(ranks).index(root)
    order = [ranks[(start + v) % size] for v in range(size)]
    children: dict[int, list[int]] = {rank: [] for rank in ranks}
    bit = 1
    while bit < size:
        for v in range(min(bit, size - bit)):
            children[order[v]].append(order[v + bit])
        bit <<= 1
    return children


OUTPUT_SHAPE_DIMS = 8
"""Dims of an output leaf's shape that the mesh runtime's int64 rows have room for (the replicas' shape
all-gather, the hand-out's header); an output with more goes as an object."""
HAND_OUT_LEAVES = 16
"""Output leaves the mesh runtime's hand-out header describes in int64 rows; more go as an object."""
SHAPE_ROW_BYTES = 8 * (1 + OUTPUT_SHAPE_DIMS)
"""Bytes of one leaf's shape in the replicas' shape all-gather: its number of dims, then the dims."""
HAND_OUT_HEADER_BYTES = 8 * (1 + HAND_OUT_LEAVES * (2 + OUTPUT_SHAPE_DIMS))
"""Bytes of a hand-out's header: the number of leaves, then a row per leaf (dtype, number of dims, dims)."""


def host_tree_children(ranks: Sequence[int], root: int, host_of: Mapping[int, Hashable]) -> dict[int, list[int]]:
    """Whom each rank sends to when ``root`` hands one value to the other ``ranks`` so that it crosses into each
    host once: a binomial tree over the hosts (each host's first rank of ``ranks`` stands for it, the root for its
    own; hosts in the order of their first ranks, renumbered from the root's), then each of those ranks sends to
    the rest of its host. ``host_of``: each rank's host (any hashable; equal for ranks on one host). A rank's sends
    across hosts come first in its list."""
    members: dict[Hashable, list[int]] = {}
    for rank in sorted(ranks):
        members.setdefault(host_of[rank], []).append(rank)
    for host_ranks in members.values():  # the root stands for its own host
        if root in host_ranks:
            host_ranks.remove(root)
            host_ranks.insert(0, root)
    hosts = list(members)
    start = hosts.index(host_of[root])
    leaders = [members[hosts[(start + i) % len(hosts)]][0] for i in range(len(hosts))]
    children = _binomial_children(leaders, root)
    for host_ranks in members.values():
        children[host_ranks[0]] = children.get(host_ranks[0], []) + host_ranks[1:]
        children.update({rank: [] for rank in host_ranks[1:]})
    return children


def binomial_broadcasts_s(groups: Sequence[tuple[Sequence[int], int]], nbytes: float, hardware: Hardware) -> float:
    """Seconds until every rank of every group has ``nbytes`` from its group's root, for broadcasts that run at once
    as gloo runs each: a binomial tree ([T05]) over the group's ranks renumbered from the root, simulated by
    :func:`tree_sends_s` (on two nodes of two ranks, a tree whose root's two sends both cross takes about three
    transfers' time). ``groups``: ``(ranks, root)`` per broadcast, disjoint."""
    children: dict[int, list[int]] = {}
    for ranks, root in groups:
        children.update(_binomial_children(ranks, root))
    return tree_sends_s(children, [root for _, root in groups], nbytes, hardware)


def host_tree_deliveries_s(groups: Sequence[tuple[Sequence[int], int]], nbytes: float, hardware: Hardware) -> float:
    """Seconds until every rank of every group has ``nbytes`` from its group's root over
    :func:`host_tree_children` (the value crosses into each host once), the groups' trees running at once,
    simulated by :func:`tree_sends_s`; hosts of ``Hardware.devices_per_node`` ranks."""
    d = max(1, hardware.devices_per_node)
    children: dict[int, list[int]] = {}
    for ranks, root in groups:
        children.update(host_tree_children(ranks, root, {rank: rank // d for rank in ranks}))
    return tree_sends_s(children, [root for _, root in groups], nbytes, hardware)


def tree_sends_s(children: dict[int, list[int]], roots: Sequence[int], nbytes: float, hardware: Hardware) -> float:
    """Seconds until every rank of the trees ``children`` (whom each rank sends to) has ``nbytes`` from its tree's
    root in ``roots``, the trees running at once. A rank sends once it holds the data, and its sends are under way
    together (the root starts all of its sends at once).

    Ranks ``r`` and ``s`` share a node when ``r // d == s // d`` (``d = Hardware.devices_per_node``). The call pays
    its link's base latency once (the link a send between nodes uses where one crosses,
    :meth:`~.hardware.Hardware.send_link`); a send inside a node then pays the ``intra_node`` link's per-step
    latency and bytes, and a send between nodes the rest of its fixed part (:func:`send_parts`), then shares the
    bandwidth of the nodes it leaves and enters equally with the other sends crossing there at that moment (a fluid
    model of flows through one NIC) for its bytes beyond the burst."""
    if nbytes <= 0:
        return 0.0
    d = max(1, hardware.devices_per_node)
    inter, intra = hardware.send_link(spans_nodes=True), hardware.intra_node
    leaving = collections.Counter(sender // d for sender, sent_to in children.items() for child in sent_to
                                  if child // d != sender // d)  # crossing sends per node, sharing its burst
    ready = sorted((0.0, root, child) for root in roots for child in children.get(root, []))  # (time, sender, receiver)
    flows: list[list[Any]] = []  # [sender node, receiver node, receiver, bytes left, time its bytes start]
    now = finished = 0.0
    while ready or flows:
        while ready and ready[0][0] <= now:
            _, sender, receiver = ready.pop(0)
            if sender // d == receiver // d:
                done = now + intra.latency_s + nbytes / intra.bandwidth_bytes_per_s
                finished = max(finished, done)
                ready = sorted(ready + [(done, receiver, child) for child in children.get(receiver, [])])
            else:
                fixed_s, at_rate = send_parts(nbytes, hardware, spans_nodes=True, sharing=leaving[sender // d])
                flows.append([sender // d, receiver // d, receiver, at_rate, now + fixed_s - inter.base_latency_s])
        moving = [f for f in flows if f[4] <= now]
        out = collections.Counter(f[0] for f in moving)
        into = collections.Counter(f[1] for f in moving)
        rates = {id(f): inter.bandwidth_bytes_per_s / max(out[f[0]], into[f[1]]) for f in moving}
        events = [f[3] / rates[id(f)] for f in moving] + [f[4] - now for f in flows if f[4] > now]
        events += [ready[0][0] - now] if ready else []
        if not events:
            break
        step = max(0.0, min(events))
        now += step
        for f in moving:
            f[3] -= rates[id(f)] * step
        for f in [f for f in moving if f[3] <= 1e-9 * nbytes]:
            flows.remove(f)
            finished = max(finished, now)
            ready = sorted(ready + [(now, f[2], child) for child in children.get(f[2], [])])
    crosses = any(child // d != sender // d for sender, sent_to in children.items() for child in sent_to)
    return (inter if crosses else intra).base_latency_s + finished
