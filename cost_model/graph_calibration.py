"""Fitting the cost model the way graphs run: shape-dependent GEMM rates, and the host and collective
terms fitted over whole rank-local graphs (the samples are measured by :mod:`autotp.calibration.graphs`,
which runs graphs on a process group; this module only fits them).

An op timed alone in a tight loop runs with warm caches and a warm dispatch path; the same op in a
graph of two hundred different ops, on real-size tensors, costs several times more on the host,
and a collective in a graph waits for the slowest rank, which a collective timed back to back
(ranks already in step) never does. So the per-node and per-collective terms are not measured on
one op: :func:`~autotp.calibration.graphs.measure_graphs` builds rank-local graphs with the op mix of the graphs the rewrite
emits for HuggingFace models (:data:`GRAPH_FAMILIES`: the prologue of position ids, causal mask and
lookups; Llama-like and GPT-like blocks; feed-forward blocks alone; an all-reduce after each
row-split projection) at several depths, widths and token counts, and one graph of a single norm
(the call of a graph and little else); runs each by calling its ``GraphModule`` (what
``TensorParallelModule`` does), one graph at a time, each call after an untimed call of itself and
a common start on every rank (:func:`~autotp.calibration.graphs.time_in_turn`), timing it on the wall clock (from the moment every
rank started it to the moment the last finished it, :func:`~autotp.calibration.graphs.common_start`, :func:`~autotp.calibration.graphs.group_call_s`)
and on the work clock (:func:`~autotp.calibration.graphs.work_clock`: the rank's own CPU time); times a graph with collectives
also in its *compute form* (:func:`~autotp.calibration.graphs.local_stand_ins`: every collective replaced by a local op of its
output's shape, in turn with the real form); and :func:`fit_host_terms` fits

    compute_work_s = in_graph_scale * (device_s + view_nodes * view_op_s + kernel_nodes * kernel_floor_s)
    compute_s = compute_work_s / core_share + core_share_call_s   (the share up to the graphs' longest
                                                                   compute; beyond, the fair share)
    seconds   = compute_s + link_s + collectives * collective_wait_s
                + call_sync_wait_s + call_sync_wait_per_compute * compute_s   (with collectives)

where ``device_s`` is the roofline time of the graph's kernels and their op families' fixed costs
(:func:`~.compute.compute_time_s` with no host term and no per-kernel floor), ``view_op_s`` and
``kernel_floor_s`` what a view and a tiny kernel cost in a chain timed in a loop, ``in_graph_scale`` how much
more the same work costs in a graph of many different ops (:func:`fit_in_graph_scale`: one number, at least 1,
by which the profile scales every single-op price and charges the floor as each kernel node's dispatch; the
calibrated profile sets ``kernel_floor_s`` itself to 0), ``link_s`` the alpha-beta time of its
collectives on the link fitted back to back, and ``core_share`` the share of a core a rank gets
while computing: its median work over the median of the group's wall times in the compute
forms of all graphs, each graph weighing by its time
(about 1/2 for four single-thread ranks on two idle cores, at most ``cores / (ranks * threads)``,
:func:`~autotp.calibration.graphs.fair_core_share`). What the fit adds is what a graph costs beyond its kernels and its
link: the scale of its single-op prices, and the wait for the slowest rank,
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
* :func:`~autotp.calibration.graphs.measure_element_rates`: seconds per element of exp, tanh, sigmoid, silu and
  gelu on a large tensor, the median over them; and each transcendental and pooling op's own rate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.optimize import least_squares, lsq_linear, nnls  # type: ignore[import-untyped]

from .bandwidth import cold_call_at_s
from .collective_forms import FORM_TABLE, CollectiveForm
from .collectives import link_collective_time_s
from .compute import compute_time_s
from .hardware import Hardware, LinkProfile, shared_core_compute_s

__all__ = [
    "COLD_WEIGHT_BYTES",
    "GRAPH_FAMILIES",
    "GemmFit",
    "GemmSample",
    "GraphSample",
    "GraphShape",
    "HostFit",
    "device_only",
    "fit_core_share",
    "fit_gemm_curve",
    "fit_host_terms",
    "fit_in_graph_scale",
    "fit_wait_line",
    "fit_wait_terms",
    "graph_link_s",
    "priced_work_s",
]


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
    common to every rank to the last rank's end: :func:`~autotp.calibration.graphs.group_call_s`);
    ``work_s``: median over runs of this rank's own work per call (:func:`~autotp.calibration.graphs.work_clock`; 0.0: not
    measured).

    The graph's *compute* is measured as the accuracy benchmark measures a model's: the same
    graph with every collective replaced by a local stand-in of its output's shape
    (:func:`~autotp.calibration.graphs.local_stand_ins`), timed in turn with the real one. ``compute_s``: median over runs of
    that form's time on the group; ``compute_work_s``: median of this rank's work in
    it (both equal ``seconds`` and ``work_s`` for a graph without collectives; 0.0: not measured,
    older samples). ``core_share``: ``compute_work_s / compute_s`` (medians, as the benchmark times a
    forward), at most :func:`~autotp.calibration.graphs.fair_core_share`: the share of a core a rank gets *while computing* (1.0 alone on an idle
    core; 1/2 with four single-thread ranks on two cores; lower when other processes load the
    machine); the time a rank waits in a collective is not in it. ``working_set_bytes``: the bytes the
    cost pass would size this graph's model at (``bandwidth.graph_working_set_bytes``: its tensors held
    whole), at which a shared-memory collective's cold-cache cost is resolved (:func:`graph_link_s`;
    0: not recorded, no cold cost). ``kernel_s``: each kernel node's roofline time (they sum to
    ``device_s`` less the op families' fixed costs, ``Hardware.op_fixed_s``; empty: not recorded), for
    diagnosing a fit by kernel size.
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
    ``call_sync_wait_compute_range_s``: the largest compute of the graphs that fit saw, beyond which a call's
    compute adds no wait (0.0: no bound; :attr:`~autotp.cost_model.hardware.Hardware.call_sync_wait_compute_range_s`);
    ``in_graph_scale``: the graphs' work over what their single ops price (:func:`fit_in_graph_scale`), by which
    the profile scales every single-op price (``host_dispatch_s`` is the floor scaled by it, and by the share);
    ``core_share_range_s``: the longest compute of the graphs the share was measured on, beyond which a call's
    compute runs at ``fair_core_share`` (0.0: no range, a share at the fair one or the fair one not recorded;
    :attr:`~autotp.cost_model.hardware.Hardware.core_share_range_s`); ``core_share_call_s``: the wall time a call
    loses once to ranks taking turns on shared cores (:func:`fit_core_share`)."""

    host_dispatch_s: float
    collective_wait_s: float
    graph_launch_s: float
    median_abs_rel_error: float
    samples: int
    core_share: float = 1.0
    link_base_adjust_s: float = 0.0
    call_sync_wait_s: float = 0.0
    call_sync_wait_per_compute: float = 0.0
    in_graph_scale: float = 1.0
    call_sync_wait_compute_range_s: float = 0.0
    core_share_range_s: float = 0.0
    fair_core_share: float = 1.0
    core_share_call_s: float = 0.0


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
    device = device_only(hardware)
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
                   shared_memory_cold_curve: Sequence[tuple[float, float]] = (),
                   kernel_floor_s: float = 0.0, fair_core_share: float | None = None) -> HostFit:
    """Fit the scale of the graphs' single-op prices, the share of a core and the waits (module docstring).

    ``shared_memory_link``: the graphs' all-reduces ran through shared memory (``measure_graphs`` on
    ranks of one host) and are priced on it, with the cold-cache cost of ``shared_memory_cold_curve``
    (``Hardware.shared_memory_cold_curve``) as a model's collectives are; None: small ones ran in one
    round (one-shot form).

    ``view_op_s`` (measured on a chain of views) prices the view nodes; ``link`` (fitted back to
    back) prices the collectives' alpha-beta time, and may be None when no sample has one.
    ``kernel_floor_s``: a tiny kernel's cost in a chain timed in a loop, each kernel node's dispatch before the
    scale (:func:`fit_in_graph_scale`). ``fair_core_share``: the most of a core a rank can get while every rank
    computes (:func:`~autotp.calibration.graphs.fair_core_share`), at which compute beyond the graphs' longest
    runs (None: not recorded, the share holds for any compute). Raises ValueError with fewer samples than unknowns.

    When the samples carry their own work (``work_s``, timed on the work clock like the single
    ops whose rates price ``device_s``), the fit has three steps, each on what it can see:

    1. the scale of the single-op prices in a graph (:func:`fit_in_graph_scale`) over the work of the graphs
       without collectives (a collective's host work of issuing and waiting belongs to the wait below), of
       every graph if none is without;
    2. the share of a core a rank gets (:attr:`GraphSample.core_share`) over the graphs without
       collectives together (their total work over their total wall time): every work term
       becomes wall time divided by it (the returned dispatch, and :func:`~.calibrate.build_profile` the
       kernel rates);
    3. the wait per collective: the median over the graphs with collectives of what their
       slowest rank's wall time has beyond their predicted kernels, nodes and link, per
       collective, at least 0 (a median over graphs does not swing with one disturbed run).

    When the samples also carry their compute (``compute_work_s``, ``compute_s``: the graph with
    its collectives replaced by local stand-ins, :func:`~autotp.calibration.graphs.graph_sample`), compute and communication
    are fitted on what each of them is, so that the predicted split means what the measured one
    does (:func:`_fit_compute_then_wait`). Without ``work_s`` (older samples), one least-squares
    fit of a dispatch per node, a call and a wait per collective on wall time.
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
        return _fit_compute_then_wait(samples, view_op_s, link_s, kernel_floor_s, fair_core_share)
    # over the graphs together, each weighing by its time (the longest calls are the most like a forward)
    alone = [sample for sample in samples if not sample.collectives] or list(samples)
    scale = fit_in_graph_scale(alone, [sample.work_s for sample in alone], view_op_s=view_op_s, node_s=kernel_floor_s)
    share = sum(sample.work_s for sample in alone) / sum(sample.work_s / sample.core_share for sample in alone)

    def wall_without_wait_s(sample: GraphSample) -> float:
        return scale * priced_work_s(sample, view_op_s, kernel_floor_s) / share + link_s(sample)

    waits = [(sample.seconds - wall_without_wait_s(sample)) / len(sample.collectives)
             for sample in samples if sample.collectives]
    wait_s = max(0.0, statistics.median(waits)) if waits else 0.0
    errors = [abs(wall_without_wait_s(sample) + len(sample.collectives) * wait_s - sample.seconds) / sample.seconds
              for sample in samples]
    return HostFit(scale * kernel_floor_s / share, wait_s, 0.0, statistics.median(errors), len(samples), share,
                   in_graph_scale=scale)


def graph_link_s(sample: GraphSample, link: LinkProfile | None, shared_memory_link: LinkProfile | None,
                 shared_memory_cold_curve: Sequence[tuple[float, float]] = ()) -> float:
    """Link time of ``sample``'s collectives, run as ``autotp.compile``'s inference graphs run them
    (:func:`~autotp.calibration.graphs.measure_graphs`): through shared memory on ``shared_memory_link`` when given, each
    paying the cold-cache cost of ``shared_memory_cold_curve`` at the graph's working set as the
    cost model prices a model's (``collectives.collective_time_s``; the wait fitted beyond this
    time must not hold it again), else small all-reduces in one round on ``link``; 0.0 without a
    link."""
    if link is None:
        return 0.0
    form = FORM_TABLE[CollectiveForm.SHARED_MEMORY if shared_memory_link is not None else CollectiveForm.ONE_SHOT]
    cold_s = cold_call_at_s(shared_memory_cold_curve, sample.working_set_bytes) if form.pays_cold_call else 0.0
    return sum(link_collective_time_s(kind, nbytes, group, link, small_all_reduce=form.form,
                                      shared_memory_link=shared_memory_link)
               + (cold_s if kind in form.kinds else 0.0)
               for kind, nbytes, group in sample.collectives)


def _fit_compute_then_wait(samples: Sequence[GraphSample], view_op_s: float,
                           link_s: Callable[[GraphSample], float], kernel_floor_s: float = 0.0,
                           fair_core_share: float | None = None) -> HostFit:
    """The host terms from samples whose compute was timed apart (:attr:`GraphSample.compute_s`).

    Compute and communication mean here what the accuracy benchmark measures: a graph's compute
    is its time with every collective replaced by a local stand-in, its communication what the
    real collectives add to that. So:

    1. the scale of the single-op prices in a graph (:func:`fit_in_graph_scale`) over the *compute work* of
       every graph (``compute_work_s``; the graphs with collectives count too: their stand-ins cost nothing);
    2. the share of a core a rank gets while computing, and what a call loses once to ranks starting it
       together on shared cores: the line of every graph's compute wall time over its compute work
       (:func:`fit_core_share`); every work term becomes wall time divided by the share, and a call pays the
       loss once (``Hardware.core_share_call_s``). With four single-thread ranks on two cores the share is
       a little below 1/2: the ranks take turns on the cores while they compute, which is compute time, not
       a wait for a collective.
       The share holds up to the longest compute among the graphs (``core_share_range_s``): a call's compute
       beyond it runs at ``fair_core_share`` (:meth:`~autotp.cost_model.hardware.Hardware.shared_core_compute_s`;
       a short call ends before the scheduler has evened the ranks' progress out, a long one does not);
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
    scale = fit_in_graph_scale(samples, [sample.compute_work_s for sample in samples], view_op_s=view_op_s,
                               node_s=kernel_floor_s)
    fair = 1.0 if fair_core_share is None else fair_core_share
    share, call_s = fit_core_share([sample.compute_work_s for sample in samples],
                                   [sample.compute_work_s / sample.core_share for sample in samples], at_most=fair)
    longest_s = max(sample.compute_work_s for sample in samples) / share  # priced as a call's compute is
    share_range_s = longest_s if fair_core_share is not None and share < fair else 0.0

    def compute_wall_s(sample: GraphSample) -> float:
        return shared_core_compute_s(scale * priced_work_s(sample, view_op_s, kernel_floor_s) / share,
                                     share, share_range_s, fair) + call_s

    synced = [sample for sample in samples if sample.collectives]
    entry_s, in_graph_s, per_compute = fit_wait_terms(
        [len(sample.collectives) for sample in synced], [sample.compute_s for sample in synced],
        [sample.seconds - sample.compute_s - link_s(sample) for sample in synced],
        per_compute_at_most=max(0.0, 1.0 - share))

    compute_range_s = max((sample.compute_s for sample in synced), default=0.0) if per_compute else 0.0

    def waited_s(sample: GraphSample, compute_s: float) -> float:
        count = len(sample.collectives)
        return entry_s + count * in_graph_s + per_compute * min(compute_s, compute_range_s) if count else 0.0

    errors = [abs(compute_wall_s(sample) + link_s(sample) + waited_s(sample, compute_wall_s(sample)) - sample.seconds)
              / sample.seconds for sample in samples]
    return HostFit(scale * kernel_floor_s / share, max(0.0, in_graph_s), 0.0, statistics.median(errors),
                   len(samples), share, min(0.0, in_graph_s), entry_s, per_compute, scale, compute_range_s,
                   share_range_s, fair, call_s)


CORE_SHARE_FIT_INLIER_ERROR = 0.1
"""Relative error up to which a graph counts about fully in the core share's fit (:func:`fit_core_share`'s Cauchy
loss scale): a graph one of whose ranks lost a time slice should not move the share every work term is divided
by."""


def fit_core_share(work_s: Sequence[float], wall_s: Sequence[float], *, at_most: float = 1.0) -> tuple[float, float]:
    """``(share, per call)``: the line ``wall = work / share + per_call`` through the compute forms of graphs,
    each graph's work (its rank's CPU time) against its wall time on the group.

    Why a line: ranks that start a call together on shared cores lose some of its start to each other (each
    waits for a core while the others run their first time slice), once per call, and then take turns on the
    cores at about one share; the ratio of work to wall time alone rises with the call's length (on this
    project's 2-core VM at tp 4: 0.17-0.27 for graphs of 0.2 ms of work, 0.33-0.42 for 1-6 ms, 0.45-0.48 for the
    20-25 ms of the wide models' forwards), which one share priced high for long calls and low for short ones.

    Bounded least squares on relative error, made robust (Cauchy loss at :data:`CORE_SHARE_FIT_INLIER_ERROR`,
    started from the plain solution) where a graph is further than that from the plain line: the share at most
    ``at_most`` (the fair share: no rank gets more while every rank computes), the per-call loss at least 0. With
    fewer than three graphs or one length of work, the ratio of their total work to their total wall time and no
    per-call loss."""
    if len(work_s) != len(wall_s):
        raise ValueError(f"need one wall time per work, got {len(work_s)} works and {len(wall_s)} wall times")
    if not work_s or any(not work > 0 for work in work_s) or any(not wall > 0 for wall in wall_s):
        raise ValueError(f"every work and wall time must be > 0, got {list(work_s)} and {list(wall_s)}")
    if not 0 < at_most <= 1:
        raise ValueError(f"at_most must be in (0, 1], got {at_most!r}")
    ratio = min(at_most, sum(work_s) / sum(wall_s))
    if len(work_s) < 3 or max(work_s) <= min(work_s) * (1 + 1e-9):
        return ratio, 0.0
    rows = np.asarray([[work / wall, 1.0 / wall] for work, wall in zip(work_s, wall_s)])
    target = np.ones(len(work_s))
    bounds = ([1.0 / at_most, 0.0], [np.inf, np.inf])
    per_work, per_call = lsq_linear(rows, target, bounds=bounds, method="bvls").x
    if np.max(np.abs(rows @ (per_work, per_call) - target)) > CORE_SHARE_FIT_INLIER_ERROR:
        # a graph whose ranks lost a time slice took far longer than the line: the Cauchy loss counts it little
        per_work, per_call = least_squares(
            lambda terms: rows @ terms - target, np.clip((per_work, per_call), *bounds), bounds=bounds,
            loss="cauchy", f_scale=CORE_SHARE_FIT_INLIER_ERROR, x_scale="jac").x
    return min(at_most, 1.0 / float(per_work)), float(per_call)


def priced_work_s(sample: GraphSample, view_op_s: float, node_s: float) -> float:
    """What the single-op measurements price ``sample``'s compute at, on the work clock: its kernels' roofline
    times and op families' fixed costs (``device_s``), ``view_op_s`` per view node and ``node_s`` (the
    tiny-kernel floor) per kernel node."""
    return sample.device_s + sample.view_nodes * view_op_s + sample.kernel_nodes * node_s


def fit_in_graph_scale(samples: Sequence[GraphSample], work_s: Sequence[float], *, view_op_s: float,
                       node_s: float) -> float:
    """How much more work the graphs took than their single ops price (:func:`priced_work_s`): their total work
    over their total priced work, each graph weighing by its time (the longest, most like a forward, count
    most), at least 1. ``work_s``: each graph's measured work.

    At least 1: an op in a graph costs no less than the same op timed in a tight loop, where its code and data
    stay hot. A ratio below 1 means the single ops were timed in one of the machine's slow spells and the graphs
    in a faster one (on this project's VM, 3 of 21 ranks' calibrations, at 0.87-0.97), and scaling the prices
    down by it priced that run's models low (pooled over three runs, 10.2% median error at tp 1 against 5.6%).

    Why one number: an op in a graph of two hundred different ops costs more than the same op timed in a loop
    (its code and data evicted by the ops before it), and the calibration used to fit how (an extra per kernel
    growing with its size up to a cap, a dispatch per node, a cost per call). Those four numbers were poorly
    determined by a dozen graphs of one op mix: on this project's 2-core VM, calibrations minutes apart fitted
    the extra at 0.2x to 3.0x, its cap at 1 us to 1 ms, and held-out families came out no better than with one
    scale on every single-op price (docs: cost-model accuracy)."""
    if len(samples) != len(work_s):
        raise ValueError(f"need one work per graph, got {len(samples)} graphs and {len(work_s)} works")
    if not work_s or any(not work > 0 for work in work_s):
        raise ValueError(f"every graph's work must be > 0, got {list(work_s)}")
    priced = sum(priced_work_s(sample, view_op_s, node_s) for sample in samples)
    if not priced > 0:
        raise ValueError("the graphs price at no work (no kernels, views or floor): nothing to scale")
    return max(1.0, float(sum(work_s)) / priced)


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


def device_only(hardware: Hardware) -> Hardware:
    """``hardware`` with its host terms off: what the kernels alone cost."""
    return dataclasses.replace(hardware, host_dispatch_s=0.0, graph_launch_s=0.0, model_call_s=0.0,
                               collective_wait_s=0.0)



COLD_WEIGHT_BYTES = 64 * 2**20
"""Bytes of distinct weights a GEMM sample cycles through: more than a CPU's last-level cache, so
each call reads its weight from memory, as a model's forward does when its weights do not fit in the
cache (it reads each weight once per call, long after the previous call evicted it). A weight reused in a
loop runs faster, by about as much as its read from memory takes (``benchmarks/gemm_rate.py`` times both), but
not in a graph: this curve prices the GEMMs of the accuracy benchmark's families, whose weights fit in the
last-level cache, 12-24% above their time in their graphs with two ranks busy (about a third above on a rank
alone), where a curve fitted on a weight reused in a loop priced them 19-40% below (the cost-model accuracy page,
"Two GEMM curves, by where the weights are")."""


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

