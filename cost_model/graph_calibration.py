"""Calibrating the cost model the way graphs run: shape-dependent GEMM rates, transcendental ops,
and the host and collective terms fitted over whole rank-local graphs.

An op timed alone in a tight loop runs with warm caches and a warm dispatch path; the same op in a
graph of two hundred different ops, on real-size tensors, costs several times more on the host,
and a collective in a graph waits for the slowest rank, which a collective timed back to back
(ranks already in step) never does. So the per-node and per-collective terms are not measured on
one op: :func:`measure_graphs` builds rank-local graphs with the op mix of the graphs the rewrite
emits for HuggingFace models (:data:`GRAPH_FAMILIES`: the prologue of position ids, causal mask and
lookups; Llama-like and GPT-like blocks; feed-forward blocks alone; an all-reduce after each
row-split projection) at several depths, widths and token counts, and one graph of a single norm
(the call of a graph and little else); runs each by calling its ``GraphModule`` (what
``TensorParallelModule`` does), one graph at a time, each call after an untimed call of itself and
a common start on every rank (:func:`time_in_turn`), timing it on the wall clock (from the moment every
rank started it to the moment the last finished it, :func:`common_start`, :func:`group_call_s`)
and on the work clock (:func:`work_clock`: the rank's own CPU time); times a graph with collectives
also in its *compute form* (:func:`local_stand_ins`: every collective replaced by a local op of its
output's shape, in turn with the real form); and :func:`fit_host_terms` fits

    compute_work_s - view_nodes * view_op_s = sum over kernels of (d + extra * d * cap / (cap + d))
                                              + kernel_nodes * dispatch + call
    compute_s = compute_work_s / core_share
    seconds   = compute_s + link_s + collectives * collective_wait_s
                + call_sync_wait_s + call_sync_wait_per_compute * compute_s   (with collectives)

where ``device_s`` is the roofline time of the graph's kernels (:func:`~.compute.compute_time_s` with
no host term and no per-kernel floor: on a CPU the fitted dispatch is a node's whole fixed cost,
and the calibrated profile sets ``kernel_floor_s`` to 0), ``d`` a kernel's part of it, ``extra`` and
``cap`` what a kernel costs in a graph beyond it, up to a cap (:func:`fit_compute_terms`; the
profile's ``kernel_extra_fraction`` and ``kernel_extra_cap_s``), ``link_s`` the alpha-beta time of its
collectives on the link fitted back to back, and ``core_share`` the share of a core a rank gets
while computing: its median work over the median of the group's wall times in the compute
forms of all graphs, each graph weighing by its time
(about 1/2 for four single-thread ranks on two idle cores, at most ``cores / (ranks * threads)``,
:func:`fair_core_share`). What the fit adds is what a graph costs beyond its kernels and its
link: the host's dispatch per node, the call of the graph, and the wait for the slowest rank,
which is what the real form takes beyond its measured compute and its link, fitted over the
graphs' numbers of collectives and their compute (:func:`fit_wait_terms`): a wait per
collective, a wait a call pays once for ranks that entered it out of step (``call_sync_wait_s``),
and a wait per second of compute for ranks that drift apart while they compute between
collectives (``call_sync_wait_per_compute``).

Compute and communication mean the same in the prediction as in the accuracy benchmark
(``benchmarks/cost_model_accuracy.py``), which measures a model's compute in the same compute
form: the compute of a rank is the time it takes to run its kernels and dispatch its nodes
while the other ranks compute too (four ranks taking turns on two cores is compute time, priced
through the core share), and the communication is what the collectives add to that.

Two rates are fitted on single ops first, because the graph fit stands on them:

* :func:`fit_gemm_curve`: ``aten.linear`` at a fixed width and growing token counts; the
  ``gemm_half_efficiency_dim`` whose roofline (:func:`~.compute.gemm_efficiency`) best matches
  the timings, with the peak the curve tends to (the best rate measured is itself below it);
* :func:`measure_transcendental_element_s`: seconds per element of exp, tanh, sigmoid, silu and
  gelu on a large tensor, the median over them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import least_squares, lsq_linear, nnls  # type: ignore[import-untyped]

from .bandwidth import at_working_set, cold_call_at_s
from .collectives import SHARED_MEMORY_KINDS, link_collective_time_s
from .compute import (
    aten_flops,
    aten_memory_bytes,
    capped_kernel_s,
    compute_time_s,
    gemm_dims,
    is_transcendental,
    launches_no_kernel,
    op_family,
)
from .hardware import Hardware, LinkProfile

__all__ = [
    "COMMON_START_LEAD_S",
    "GRAPH_FAMILIES",
    "GemmFit",
    "GemmSample",
    "GraphSample",
    "GraphShape",
    "HostFit",
    "block_graph",
    "common_start",
    "fair_core_share",
    "fit_compute_terms",
    "fit_gemm_curve",
    "fit_host_terms",
    "fit_wait_line",
    "fit_wait_terms",
    "graph_link_s",
    "graph_sample",
    "graph_samples",
    "group_call_s",
    "kernels_in_graph_s",
    "local_stand_ins",
    "measure_gemm_samples",
    "measure_graphs",
    "measure_op_fixed_s",
    "measure_transcendental_element_s",
    "ranks_share_a_clock",
    "time_in_turn",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GemmSample:
    """One timed ``aten.linear``: input ``(m, k)``, weight ``(n, k)``, float32; ``seconds`` per call."""

    m: int
    n: int
    k: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class GraphShape:
    """A synthetic rank-local transformer graph: ``layers`` blocks of ``hidden`` features over
    ``tokens`` tokens, ``heads`` attention heads before the split over the ranks; with
    ``collectives`` (and more than one rank) an all-reduce after each row-split projection.
    Graphs with and without collectives keep the per-node and per-collective terms apart in the
    fit (in one kind of graph both grow with the depth alone). ``family``: the op mix of the
    blocks (:data:`GRAPH_FAMILIES`). ``layers=0``: only a norm, no prologue, no block (the call of a
    graph and little else, which pins the fit's per-call term)."""

    layers: int
    tokens: int
    hidden: int
    heads: int = 8
    collectives: bool = True
    family: str = "llama"

    @property
    def all_reduces(self) -> int:
        """All-reduces one call issues at more than one rank: one per ``"mlp"`` block, two per other block."""
        return self.layers * (1 if self.family == "mlp" else 2) if self.collectives else 0

    def __post_init__(self) -> None:
        if self.layers < 0 or self.tokens < 1 or self.hidden < 1:
            raise ValueError(f"GraphShape needs layers >= 0, tokens >= 1 and hidden >= 1, got {self}")
        if self.family not in GRAPH_FAMILIES:
            raise ValueError(f"GraphShape.family must be one of {', '.join(GRAPH_FAMILIES)}, got {self.family!r}")


@dataclasses.dataclass(frozen=True)
class GraphSample:
    """One rank-local graph, timed as the runtime runs it, with what the cost model sees in it.

    ``device_s``: sum of its kernels' roofline times and their op families' fixed costs (no host term);
    ``collectives``: the ``(kind, full-tensor bytes, group size)`` of each collective, priced on the link at fit
    time; ``seconds``: median over runs of one call's time on the group (wall clock, from a start
    common to every rank to the last rank's end: :func:`group_call_s`);
    ``work_s``: median over runs of this rank's own work per call (:func:`work_clock`; 0.0: not
    measured).

    The graph's *compute* is measured as the accuracy benchmark measures a model's: the same
    graph with every collective replaced by a local stand-in of its output's shape
    (:func:`local_stand_ins`), timed in turn with the real one. ``compute_s``: median over runs of
    that form's time on the group; ``compute_work_s``: median of this rank's work in
    it (both equal ``seconds`` and ``work_s`` for a graph without collectives; 0.0: not measured,
    older samples). ``core_share``: ``compute_work_s / compute_s`` (medians, as the benchmark times a
    forward), at most :func:`fair_core_share`: the share of a core a rank gets *while computing* (1.0 alone on an idle
    core; 1/2 with four single-thread ranks on two cores; lower when other processes load the
    machine); the time a rank waits in a collective is not in it. ``working_set_bytes``: the bytes the
    cost pass would size this graph's model at (``bandwidth.graph_working_set_bytes``: its tensors held
    whole), at which a shared-memory collective's cold-cache cost is resolved (:func:`graph_link_s`;
    0: not recorded, no cold cost). ``kernel_s``: each kernel node's roofline time (they sum to
    ``device_s`` less the op families' fixed costs, ``Hardware.op_fixed_s``), from which the fit prices what a
    kernel costs in a graph beyond it (:func:`fit_compute_terms`; empty: not recorded, priced as if one kernel of
    ``device_s``).
    """

    kernel_nodes: int
    view_nodes: int
    device_s: float
    collectives: tuple[tuple[str, int, int], ...]
    seconds: float
    work_s: float = 0.0
    core_share: float = 1.0
    compute_s: float = 0.0
    compute_work_s: float = 0.0
    working_set_bytes: int = 0
    kernel_s: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class HostFit:
    """Fitted host terms (wall seconds) and how well they reproduce the graphs they were fitted on;
    ``core_share``: the share of a core a rank got while running them (1.0 when not measured),
    by which the profile divides every work term measured on the work clock;
    ``link_base_adjust_s`` (at most 0): what a collective in a graph takes *less* than the link
    fitted back to back, per call, which the profile takes off the link's ``base_latency_s``;
    ``call_sync_wait_s``: the wait a graph's first collective pays once per call for ranks that
    entered it out of step; ``call_sync_wait_per_compute``: the wait, per second of a call's compute,
    of ranks that drift apart while they compute between collectives (:func:`fit_wait_terms`);
    ``kernel_extra_fraction`` and ``kernel_extra_cap_s``: what a kernel cost in the graphs beyond its
    roofline (``Hardware.kernel_extra_fraction``; work seconds, :func:`fit_compute_terms`)."""

    host_dispatch_s: float
    collective_wait_s: float
    graph_launch_s: float
    median_abs_rel_error: float
    samples: int
    core_share: float = 1.0
    link_base_adjust_s: float = 0.0
    call_sync_wait_s: float = 0.0
    call_sync_wait_per_compute: float = 0.0
    kernel_extra_fraction: float = 0.0
    kernel_extra_cap_s: float = 0.0


# ------------------------------------------------------------------------------ fits

@dataclasses.dataclass(frozen=True)
class GemmFit:
    """The shape-dependent GEMM rate: ``half_dim`` (``Hardware.gemm_half_efficiency_dim``) and the
    factor ``peak_scale`` from the best measured rate to the curve's asymptote (the best rate was
    itself measured at a finite shape, so it is below the peak the curve tends to)."""

    half_dim: float
    peak_scale: float
    median_abs_log_error: float


_HALF_DIMS = (0.0, *(2.0**exponent for exponent in range(-2, 13)))
_PEAK_SCALES = tuple(2.0 ** (step / 16) for step in range(0, 49))  # 1 to 8, 4.4% apart


def fit_gemm_curve(samples: Sequence[GemmSample], hardware: Hardware) -> GemmFit:
    """The curve ``d / (d + half_dim)`` and the peak it tends to that best predict ``samples`` on
    ``hardware`` (its float32 peak, bandwidth and floor; its host terms are ignored): a grid over
    ``half_dim`` (0, and 1/4 to 4096 by powers of 2) and over the peak's scale (1 to 8, 2^(1/16)
    apart), smallest median absolute log error, the flattest curve on a tie."""
    if not samples:
        raise ValueError("need at least one GEMM sample to fit the shape-dependent GEMM rate")
    device = _device_only(hardware)
    best: tuple[float, float, float] | None = None
    for half in _HALF_DIMS:
        for scale in _PEAK_SCALES:
            peaks = {dtype: tflops * scale for dtype, tflops in device.peak_tflops.items()}
            profile = dataclasses.replace(device, gemm_half_efficiency_dim=half, peak_tflops=peaks)
            error = statistics.median(
                abs(math.log(_linear_time_s(s.m, s.n, s.k, profile) / s.seconds)) for s in samples
            )
            if best is None or error < best[0] - 1e-12:
                best = (error, half, scale)
            if half == 0.0:
                break  # a flat curve: the best measured rate is the peak, no scale to fit
    assert best is not None
    return GemmFit(best[1], best[2], best[0])


def _linear_time_s(m: int, n: int, k: int, hardware: Hardware) -> float:
    flops = 2 * m * n * k
    moved = 4 * (m * k + n * k + n + m * n)  # input, weight, bias read; output written (float32)
    return compute_time_s(flops, moved, torch.float32, hardware, gemm_min_dim=min(m, n, k))


def fit_host_terms(samples: Sequence[GraphSample], *, view_op_s: float, link: LinkProfile | None,
                   shared_memory_link: LinkProfile | None = None,
                   shared_memory_cold_curve: Sequence[tuple[float, float]] = ()) -> HostFit:
    """Fit ``host_dispatch_s``, ``collective_wait_s`` and ``graph_launch_s`` (module docstring).

    ``shared_memory_link``: the graphs' all-reduces ran through shared memory (``measure_graphs`` on
    ranks of one host) and are priced on it, with the cold-cache cost of ``shared_memory_cold_curve``
    (``Hardware.shared_memory_cold_curve``) as a model's collectives are; None: small ones ran in one
    round (one-shot form).

    ``view_op_s`` (measured on a chain of views) prices the view nodes; ``link`` (fitted back to
    back) prices the collectives' alpha-beta time, and may be None when no sample has one.
    Raises ValueError with fewer samples than unknowns.

    When the samples carry their own work (``work_s``, timed on the work clock like the single
    ops whose rates price ``device_s``), the fit has three steps, each on what it can see:

    1. the kernels' extra in a graph, the dispatch per kernel node and the call of the graph
       (:func:`fit_compute_terms`) over the work of every graph (a column per collective takes the
       host work of issuing and waiting on one, which belongs to the wait below, not to a node);
    2. the share of a core a rank gets (:attr:`GraphSample.core_share`) over the graphs without
       collectives together (their total work over their total wall time): every work term
       becomes wall time divided by it (the
       returned dispatch and call, and :func:`~.calibrate.build_profile` the kernel rates);
    3. the wait per collective: the median over the graphs with collectives of what their
       slowest rank's wall time has beyond their predicted kernels, nodes, call and link, per
       collective, at least 0 (a median over graphs does not swing with one disturbed run).

    When the samples also carry their compute (``compute_work_s``, ``compute_s``: the graph with
    its collectives replaced by local stand-ins, :func:`graph_sample`), compute and communication
    are fitted on what each of them is, so that the predicted split means what the measured one
    does (:func:`_fit_compute_then_wait`). Without ``work_s`` (older samples), one least-squares
    fit of all three terms on wall time.
    """
    with_collectives = any(sample.collectives for sample in samples)
    unknowns = 3 if with_collectives else 2
    if len(samples) < unknowns:
        raise ValueError(f"need at least {unknowns} graph samples to fit the host terms, got {len(samples)}")
    if with_collectives and link is None:
        raise ValueError("graph samples with collectives need the link they ran on to be priced")

    def link_s(sample: GraphSample) -> float:
        return graph_link_s(sample, link, shared_memory_link, shared_memory_cold_curve)

    if not all(sample.work_s > 0 for sample in samples):
        return _fit_wall_terms(samples, view_op_s, link_s, with_collectives)
    if all(sample.compute_work_s > 0 and sample.compute_s > 0 for sample in samples):
        return _fit_compute_then_wait(samples, view_op_s, link_s)
    # a column per collective takes the host work of issuing and waiting on one (it belongs to the wait)
    extra, cap, dispatch_work_s, launch_work_s = fit_compute_terms(
        samples, [sample.work_s - sample.view_nodes * view_op_s for sample in samples],
        extra_columns=[[len(sample.collectives)] for sample in samples])
    # over the graphs together, each weighing by its time (the longest calls are the most like a forward)
    alone = [sample for sample in samples if not sample.collectives] or list(samples)
    share = sum(sample.work_s for sample in alone) / sum(sample.work_s / sample.core_share for sample in alone)

    def wall_without_wait_s(sample: GraphSample) -> float:
        work_s = (kernels_in_graph_s(sample, extra, cap) + sample.view_nodes * view_op_s
                  + sample.kernel_nodes * dispatch_work_s
                  + launch_work_s)
        return work_s / share + link_s(sample)

    waits = [(sample.seconds - wall_without_wait_s(sample)) / len(sample.collectives)
             for sample in samples if sample.collectives]
    wait_s = max(0.0, statistics.median(waits)) if waits else 0.0
    errors = [abs(wall_without_wait_s(sample) + len(sample.collectives) * wait_s - sample.seconds) / sample.seconds
              for sample in samples]
    return HostFit(dispatch_work_s / share, wait_s, launch_work_s / share, statistics.median(errors), len(samples),
                   share, kernel_extra_fraction=extra, kernel_extra_cap_s=cap)


def graph_link_s(sample: GraphSample, link: LinkProfile | None, shared_memory_link: LinkProfile | None,
                 shared_memory_cold_curve: Sequence[tuple[float, float]] = ()) -> float:
    """Link time of ``sample``'s collectives, run as ``autotp.compile``'s inference graphs run them
    (:func:`measure_graphs`): through shared memory on ``shared_memory_link`` when given, each
    paying the cold-cache cost of ``shared_memory_cold_curve`` at the graph's working set as the
    cost model prices a model's (``collectives.collective_time_s``; the wait fitted beyond this
    time must not hold it again), else small all-reduces in one round on ``link``; 0.0 without a
    link."""
    if link is None:
        return 0.0
    form = "shared_memory" if shared_memory_link is not None else "one_shot"
    cold_s = cold_call_at_s(shared_memory_cold_curve, sample.working_set_bytes) if form == "shared_memory" else 0.0
    return sum(link_collective_time_s(kind, nbytes, group, link, small_all_reduce=form,
                                      shared_memory_link=shared_memory_link)
               + (cold_s if kind in SHARED_MEMORY_KINDS else 0.0)
               for kind, nbytes, group in sample.collectives)


def _fit_compute_then_wait(samples: Sequence[GraphSample], view_op_s: float,
                           link_s: Callable[[GraphSample], float]) -> HostFit:
    """The host terms from samples whose compute was timed apart (:attr:`GraphSample.compute_s`).

    Compute and communication mean here what the accuracy benchmark measures: a graph's compute
    is its time with every collective replaced by a local stand-in, its communication what the
    real collectives add to that. So:

    1. the kernels' extra in a graph, the dispatch per kernel node and the call of the graph
       (:func:`fit_compute_terms`) over the *compute work* of every graph (``compute_work_s``; the
       graphs with collectives count too, without a column for them: their stand-ins cost nothing);
    2. the share of a core a rank gets while computing: the compute work of every graph over
       its compute wall time, each graph weighing by its time; every work term becomes wall time
       divided by it. With four single-thread ranks on two cores it is about 1/2: the ranks take
       turns on the cores while they compute, which is compute time, not a wait for a collective;
    3. the wait: what the real form's wall time of each graph with collectives has beyond its
       measured compute and its link time, as a line over the graphs' numbers of collectives
       and their compute (:func:`fit_wait_terms`): the wait per collective (at least 0), the wait
       a call pays once (``call_sync_wait_s``) for ranks that entered it out of step, and the wait
       per second of compute (``call_sync_wait_per_compute``) of ranks that drift apart while
       they compute, at most ``1 - share``: ranks drift apart by the time slices they lose, and
       a rank is off its core for ``1 - share`` of its compute's wall time (about 0.5 for four
       ranks on two cores, about 0.02 for two: there a wait that grows with compute is not drift,
       and the fit must put it elsewhere).
       Measured against the compute *measured* in the same runs (taking turns with the real
       form), it holds what the collectives add (the skew between ranks, the wake-up of a rank
       that slept in one), not what the compute terms miss. A negative slope is kept apart
       as ``link_base_adjust_s``: the collectives take less in a graph than back to back, where
       every step needs every rank on a core, while in a graph a rank that waits in a collective
       gives its core to ranks still computing (four ranks on two cores), so part of its link
       time runs while they compute. The profile takes it off the link's per-call
       latency (never below 0), so no collective is priced below nothing.
    """
    extra, cap, dispatch_work_s, launch_work_s = fit_compute_terms(
        samples, [sample.compute_work_s - sample.view_nodes * view_op_s for sample in samples])
    share = (sum(sample.compute_work_s for sample in samples)
             / sum(sample.compute_work_s / sample.core_share for sample in samples))

    def compute_wall_s(sample: GraphSample) -> float:
        return (kernels_in_graph_s(sample, extra, cap) + sample.view_nodes * view_op_s
                + sample.kernel_nodes * dispatch_work_s
                + launch_work_s) / share

    synced = [sample for sample in samples if sample.collectives]
    entry_s, in_graph_s, per_compute = fit_wait_terms(
        [len(sample.collectives) for sample in synced], [sample.compute_s for sample in synced],
        [sample.seconds - sample.compute_s - link_s(sample) for sample in synced],
        per_compute_at_most=max(0.0, 1.0 - share))

    def waited_s(sample: GraphSample, compute_s: float) -> float:
        count = len(sample.collectives)
        return entry_s + count * in_graph_s + per_compute * compute_s if count else 0.0

    errors = [abs(compute_wall_s(sample) + link_s(sample) + waited_s(sample, compute_wall_s(sample)) - sample.seconds)
              / sample.seconds for sample in samples]
    return HostFit(dispatch_work_s / share, max(0.0, in_graph_s), launch_work_s / share, statistics.median(errors),
                   len(samples), share, min(0.0, in_graph_s), entry_s, per_compute, extra, cap)


KERNEL_EXTRA_AT_MOST = 3.0
"""Upper bound of the fitted ``kernel_extra_fraction`` (:func:`fit_compute_terms`): a fit that wants more
has samples the roofline does not describe, and the bound keeps one such calibration from pricing every
kernel several times over."""

KERNEL_EXTRA_CAPS_S = tuple(2.0**step * 1e-6 for step in range(0, 15))
"""The caps :func:`fit_compute_terms` tries: 1 us to 16 ms, a factor 2 apart."""

CAP_RESIDUAL_TOLERANCE = 1.02
"""Caps whose fit's residual (squared relative errors) is within this factor of the best count as equally
good; the smallest wins."""


def _extra_basis_s(sample: GraphSample, cap_s: float) -> float:
    """``sum(d * cap / (cap + d))`` over ``sample``'s kernels: its kernels' extra per unit of fraction."""
    kernels = sample.kernel_s or ((sample.device_s,) if sample.device_s > 0 else ())
    return sum(capped_kernel_s(d, cap_s) for d in kernels)


def kernels_in_graph_s(sample: GraphSample, extra: float, cap_s: float) -> float:
    """``sample``'s kernels' time in a graph: their roofline time plus ``extra * d * cap / (cap + d)`` each
    (:func:`~.compute.in_graph_kernel_s`)."""
    return sample.device_s + (extra * _extra_basis_s(sample, cap_s) if extra and cap_s else 0.0)


def fit_compute_terms(samples: Sequence[GraphSample], work_s: Sequence[float], *,
                      extra_columns: Sequence[Sequence[float]] | None = None) -> tuple[float, float, float, float]:
    """``(extra, cap, dispatch, call)`` of ``work ≈ sum over kernels of (d + extra * d * cap / (cap + d))
    + kernel_nodes * dispatch + call`` over ``samples`` (``work_s``: each graph's work without its views'
    dispatch; ``d``: a kernel's roofline time, :attr:`GraphSample.kernel_s`): for each cap of
    :data:`KERNEL_EXTRA_CAPS_S`, bounded least squares on relative error (each graph weighted
    ``1 / work``; ``extra`` in ``[0, KERNEL_EXTRA_AT_MOST]``, dispatch and call at least 0), and the
    smallest cap whose residual is within :data:`CAP_RESIDUAL_TOLERANCE` of the smallest residual.

    Why the extra: ``d`` is the roofline at rates timed on one op in a tight loop (its code, its
    inputs and weights hot in the caches); in a graph, every kernel follows others that evicted them.
    Fitted as a fixed cost per node alone, that was an average over the calibration graphs' kernels:
    graphs of 2 tokens came out over-predicted and graphs of 32 tokens 25-30% under (on this project's
    2-core VM, a GELU of 32 x 512 took 16 us in a loop, while ``linear -> GELU -> linear`` took 31 us
    longer than ``linear -> linear``). The extra grows with a kernel's size only up to the cap: large
    kernels stream their data from memory in the loop too (a slowdown of every kernel by one factor,
    fitted on small graphs, priced a Llama of hidden 1024 at 64 tokens and a GPT-2 of 768 at 128 tokens
    27-31% too slow, where the roofline alone was within 2%). ``extra_columns``: more non-negative
    unknowns per graph (a count of collectives), fitted and dropped. Without kernel time, no extra."""
    more = [list(columns) for columns in extra_columns] if extra_columns is not None else [[] for _ in samples]
    if not len(samples) == len(work_s) == len(more):
        raise ValueError(f"need one work and one row of extra columns per graph, got {len(samples)} graphs, "
                         f"{len(work_s)} works and {len(more)} rows")
    if not work_s or any(not work > 0 for work in work_s):
        raise ValueError(f"every graph's work must be > 0, got {list(work_s)}")
    weights = 1.0 / np.asarray(work_s, dtype=float)
    target = (np.asarray(work_s, dtype=float) - np.asarray([s.device_s for s in samples])) * weights
    fixed = np.asarray([[s.kernel_nodes, 1.0, *row] for s, row in zip(samples, more)])
    if not any(sample.device_s > 0 for sample in samples):
        solution = lsq_linear(fixed * weights[:, None], target, bounds=(0.0, np.inf), method="bvls").x
        return 0.0, 0.0, float(solution[0]), float(solution[1])
    fits = []
    for cap_s in KERNEL_EXTRA_CAPS_S:
        rows = np.column_stack([[_extra_basis_s(s, cap_s) for s in samples], fixed]) * weights[:, None]
        lower = np.zeros(rows.shape[1])
        upper = np.full(rows.shape[1], np.inf)
        upper[0] = KERNEL_EXTRA_AT_MOST
        solution = lsq_linear(rows, target, bounds=(lower, upper), method="bvls").x
        fits.append((float(np.sum((rows @ solution - target) ** 2)), cap_s, solution))
    # the residual is often flat along the curve (a small extra up to a large cap fits small graphs as well as
    # a large one up to a small cap): of the caps within 2% of the best, the smallest, which bounds what a
    # large kernel pays (one calibration of 42 took 0.63 up to 2 ms otherwise)
    least = min(residual for residual, _, _ in fits)
    _, cap_s, solution = next(fit for fit in fits if fit[0] <= least * CAP_RESIDUAL_TOLERANCE + 1e-18)
    fraction = float(solution[0])
    return fraction, cap_s if fraction > 0 else 0.0, float(solution[1]), float(solution[2])


WAIT_FIT_INLIER_ERROR = 0.1
"""Relative error up to which a graph counts about fully in the wait fit (:func:`fit_wait_terms`' Cauchy-loss
scale); far beyond it a graph counts little: one graph whose ranks lost a time slice should not move the
terms every model is priced with."""

WAIT_TERMS_MIN_GRAPHS = 4
"""Graphs with collectives needed to fit the wait's three terms (:func:`fit_wait_terms`); with fewer, the
wait per call and per collective alone (:func:`fit_wait_line`)."""


def fit_wait_terms(collectives: Sequence[int], compute_s: Sequence[float], waits_s: Sequence[float], *,
                   per_compute_at_most: float = math.inf) -> tuple[float, float, float]:
    """``(per call, per collective, per second of compute)``: the wait of graphs with collectives (each
    graph: its real form's time beyond its measured compute and its link) as
    ``per_call + collectives * per_collective + compute_s * per_compute``.

    Why three terms: the ranks enter a call out of step and the first collective pays that skew once
    (:func:`fit_wait_line`); between two collectives the ranks drift apart again, by a fixed amount
    (waking up a rank that slept in the previous collective) and by a share of the compute they do in
    between, since the longer a rank computes the likelier another process or rank takes its core
    for a time slice (under load, a graph's wait grew with its compute, not with its count of
    collectives). Summed over a call, that share applies to the compute before its last collective;
    the graphs here, like the models, do nearly all their compute before it, so their whole compute
    is the column.

    Bounded robust least squares on relative error (each graph weighted by ``1 / (compute + |wait|)``;
    Cauchy loss at the scale :data:`WAIT_FIT_INLIER_ERROR`, started from the plain least-squares solution):
    ``per_call`` and ``per_compute`` at least 0 (``per_compute`` at most ``per_compute_at_most``),
    ``per_collective`` of any sign (negative: collectives that take less in a graph than back to back,
    ``HostFit.link_base_adjust_s``). With fewer than :data:`WAIT_TERMS_MIN_GRAPHS` graphs,
    :func:`fit_wait_line` and no compute term."""
    if not len(collectives) == len(compute_s) == len(waits_s):
        raise ValueError(f"need one count, compute and wait per graph, got {len(collectives)}, {len(compute_s)} "
                         f"and {len(waits_s)}")
    graphs = [(count, compute, wait) for count, compute, wait in zip(collectives, compute_s, waits_s) if count > 0]
    if len(graphs) < WAIT_TERMS_MIN_GRAPHS:
        per_call, per_collective = fit_wait_line([g[0] for g in graphs], [g[2] for g in graphs])
        return per_call, per_collective, 0.0
    weights = np.asarray([1.0 / max(compute + abs(wait), 1e-9) for _, compute, wait in graphs])
    rows = np.asarray([[1.0, count, compute] for count, compute, _ in graphs]) * weights[:, None]
    target = np.asarray([wait for _, _, wait in graphs]) * weights
    if not per_compute_at_most >= 0.0:
        raise ValueError(f"per_compute_at_most must be >= 0, got {per_compute_at_most!r}")
    terms = 2 if per_compute_at_most == 0.0 else 3  # without a compute term (its bounds would meet)
    rows = rows[:, :terms]
    bounds = ([0.0, -np.inf, 0.0][:terms], [np.inf, np.inf, per_compute_at_most][:terms])
    start = lsq_linear(rows, target, bounds=bounds, method="bvls").x
    # a graph that lost a time slice waited far more than the line: the Cauchy loss counts it little
    robust = least_squares(lambda terms_: rows @ terms_ - target, np.clip(start, *bounds), bounds=bounds,
                           loss="cauchy", f_scale=WAIT_FIT_INLIER_ERROR, x_scale="jac").x
    per_call, per_collective = float(robust[0]), float(robust[1])
    return per_call, per_collective, float(robust[2]) if terms == 3 else 0.0


def fit_wait_line(collectives: Sequence[int], waits_s: Sequence[float]) -> tuple[float, float]:
    """``(per call, per collective)``: the line ``waits_s ≈ per_call + collectives * per_collective`` through
    what graphs with collectives waited (each graph: its real form's time beyond its measured compute and
    its link) against how many collectives each has.

    Why a line: the ranks enter a call out of step (they left the barrier before it at different
    times), and the first collective pays that skew once; every later one pays only the skew built
    up since the previous one. Pricing the whole wait per collective (the median of wait over
    count, as before) overprices a graph with many collectives and underprices one with a single
    collective (at tp 4 on two cores: 6 collectives priced at 6.7 ms that took about 4 ms, one
    priced at 1.1 ms that took 1.5 ms).

    Theil-Sen (median of the slopes between every two graphs with different counts, then the median
    intercept): one disturbed graph moves neither term, as the median over graphs did before. The
    per-call term is at least 0; when the line would need a negative one, the whole wait is priced per
    collective (the median of wait over count). The per-collective term may be negative (collectives
    that take less in a graph than back to back; ``HostFit.link_base_adjust_s``). Graphs that all have
    the same count cannot tell the two apart: all of it is priced per collective. ``(0.0, 0.0)``
    without graphs."""
    if len(collectives) != len(waits_s):
        raise ValueError(f"need one wait per graph, got {len(collectives)} counts and {len(waits_s)} waits")
    pairs = [(count, wait) for count, wait in zip(collectives, waits_s) if count > 0]
    if not pairs:
        return 0.0, 0.0
    per_collective_only = statistics.median(wait / count for count, wait in pairs)
    slopes = [(wait_b - wait_a) / (count_b - count_a)
              for (count_a, wait_a), (count_b, wait_b) in itertools.combinations(pairs, 2) if count_a != count_b]
    if not slopes:
        return 0.0, per_collective_only
    slope = statistics.median(slopes)
    intercept = statistics.median(wait - count * slope for count, wait in pairs)
    if intercept <= 0:
        return 0.0, per_collective_only
    return intercept, slope


def _fit_wall_terms(samples: Sequence[GraphSample], view_op_s: float, link_s: Callable[[GraphSample], float],
                    with_collectives: bool) -> HostFit:
    """The three host terms by one non-negative least-squares fit on wall time (relative error)."""
    rows, target, known = [], [], []
    for sample in samples:
        known_s = sample.device_s + sample.view_nodes * view_op_s + link_s(sample)
        weight = 1.0 / sample.seconds
        row = [sample.kernel_nodes * weight, weight]
        if with_collectives:
            row.append(len(sample.collectives) * weight)
        rows.append(row)
        target.append((sample.seconds - known_s) * weight)
        known.append(known_s)
    solution, _ = nnls(np.asarray(rows), np.asarray(target))
    dispatch_s, launch_s = float(solution[0]), float(solution[1])
    wait_s = float(solution[2]) if with_collectives else 0.0
    errors = [
        abs(known_s + sample.kernel_nodes * dispatch_s + launch_s + len(sample.collectives) * wait_s - sample.seconds)
        / sample.seconds
        for sample, known_s in zip(samples, known)
    ]
    return HostFit(dispatch_s, wait_s, launch_s, statistics.median(errors), len(samples))


def _device_only(hardware: Hardware) -> Hardware:
    """``hardware`` with its host terms off: what the kernels alone cost."""
    return dataclasses.replace(hardware, host_dispatch_s=0.0, graph_launch_s=0.0, collective_wait_s=0.0,
                               kernel_extra_fraction=0.0)


# ------------------------------------------------------------------------------ single ops

def work_clock() -> Callable[[], float]:
    """The clock that times this process's own work: the calling thread's CPU time when torch runs
    one thread (a rank descheduled by other processes then loses no time: the op's cost, not the
    machine's load, is measured; :func:`graph_sample` measures the share of a core a rank gets
    separately), else the wall clock (CPU time of one thread would miss torch's other threads)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def median_work_s(run: Callable[[], Any], min_time_s: float, repeats: int) -> float:
    """Median seconds of work per call of ``run`` (:func:`work_clock`), each timed repeat looping
    for at least ``min_time_s``."""
    clock = work_clock()
    run()
    start = clock()
    run()
    calls = max(1, math.ceil(min_time_s / max(clock() - start, 1e-9)))
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            run()
        samples.append((clock() - start) / calls)
    return statistics.median(samples)


COLD_WEIGHT_BYTES = 64 * 2**20
"""Bytes of distinct weights a GEMM sample cycles through: more than a CPU's last-level cache, so
each call reads its weight from memory, as a model's forward does (it reads each weight once per
call, long after the previous call evicted it); a weight reused in a tight loop stays in cache
and runs up to twice as fast as the same GEMM in a graph."""


def _linear_on_next(x: torch.Tensor, weights: Iterator[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    return aten.linear.default(x, next(weights), bias)


def measure_gemm_samples(width: int, tokens: Sequence[int], min_time_s: float, repeats: int) -> list[GemmSample]:
    """``aten.linear`` of ``(m, width) @ (width, width)^T + bias`` for each ``m`` in ``tokens``
    (float32), each call on the next of enough distinct weights that none is in cache
    (:data:`COLD_WEIGHT_BYTES`)."""
    generator = torch.Generator().manual_seed(0)
    copies = max(1, COLD_WEIGHT_BYTES // (width * width * 4))
    weights = torch.full((copies, width, width), 1.0 / width).unbind(0)  # values do not change a GEMM's time
    bias = torch.randn(width, generator=generator)
    samples = []
    for m in tokens:
        x = torch.randn(m, width, generator=generator)
        seconds = median_work_s(functools.partial(_linear_on_next, x, itertools.cycle(weights), bias), min_time_s,
                                repeats)
        samples.append(GemmSample(m, width, width, seconds))
    return samples


_TRANSCENDENTAL = (aten.exp.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.gelu.default)


def roofline_of_call_s(op: Any, args: Sequence[Any], kwargs: dict[str, Any], result: torch.Tensor,
                       hardware: Hardware) -> float:
    """The roofline seconds ``hardware`` prices one call of ``op`` at (its FLOPs, bytes, GEMM shape and
    transcendental elements; no op family's fixed cost), from its real arguments and result."""
    flops = aten_flops(op, args, kwargs, result)
    dims = gemm_dims(op, args, kwargs) if flops else None
    elements = result.numel() if is_transcendental(op) else 0
    return compute_time_s(flops, aten_memory_bytes(op, args, kwargs, result), result.dtype, hardware,
                          gemm_min_dim=min(dims) if dims else None, transcendental_elements=elements)


def _op_family_instances() -> dict[str, tuple[Any, tuple]]:
    """One small call per :data:`~.compute.OP_FAMILIES` entry, as an exported graph calls it: ``(op, args)``."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 8, 8, 8, generator=generator)
    ones, zeros = torch.ones(8), torch.zeros(8)
    heads = torch.randn(1, 1, 4, 16, generator=generator)
    return {
        "convolution": (aten.conv2d.default, (images, torch.randn(8, 8, 3, 3, generator=generator), None, [1, 1],
                                              [1, 1], [1, 1], 1)),
        "pooling": (aten.max_pool2d.default, (images, [2, 2], [2, 2])),
        "batch_norm": (aten.batch_norm.default, (images, ones, zeros, zeros, ones, False, 0.1, 1e-5, True)),
        "attention": (aten.scaled_dot_product_attention.default, (heads, heads, heads)),
    }


def measure_op_fixed_s(hardware: Hardware, min_time_s: float, repeats: int) -> tuple[tuple[str, float], ...]:
    """``(family, seconds)`` per :data:`~.compute.OP_FAMILIES` entry: what a small call of the family costs in a
    tight loop (:func:`median_work_s`) beyond its roofline on ``hardware``, less what an add of its first input
    costs beyond its own (a plain kernel's fixed cost, which the fitted dispatch prices); at least 0.

    Why: some library kernels set up a primitive or a plan on every call, whatever their size; on this project's
    2-core VM a convolution of 8 channels on 8 x 8 took 41 us in a loop where an add of the same tensor took 1.5 us,
    and a CNN was predicted 51-67% low without it."""
    fixed = []
    for family, (op, args) in _op_family_instances().items():
        reference = args[0]
        excess = []
        for call, call_args in ((op, args), (aten.add.Tensor, (reference, reference))):
            result = call(*call_args)
            result = result[0] if isinstance(result, tuple) else result
            excess.append(median_work_s(functools.partial(call, *call_args), min_time_s, repeats)
                          - roofline_of_call_s(call, call_args, {}, result, hardware))
        fixed.append((family, max(0.0, excess[0] - excess[1])))
    return tuple(fixed)


def measure_transcendental_element_s(numel: int, min_time_s: float, repeats: int) -> float:
    """Seconds per element of exp, tanh, sigmoid, silu and gelu on ``numel`` float32 values (median)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return statistics.median(median_work_s(functools.partial(op, x), min_time_s, repeats) / numel
                             for op in _TRANSCENDENTAL)


# ------------------------------------------------------------------------------ calls on every rank

def ranks_share_a_clock() -> bool:
    """Whether every rank of the current process group runs under one kernel (the same host and boot), so
    that their ``time.perf_counter()`` readings (``CLOCK_MONOTONIC`` on Linux) are on one time line; True
    without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    from autotp.runtime.shared_memory import host_identity

    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, host_identity())
    return all(identity == identities[0] for identity in identities)


COMMON_START_LEAD_S = 3e-3
"""How far ahead of now rank 0 names the moment every rank starts a timed call (:func:`common_start`): longer
than gloo takes to deliver the broadcast to a rank that was asleep in the barrier before it (up to 0.8 ms)."""
_SPIN_S = 5e-4  # the last stretch before the common moment is spun, not slept: a sleep overshoots by ~0.1 ms


def common_start(share_a_clock: bool) -> float:
    """Wait for every rank of the current process group, then until one moment on every rank, and return it (this
    rank's ``time.perf_counter()``; without a process group, now).

    After a barrier rank 0 names a moment :data:`COMMON_START_LEAD_S` ahead and broadcasts it; each rank sleeps
    until just before it and spins to it. Ranks that do not share a clock (:func:`ranks_share_a_clock`) leave the
    barrier and return their own now.

    Why: a barrier alone releases the ranks up to 0.8 ms apart (gloo wakes a rank asleep in its TCP wait late;
    measured at tp 2 on two idle cores), and where ranks outnumber cores, a rank that waits for a core leaves the
    barrier only once it has one, so timed from its own start it never counts that wait. Released at one moment,
    every rank is ready together, and the call's time on the group (:func:`group_call_s`) counts what the ranks
    really share: cores, and each other's pace in the collectives."""
    if not dist.is_initialized():
        return time.perf_counter()
    dist.barrier()
    if not share_a_clock:
        return time.perf_counter()
    moment = torch.tensor([time.perf_counter() + COMMON_START_LEAD_S if dist.get_rank() == 0 else 0.0],
                          dtype=torch.float64)
    dist.broadcast(moment, src=0)
    start = float(moment)
    asleep = start - _SPIN_S - time.perf_counter()
    if asleep > 0:
        time.sleep(asleep)
    while time.perf_counter() < start:
        pass
    return start


def group_call_s(starts: Sequence[float], ends: Sequence[float], *, share_a_clock: bool) -> list[float]:
    """Per run, the seconds of one call on the current process group, from this rank's ``time.perf_counter()``
    readings at the start and end of each run's call (call it on every rank, with the same number of runs;
    without a process group, this rank's own times).

    On one clock (:func:`ranks_share_a_clock`; the starts from :func:`common_start`, one moment on every rank):
    from the first start to the last end, the time the group takes to have the call's result on every rank,
    whether or not its ranks meet in collectives. On separate clocks: the slowest rank's own time."""
    if len(starts) != len(ends):
        raise ValueError(f"need one end per start, got {len(starts)} starts and {len(ends)} ends")
    if not dist.is_initialized():
        return [end - start for start, end in zip(starts, ends)]
    if not share_a_clock:
        own = torch.tensor([end - start for start, end in zip(starts, ends)], dtype=torch.float64)
        dist.all_reduce(own, op=dist.ReduceOp.MAX)
        return own.tolist()
    first = torch.tensor([-start for start in starts], dtype=torch.float64)
    last = torch.tensor(list(ends), dtype=torch.float64)
    both = torch.stack([first, last])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return (both[1] + both[0]).tolist()


# ------------------------------------------------------------------------------ graphs

GRAPH_FAMILIES = ("llama", "gpt", "mlp")
"""Op mixes of the calibration graphs, as the rewrite emits them for HuggingFace models: ``"llama"``
and ``"gpt"`` open with the prologue a traced model runs before its first block (position ids from
``arange``, a causal mask built by comparing them, a position-embedding lookup, dtype casts);
``"llama"`` blocks have RMSNorm, bias-free projections, rotary embeddings (slices, ``neg``, ``cat``),
causal SDPA and a SiLU-gated MLP, two all-reduces each; ``"gpt"`` blocks have LayerNorm, projections
with bias, SDPA with a mask tensor and a GELU MLP, two all-reduces each. Every op kind the fitted
dispatch prices in a real graph is in them. ``"mlp"`` blocks are a feed-forward layer alone
(Linear, GELU, Linear, as a Megatron MLP splits it: one all-reduce each, no prologue): graphs of one
and three collectives, so that the wait a call pays once is told apart from the wait per collective
(with two per block, every count is even)."""


def block_graph(shape: GraphShape, world_size: int, group_name: str | None) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    """A rank-local graph of ``shape.layers`` blocks of ``shape.family`` split over ``world_size``
    ranks (heads and MLP columns split, an all-reduce after the output and down projections when
    ``world_size > 1``), built from the ATen ops the rewrite emits; and an input for it."""
    heads = max(1, shape.heads // world_size)
    head_dim = max(2, shape.hidden // shape.heads // 2 * 2)  # even: rotary halves it
    local = heads * head_dim  # (tokens, local) after a column-split projection
    tokens, hidden, gpt = shape.tokens, shape.hidden, shape.family == "gpt"
    biased = shape.family != "llama"
    generator = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")  # (1, tokens, hidden)
    counter = iter(range(10**6))

    def parameter(*size: int) -> torch.fx.Node:
        name = f"p{next(counter)}"
        root.register_buffer(name, torch.randn(*size, generator=generator) / math.sqrt(size[-1]))
        return graph.get_attr(name)

    def call(op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return graph.call_function(op, args, kwargs)

    def norm(value: torch.fx.Node) -> torch.fx.Node:
        if gpt:
            return call(aten.layer_norm.default, value, [hidden], parameter(hidden), parameter(hidden), 1e-5)
        squared = call(aten.pow.Tensor_Scalar, value, 2)
        mean = call(aten.mean.dim, squared, [-1], True)
        inverse = call(aten.rsqrt.default, call(aten.add.Tensor, mean, 1e-6))
        return call(aten.mul.Tensor, call(aten.mul.Tensor, value, inverse), parameter(hidden))

    def linear(value: torch.fx.Node, out_features: int, in_features: int) -> torch.fx.Node:
        bias = (parameter(out_features),) if biased else ()
        return call(aten.linear.default, value, parameter(out_features, in_features), *bias)

    def all_reduce(value: torch.fx.Node) -> torch.fx.Node:
        if world_size == 1 or not shape.collectives:
            return value
        return call(c10d.wait_tensor.default, call(c10d.all_reduce.default, value, "sum", group_name))

    def heads_first(value: torch.fx.Node) -> torch.fx.Node:  # (1, tokens, local) -> (1, heads, tokens, head_dim)
        return call(aten.transpose.int, call(aten.view.default, value, [1, tokens, heads, head_dim]), 1, 2)

    def rotary(value: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node) -> torch.fx.Node:
        half = head_dim // 2
        first = call(aten.slice.Tensor, value, 3, 0, half)
        second = call(aten.slice.Tensor, value, 3, half, head_dim)
        rotated = call(aten.cat.default, [call(aten.neg.default, second), first], -1)
        return call(aten.add.Tensor, call(aten.mul.Tensor, value, cos), call(aten.mul.Tensor, rotated, sin))

    if shape.layers == 0:  # the call of a graph and little else: pins the per-call term of the fit
        graph.output(norm(x))
        return torch.fx.GraphModule(root, graph), torch.randn(1, tokens, hidden, generator=generator)
    if shape.family == "mlp":
        for _ in range(shape.layers):
            x = all_reduce(linear(call(aten.gelu.default, linear(x, 4 * local, hidden)), hidden, 4 * local))
        graph.output(x)
        return torch.fx.GraphModule(root, graph), torch.randn(1, tokens, hidden, generator=generator)
    # the prologue: positions, a causal mask from them, a position-embedding lookup, casts
    positions = call(aten.arange.start, 0, tokens, device=torch.device("cpu"), pin_memory=False)
    rows = call(aten.unsqueeze.default, positions, 1)
    columns = call(aten.unsqueeze.default, positions, 0)
    mask = call(aten.view.default, call(aten.le.Tensor, columns, rows), [1, 1, tokens, tokens])
    table = parameter(max(tokens, 64), hidden)
    looked_up = call(aten.embedding.default, table, call(aten.unsqueeze.default, positions, 0))
    x = call(aten.add.Tensor, x, call(aten._to_copy.default, looked_up, dtype=torch.float32))
    angles = call(aten.mul.Tensor, call(aten._to_copy.default, rows, dtype=torch.float32), parameter(head_dim))
    cos, sin = call(aten.cos.default, angles), call(aten.sin.default, angles)

    for _ in range(shape.layers):
        normed = norm(x)
        q, k, v = (heads_first(linear(normed, local, hidden)) for _ in range(3))
        if gpt:
            attention = call(aten.scaled_dot_product_attention.default, q, k, v, mask)
        else:
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            attention = call(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True)
        merged = call(aten.view.default, call(aten.clone.default, call(aten.transpose.int, attention, 1, 2)),
                      [1, tokens, local])
        x = call(aten.add.Tensor, x, all_reduce(linear(merged, hidden, local)))
        normed = norm(x)
        if gpt:
            inner = call(aten.gelu.default, linear(normed, 4 * local, hidden))
            down = linear(inner, hidden, 4 * local)
        else:
            gate = call(aten.silu.default, linear(normed, 2 * local, hidden))
            down = linear(call(aten.mul.Tensor, gate, linear(normed, 2 * local, hidden)), hidden, 2 * local)
        x = call(aten.add.Tensor, x, all_reduce(down))
    graph.output(norm(x))
    example = torch.randn(1, tokens, hidden, generator=generator)
    return torch.fx.GraphModule(root, graph), example


def _inference_kind(target: Any) -> str | None:
    """The kind of one of the runtime's inference collectives (one-shot or shared-memory all-reduce,
    shared-memory all-gather: :mod:`autotp.passes.small_collectives`), else None."""
    from autotp.passes.small_collectives import inference_collective_kind

    return inference_collective_kind(target)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph once, pricing each node's kernel on a profile with no host terms."""

    def __init__(self, module: torch.fx.GraphModule, hardware: Hardware) -> None:
        super().__init__(module)
        self.hardware = _device_only(hardware)
        self.kernel_nodes = self.view_nodes = 0
        self.device_s = 0.0
        self.kernel_s: list[float] = []
        self.collectives: list[tuple[str, int, int]] = []

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        if node.op != "call_function":
            return result
        if node.target is c10d.wait_tensor.default:
            return result
        if node.target is c10d.all_reduce.default or _inference_kind(node.target) == "all_reduce":
            self.collectives.append(("all_reduce", result.numel() * result.element_size(), dist.get_world_size()))
            return result
        if launches_no_kernel(node.target):
            self.view_nodes += 1
            return result
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        self.kernel_nodes += 1
        seconds = roofline_of_call_s(node.target, args, kwargs, result, self.hardware)
        family = op_family(node.target)
        # an op family's fixed cost is priced as measured, beside the kernel's extra (which it does not scale)
        self.device_s += seconds + (self.hardware.op_fixed_cost_s(family) if family is not None else 0.0)
        self.kernel_s.append(seconds)
        return result


def _same(tensor: torch.Tensor, *_: Any) -> torch.Tensor:
    """Stand-in of a collective whose output has its input's shape (all-reduce, all-to-all of even
    splits, broadcast) and of ``wait_tensor``: the input itself."""
    return tensor


def _gathered(tensor: torch.Tensor, group_size: int, *_: Any) -> torch.Tensor:
    """Stand-in of ``all_gather_into_tensor``: ``group_size`` copies along dim 0 (the output's shape)."""
    return tensor.repeat(group_size, *[1] * (tensor.dim() - 1))


def _scattered(tensor: torch.Tensor, op: str, group_size: int, *_: Any) -> torch.Tensor:
    """Stand-in of ``reduce_scatter_tensor``: this rank's block of dim 0 (the output's shape)."""
    return tensor.narrow(0, 0, tensor.shape[0] // group_size)


def _stand_in_of(target: Any) -> Callable[..., torch.Tensor] | None:
    """The local stand-in of a collective op of a rank-local graph, or None for any other op."""
    if target is c10d.all_gather_into_tensor.default:
        return _gathered
    if target is c10d.reduce_scatter_tensor.default:
        return _scattered
    if target in (c10d.all_reduce.default, c10d.all_to_all_single.default, c10d.broadcast.default,
                  c10d.wait_tensor.default) or _inference_kind(target) == "all_reduce":
        return _same
    if _inference_kind(target) == "all_gather":  # the shared-memory all-gather: its world size is its own
        return lambda tensor: _gathered(tensor, target.world_size)
    return None


def local_stand_ins(module: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``module`` whose collectives (and their waits) are local stand-ins of their outputs'
    shapes, or None when it has none: the graph's *compute*, as the cost model prices it.

    The copy shares ``module``'s parameters and buffers and is compiled once, so that timing it in
    turn with ``module`` recompiles neither (a freshly generated ``forward`` runs 5-20% slower on
    its first calls). The values are wrong wherever a collective would have combined ranks; the
    shapes, and so the kernels and their times, are those of the real graph.
    """
    if not any(node.op == "call_function" and _stand_in_of(node.target) is not None for node in module.graph.nodes):
        return None
    graph = torch.fx.Graph()
    graph._codegen = module.graph._codegen  # the same calling convention (flat inputs, pytree outputs)
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        stand_in = _stand_in_of(node.target) if node.op == "call_function" else None
        if stand_in is not None:
            node.target = stand_in
    return torch.fx.GraphModule(module, graph)


def graph_sample(module: torch.fx.GraphModule, example: torch.Tensor, hardware: Hardware, runs: int,
                 warmup: int = 3) -> GraphSample:
    """:func:`graph_samples` of one graph."""
    return graph_samples([(module, example, hardware)], runs, warmup)[0]


def graph_samples(graphs: Sequence[tuple[torch.fx.GraphModule, torch.Tensor, Hardware]], runs: int,
                  warmup: int = 3) -> tuple[GraphSample, ...]:
    """Time each ``module(example)`` ``runs`` times, and in turn with it its compute form
    (:func:`local_stand_ins`) when it has collectives (:func:`time_in_turn`: each call after one
    untimed call of itself, from a start common to every rank to the last rank's end); and count what
    the cost model sees in each, its kernels priced on its own ``hardware``.

    Each graph is timed on its own, as a model runs the same graph call after call (and as the
    accuracy benchmark times one): graphs that took turns within every run measured twice the wait
    (a 3-block GPT graph with 6 all-reduces at tp 2 on two cores: 0.64-0.79 ms taking turns with
    the eight other quick-calibration graphs, 0.31-0.38 ms alone, 0.23-0.45 ms in the benchmark's
    harness, while its compute form measured the same either way), although each call came after an
    untimed call of itself.
    :func:`fit_host_terms` weighs the graphs robustly, so a change of load during one graph's runs
    does not set the terms."""
    samples = []
    share_a_clock = ranks_share_a_clock()  # a property of the group: asked once, not per graph
    with torch.no_grad():
        for module, example, hardware in graphs:
            recorder = _Recorder(module, hardware)
            recorder.run(example)
            compute_module = local_stand_ins(module)
            forms = [module] if compute_module is None else [module, compute_module]
            timed = time_in_turn([functools.partial(form, example) for form in forms], runs, warmup,
                                 share_a_clock=share_a_clock)
            # the share as the benchmark measures a forward: median work over the median of the group's
            # wall times (a sum over runs would let one run paused for a whole time slice under
            # load set the share of every graph; fit_host_terms weighs the graphs by their time, so the
            # longest, most like a forward, count most, and fair_core_share bounds the short ones)
            (seconds, work_s), (compute_s, compute_work_s) = timed[0], timed[-1]
            share = compute_work_s / compute_s if compute_s > 0 else 1.0
            samples.append(GraphSample(recorder.kernel_nodes, recorder.view_nodes, recorder.device_s,
                                       tuple(recorder.collectives), seconds, work_s, min(share, fair_core_share()),
                                       compute_s, compute_work_s, kernel_s=tuple(recorder.kernel_s)))
    return tuple(samples)


def time_in_turn(calls: Sequence[Callable[[], Any]], runs: int, warmup: int = 3, *,
                 share_a_clock: bool | None = None) -> list[tuple[float, float]]:
    """Per call: the median over ``runs`` of its seconds on the group (:func:`group_call_s`: from the moment
    every rank started it, :func:`common_start`, to the moment the last rank finished it) and the median of
    this rank's work per call (:func:`work_clock`). ``share_a_clock``: :func:`ranks_share_a_clock`'s answer
    when the caller has it (None: asked here).

    Call it on every rank of the current process group at once (or without one). The calls take turns
    within every run, so a change of load hits all of them alike (a graph's real and compute form,
    three plans of one model). Each timed call comes after one untimed call of itself, then a common start:
    timed in steady state, its caches holding its own tensors as they do call after call, and not right
    after another call's collectives (a rank that slept in them gave its core away, and the compute
    that follows waits to get it back: at tp 2 on a busy two-core machine, a compute form timed right
    after its real form got half a core, one timed after itself 0.9-0.97; that wait is caused by the
    collectives, so it belongs to what they add, not to the compute).

    A call whose ranks never meet counts to its slowest rank's end from the common start, as one with
    collectives does: four ranks on two cores each take the half core they share (timed on its own clock, a
    rank that waited for a core before it left the barrier did not count the wait, and the MLP unsplit at tp 4
    measured 0.58-0.92 ms against 1.7 ms of the four ranks' work on two cores)."""
    clock = work_clock()
    if share_a_clock is None:
        share_a_clock = ranks_share_a_clock()
    starts: list[list[float]] = [[] for _ in calls]
    ends: list[list[float]] = [[] for _ in calls]
    work: list[list[float]] = [[] for _ in calls]
    with torch.no_grad():
        for call in calls:
            for _ in range(warmup):
                call()
        for _ in range(runs):
            for index, call in enumerate(calls):
                call()
                start = common_start(share_a_clock)
                start_work = clock()
                call()
                work[index].append(clock() - start_work)
                ends[index].append(time.perf_counter())
                starts[index].append(start)
    return [(statistics.median(group_call_s(starts[index], ends[index], share_a_clock=share_a_clock)),
             statistics.median(work[index])) for index in range(len(calls))]


_GRAPH_TIMEOUT_S = 300.0  # how long a rank waits for the others in a calibration graph's all-reduce


def fair_core_share() -> float:
    """The most of a core one rank can get while every rank computes: the cores this process may
    run on over the threads of all ranks (``min(1, cores / (ranks * threads))``; 1/2 for four
    single-thread ranks on two cores).

    A physical bound on :attr:`GraphSample.core_share`: the slowest of N ranks that start
    together cannot finish before their work together has run on the cores, so its own work over
    its wall time is at most this. A short graph that one rank happens to run within one time
    slice, before the others get the core, would otherwise measure more (up to 1) and price the
    forward, which is paused, as if it were not.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return min(1.0, cores / (ranks * torch.get_num_threads()))


def measure_graphs(shapes: Sequence[GraphShape], hardware: Hardware, runs: int) -> tuple[GraphSample, ...]:
    """One :class:`GraphSample` per shape, on every rank of the current process group (or alone)."""
    from autotp.passes.small_collectives import inference_all_reduces

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    group_name = dist.group.WORLD.group_name if dist.is_initialized() and dist.group.WORLD is not None else None
    graphs, whole = [], []
    for shape in shapes:
        module, example = block_graph(shape, world_size, group_name)
        # as autotp.compile runs an inference graph: through shared memory on one host, else one-shot (tp > 2)
        module = inference_all_reduces(module, None, world_size, timeout_s=_GRAPH_TIMEOUT_S)
        # its kernels priced at the bandwidth of its own working set (weights and input), as the cost pass does
        weights = sum(t.numel() * t.element_size() for t in module.buffers())
        graphs.append((module, example, at_working_set(hardware, weights + example.numel() * example.element_size())))
        # the cost pass sizes a model's graph with its tensors held whole: its weights on every rank together
        whole.append(weights * world_size + example.numel() * example.element_size())
    return tuple(dataclasses.replace(sample, working_set_bytes=size)
                 for sample, size in zip(graph_samples(graphs, runs), whole))
