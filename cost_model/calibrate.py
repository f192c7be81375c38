"""The fit of a calibrated :class:`~.hardware.Hardware` profile from measurements (pure: no process
group, no timing).

:mod:`autotp.calibration.calibrate` (``autotp calibrate``) measures this machine on every rank of
a gloo group and hands the per-rank :class:`RankMeasurements` and the :class:`CollectiveSample`
list to :func:`build_profile`: medians over the ranks, the links fitted to the formulas of
:mod:`.collectives` (:func:`fit_link`), the GEMM curve and the host terms fitted by
:mod:`.graph_calibration`, every single-op price scaled by what the same work cost in the graphs and divided by
the share of a core a rank got.
:func:`with_measured_links` makes it one host of several whose network was measured (across hosts, by a
launcher-started group); :func:`with_nodes`, one node of a two-level machine whose network the user describes.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
from collections.abc import Sequence

import numpy as np
import torch
from scipy.optimize import nnls

from .bandwidth import at_working_set
from .collective_forms import FORM_TABLE, CollectiveForm, form_measured_as
from .collectives import alpha_beta_terms, ceil_log2, gloo_kind
from .graph_calibration import COLD_WEIGHT_BYTES, GemmSample, GraphSample, HostFit, fit_gemm_curve, fit_host_terms
from .hardware import Hardware, LinkProfile

__all__ = [
    "SEND_KIND",
    "SHARED_MEMORY_KIND",
    "CollectiveSample",
    "HostFit",
    "LinkFit",
    "RankMeasurements",
    "bandwidth_lower_bound",
    "build_profile",
    "fit_link",
    "fit_send_link",
    "kernel_profile",
    "large_message_bandwidth",
    "measured_link",
    "with_measured_links",
    "with_nodes",
]

SHARED_MEMORY_KIND = str(FORM_TABLE[CollectiveForm.SHARED_MEMORY].measured_as)
"""Kind of the samples of autotp's shared-memory all-reduce (``autotp.runtime.collectives.shared_memory``),
measured besides gloo's where the ranks can use it; fitted to ``Hardware.shared_memory_link``."""

SEND_KIND = "send"
"""Kind of the samples of one rank's send to another host, alone on the link (``nbytes`` sent, one step of the
whole message); the line through them is ``Hardware.inter_node_send`` (:func:`fit_send_link`)."""


@dataclasses.dataclass(frozen=True)
class CollectiveSample:
    """One measured collective: ``seconds`` (median over repeats of the slowest rank)."""

    kind: str
    group_size: int
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class RankMeasurements:
    """What one rank measured (collective samples are identical on every rank)."""

    rank: int
    threads: int
    matmul_flops_per_s: dict[str, float]
    copy_bytes_per_s: float
    kernel_floor_s: float
    view_op_s: float
    collectives: tuple[CollectiveSample, ...]
    gemm_samples: tuple[GemmSample, ...] = ()
    transcendental_element_s: float = 0.0
    graphs: tuple[GraphSample, ...] = ()
    copy_curve: tuple[tuple[int, float], ...] = ()
    """``(working_set_bytes, bytes_per_s)``, ascending: copies at ``CalibrationConfig.bandwidth_working_sets``
    and the large copy behind ``copy_bytes_per_s`` (a working set of twice ``copy_bytes``)."""
    cold_curve: tuple[tuple[int, float], ...] = ()
    """``(working_set_bytes, seconds)`` at the sizes of ``copy_curve``: a shared-memory collective's extra
    seconds per call after a stream of that working set (:func:`autotp.calibration.graphs.measure_cold_call_s`;
    empty: not measured, a group of one)."""
    op_fixed_s: tuple[tuple[str, float], ...] = ()
    """``(name, seconds)``: each fixed cost of ``Hardware.op_fixed_s`` (an op family's per call, attention's per
    block, per call and in its math kernel; :func:`autotp.calibration.graphs.measure_op_fixed_s`, work seconds;
    empty: not measured)."""
    op_element_s: tuple[tuple[str, float], ...] = ()
    """``(op name, seconds per element)``: each transcendental and pooling op's own rate
    (:func:`autotp.calibration.graphs.measure_element_rates`; empty: not measured)."""
    first_call_s: tuple[tuple[str, float], ...] = ()
    """``(kind, seconds)``: what a kernel's first call in a call of a graph costs beyond one back to back
    (:func:`autotp.calibration.graphs.measure_first_call_s`, work seconds; empty: not measured)."""
    model_call_s: float = 0.0
    """What a compiled model's call adds to its rank-local graph's call (:func:`autotp.calibration.model_call.
    measure_model_call_s`, work seconds; 0.0: not measured)."""
    fair_core_share: float = 0.0
    """The most of a core this rank could get while every rank computed (:func:`autotp.calibration.graphs.
    fair_core_share`: the cores over the ranks' threads), at which a call's compute beyond the graphs' longest is
    priced (``Hardware.core_share_range_s``; 0.0: not recorded, the share holds for any compute)."""
    busy_compute_scale: tuple[tuple[int, float], ...] = ()
    """``(busy ranks, relative time)``: a fixed compute's wall time while that many ranks of the machine
    computed at once, over that with every rank busy (:func:`autotp.calibration.concurrency.measure_busy_scale`;
    the same on every rank; empty: not measured, a group of one)."""
    gemv_curve: tuple[tuple[int, float], ...] = ()
    """``(working_set_bytes, bytes_per_s)`` at the sizes of ``copy_curve``: a matrix-vector product's matrix
    bytes over its time (:func:`autotp.calibration.graphs.measure_gemv_curve`, work seconds; empty: not
    measured)."""


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """Fitted ``t = base + steps(kind, p) * alpha + factor(kind, p) * n / B`` and how well it fits."""

    base_latency_s: float
    latency_s: float
    bandwidth_bytes_per_s: float
    median_abs_rel_error: float
    samples: int


def kernel_profile(flops: dict[str, float], bandwidth: float, floor: float, view: float,
                    gemms: Sequence[GemmSample], transcendental: float,
                    bandwidth_points: Sequence[tuple[int, float]] = (),
                    element_rates: Sequence[tuple[str, float]] = (),
                    gemv_points: Sequence[tuple[int, float]] = ()) -> Hardware:
    """A profile of one rank's kernel measurements (no host terms, a placeholder link): what the
    graph samples' kernels are priced with, and the GEMM curve fitted on it. ``bandwidth_points``:
    ``(working_set_bytes, bytes_per_s)``; the GEMM samples are priced at the bandwidth of the
    weights they cycle through (``COLD_WEIGHT_BYTES``), as a graph is priced at its working set;
    ``element_rates``: each transcendental and pooling op's own rate (``Hardware.op_element_s``);
    ``gemv_points``: a matrix-vector product's ``(working_set_bytes, bytes_per_s)`` (``Hardware.gemv_bandwidth_curve``)."""
    placeholder = LinkProfile(name="not-measured", bandwidth_gbps=1.0, latency_s=0.0)
    profile = Hardware(
        name="kernels-only", peak_tflops={d: rate / 1e12 for d, rate in flops.items()},
        memory_bandwidth_gbps=bandwidth / 1e9, memory_gib=1.0, kernel_floor_s=floor, view_op_s=view,
        intra_node=placeholder, inter_node=placeholder, devices_per_node=1, host_is_device=True,
        transcendental_element_s=transcendental, op_element_s=tuple(element_rates),
        memory_bandwidth_curve=tuple((size, rate / 1e9) for size, rate in bandwidth_points),
        gemv_bandwidth_gbps=gemv_points[-1][1] / 1e9 if gemv_points else 0.0,
        gemv_bandwidth_curve=tuple((size, rate / 1e9) for size, rate in gemv_points),
    )
    if gemms:
        curve = fit_gemm_curve(gemms, at_working_set(profile, COLD_WEIGHT_BYTES))
        profile = dataclasses.replace(profile, gemm_half_efficiency_dim=curve.half_dim,
                                      peak_tflops={d: t * curve.peak_scale for d, t in profile.peak_tflops.items()})
    return profile


# ------------------------------------------------------------------------------ fitting

def _link_terms(sample: CollectiveSample) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of one sample's algorithm: the terms of the form it measures
    (``FormSpec.measured_as``, on its first kind), else gloo's ring for its kind (:func:`.collectives.gloo_kind`:
    the samples are gloo's; its reduce-scatter is an all-reduce)."""
    if sample.kind == SEND_KIND:
        return 1, 1
    form = form_measured_as(sample.kind)
    if form is not None and form.terms is not None:
        steps, factor, multiplier = form.terms(form.kinds[0], sample.group_size)
        return steps, factor * multiplier
    return alpha_beta_terms(gloo_kind(sample.kind), "ring", sample.group_size, ceil_log2(sample.group_size))


def fit_link(samples: Sequence[CollectiveSample], *, bandwidth_bytes_per_s: float | None = None) -> LinkFit:
    """Fit ``base``, ``alpha`` and ``B`` of the ring formulas of :mod:`.collectives` to ``samples``.

    Model: ``t = base + steps * alpha + factor * n / B`` with ``(steps, factor)`` from
    :func:`~.collectives.alpha_beta_terms` (ring) for each sample's kind and group size, or from
     the terms of the form's row (:data:`~.collective_forms.FORM_TABLE`) for samples of its
    ``measured_as`` kind, :data:`SHARED_MEMORY_KIND` (fit those alone).
    Non-negative least squares on relative error: every row is divided by its measured time.
    ``B`` is then taken from the large messages alone where they tell it (:func:`large_message_bandwidth`), and
    ``base`` and ``alpha`` fitted again under it on the small ones: latency from the small sizes, bandwidth from
    the slope of the large ones, as Hockney read a ping-pong curve ([H94]: ``t = t0 + n / r_inf``, ``r_inf`` the
    asymptotic rate).
    ``bandwidth_bytes_per_s``: ``B`` given instead of fitted (only ``base`` and ``alpha`` are fitted).
    Raises ValueError when the samples cannot determine a bandwidth (all sizes too small).

    [H94] R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing
    20(3):389-398, 1994.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 collective samples to fit a link, got {len(samples)}")
    if bandwidth_bytes_per_s is not None:
        return _fit_link_terms(samples, bandwidth_bytes_per_s)
    joint = _fit_link_terms(samples, None)
    slope_bandwidth = large_message_bandwidth(samples, joint.bandwidth_bytes_per_s)
    if slope_bandwidth is None:
        return joint
    small = [sample for sample in samples if not _is_large(sample, slope_bandwidth)]
    return _fit_link_terms(samples, slope_bandwidth, latency_samples=small or samples)


def _fit_link_terms(samples: Sequence[CollectiveSample], bandwidth_bytes_per_s: float | None, *,
                    latency_samples: Sequence[CollectiveSample] | None = None) -> LinkFit:
    """The least-squares fit of :func:`fit_link` on ``latency_samples`` (default: ``samples``), ``B`` fitted too
    where ``bandwidth_bytes_per_s`` is None; its error the median over ``samples``."""
    rows, target = [], []
    for sample in samples if latency_samples is None else latency_samples:
        steps, factor = _link_terms(sample)
        weight = 1.0 / sample.seconds
        if bandwidth_bytes_per_s is None:
            # columns: base (s), alpha (s), 1/B scaled to seconds per GB so the columns are comparable
            rows.append([weight, steps * weight, factor * sample.nbytes / 1e9 * weight])
            target.append(1.0)
        else:  # the known bandwidth term moves to the target side
            rows.append([weight, steps * weight])
            target.append(1.0 - factor * sample.nbytes / bandwidth_bytes_per_s * weight)
    solution, _ = nnls(np.asarray(rows), np.asarray(target))
    if bandwidth_bytes_per_s is None:
        base_s, alpha_s, seconds_per_gb = (float(v) for v in solution)
    else:
        base_s, alpha_s = (float(v) for v in solution)
        seconds_per_gb = 1e9 / bandwidth_bytes_per_s
    if seconds_per_gb <= 0:
        raise ValueError(
            "the collective timings do not grow with message size, so no bandwidth can be fitted; "
            "measure larger messages (CalibrationConfig.collective_bytes)"
        )
    bandwidth = 1e9 / seconds_per_gb
    errors = []
    for sample in samples:
        steps, factor = _link_terms(sample)
        predicted = base_s + steps * alpha_s + factor * sample.nbytes / bandwidth
        errors.append(abs(predicted - sample.seconds) / sample.seconds)
    return LinkFit(base_s, alpha_s, bandwidth, statistics.median(errors), len(samples))


LARGE_MESSAGE_SHARE = 0.5
"""A sample is a large message where its bandwidth term is at least this share of its time: where the link's rate,
not its latency, sets what it costs (:func:`large_message_bandwidth`)."""


def _is_large(sample: CollectiveSample, bandwidth_bytes_per_s: float) -> bool:
    """Whether ``sample``'s bandwidth term at ``bandwidth_bytes_per_s`` is :data:`LARGE_MESSAGE_SHARE` of its time."""
    return _link_terms(sample)[1] * sample.nbytes / bandwidth_bytes_per_s >= LARGE_MESSAGE_SHARE * sample.seconds


def large_message_bandwidth(samples: Sequence[CollectiveSample], joint_bandwidth: float) -> float | None:
    """The bandwidth the large messages' slope says: a least-squares line through each series' (one kind at one
    group size) large samples (:func:`_is_large` at ``joint_bandwidth``), one intercept per series
    and one slope, the seconds each further byte of the bandwidth term (``factor * n``) costs; None where no
    series has two large sizes or the slope is not positive.

    A fit on relative error weighs every size alike, so a link whose small transfers run faster than its rate
    (a token bucket's burst, a window that hides the first round trips) is fitted faster than its large transfers
    run; the slope between large sizes is the rate they pay, whatever the small ones do."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for sample in samples:
        if _is_large(sample, joint_bandwidth):
            moved = _link_terms(sample)[1] * sample.nbytes
            series.setdefault((sample.kind, sample.group_size), []).append((moved, sample.seconds))
    series = {key: points for key, points in series.items() if len({moved for moved, _ in points}) >= 2}
    if not series:
        return None
    rows, target = [], []
    for index, points in enumerate(series.values()):
        for moved, seconds in points:
            intercepts = [0.0] * len(series)
            intercepts[index] = 1.0
            rows.append([*intercepts, moved / 1e9])  # the slope in seconds per GB, comparable to the intercepts
            target.append(seconds)
    solution = np.linalg.lstsq(np.asarray(rows), np.asarray(target), rcond=None)[0]
    seconds_per_gb = float(solution[-1])
    return 1e9 / seconds_per_gb if seconds_per_gb > 0 else None


def bandwidth_lower_bound(samples: Sequence[CollectiveSample]) -> float:
    """The least bandwidth ``samples`` allow: each moved its bytes (``factor * n``, :func:`_link_terms`) within its
    whole time, so ``B >= factor * n / t``; the largest of those bounds. For samples whose times do not grow with
    their size, where :func:`fit_link` cannot fit ``B``: priced at it, a large message is priced no faster than any
    was measured."""
    if not samples:
        raise ValueError("no collective samples to bound a bandwidth with")
    return max(_link_terms(sample)[1] * sample.nbytes / sample.seconds for sample in samples)


def measured_link(samples: Sequence[CollectiveSample], name: str) -> tuple[LinkProfile, LinkFit, bool]:
    """The gloo link ``samples`` measured, fitted by :func:`fit_link`; where their times do not grow with their
    size (ranks that outnumber the cores: waking up dominates every size), the bandwidth is
    :func:`bandwidth_lower_bound` and only the latencies are fitted (the third value says so)."""
    try:
        fit, bound = fit_link(samples), False
    except ValueError:
        fit, bound = fit_link(samples, bandwidth_bytes_per_s=bandwidth_lower_bound(samples)), True
    link = LinkProfile(name=name, bandwidth_gbps=fit.bandwidth_bytes_per_s / 1e9, latency_s=fit.latency_s,
                       base_latency_s=fit.base_latency_s)
    return link, fit, bound


def with_measured_links(profile: Hardware, network: Sequence[CollectiveSample], *, devices_per_node: int,
                        inside: Sequence[CollectiveSample] = ()) -> Hardware:
    """``profile`` (one host's) as one node of a machine whose network ``network`` measured (collective samples
    across hosts, one rank on each): ``inter_node`` fitted to them, ``devices_per_node`` ranks per host. With
    ``inside`` (samples inside a host: gloo's, and the shared-memory all-reduce's if measured), ``intra_node``
    and ``shared_memory_link`` are fitted again to them (a profile whose compute was measured before, its links
    now). ``source`` says what was measured."""
    if not network:
        raise ValueError("no collective samples across hosts to fit inter_node with; measure them on the first "
                         "rank of each host (autotp calibrate under a launcher on 2 or more nodes)")
    sends = [sample for sample in network if sample.kind == SEND_KIND]
    network = [sample for sample in network if sample.kind != SEND_KIND]
    link, fit, bound = measured_link(network, f"gloo-network-{network[0].group_size}hosts")
    send = fit_send_link(sends, link)
    changes: dict[str, object] = {"inter_node": link, "devices_per_node": devices_per_node, "inter_node_send": send}
    source = (f"{profile.source}; inter_node measured across {network[0].group_size} hosts (one rank each, by the "
              f"launcher's nodes), alpha/beta fitted on {fit.samples} samples (median |relative error| "
              f"{fit.median_abs_rel_error:.1%})" + (" (bandwidth a lower bound)" if bound else "")
              + f", devices_per_node={devices_per_node} from the launcher")
    if send is not None:
        source += f"; one-way sends between hosts at {send.bandwidth_gbps:.4f} GB/s ({len(sends)} samples)"
    gloo = [sample for sample in inside if sample.kind != SHARED_MEMORY_KIND]
    shared = [sample for sample in inside if sample.kind == SHARED_MEMORY_KIND]
    if gloo:
        changes["intra_node"], intra_fit, _ = measured_link(gloo, f"gloo-loopback-{gloo[0].group_size}ranks")
        source += (f"; intra_node measured again inside each host ({intra_fit.samples} samples, median |relative "
                   f"error| {intra_fit.median_abs_rel_error:.1%})")
    if shared:
        shared_fit = _fit_shared_memory_link(shared, profile.memory_bandwidth_gbps * 1e9)
        changes["shared_memory_link"] = LinkProfile(
            name=f"shared-memory-{shared[0].group_size}ranks", bandwidth_gbps=shared_fit.bandwidth_bytes_per_s / 1e9,
            latency_s=shared_fit.latency_s, base_latency_s=shared_fit.base_latency_s)
        changes["small_all_reduce"] = CollectiveForm.SHARED_MEMORY
    return dataclasses.replace(profile, **changes, source=source)


def fit_send_link(sends: Sequence[CollectiveSample], network: LinkProfile) -> LinkProfile | None:
    """The link of one-way sends between hosts: the line through ``sends`` ([H94]'s ``t0 + n / r``), its slope the
    bandwidth (:func:`large_message_bandwidth`, the sizes where the rate sets the time), where it meets the axis the
    latency (the median of each sample's time less its bytes at that rate), or, where it meets it below, the burst:
    the bytes the link let through before its rate applied (a token bucket's, ``LinkProfile.burst_bytes``); None
    where the sends tell no slope (sends then priced on ``network``, whose name the link's extends).

    Between two emulated hosts a link shaped to 200 Mbit/s with a 64 KiB bucket read a burst of 52-55 KiB in four
    calibrations (4 MiB sends after the link idled took 173.2 ms, 1 MiB 41.6 ms: 2.3 ms below their rate); the
    unshaped link a latency of 0.14-0.27 ms."""
    bandwidth = large_message_bandwidth(sends, network.bandwidth_bytes_per_s) if sends else None
    if bandwidth is None:
        return None
    intercept_s = statistics.median(sample.seconds - sample.nbytes / bandwidth for sample in sends)
    return LinkProfile(name=f"{network.name}-send", bandwidth_gbps=bandwidth / 1e9, latency_s=max(0.0, intercept_s),
                       burst_bytes=max(0.0, -intercept_s * bandwidth))


def _fit_shared_memory_link(samples: Sequence[CollectiveSample], copy_bytes_per_s: float) -> LinkFit:
    """The shared-memory all-reduce's link. When its timings do not grow with size (ranks that outnumber
    the cores: waking up dominates every size), its bandwidth is the ranks' measured copy bandwidth (it
    copies into and sums out of memory) and only the latency terms are fitted."""
    try:
        return fit_link(samples)
    except ValueError:
        return fit_link(samples, bandwidth_bytes_per_s=copy_bytes_per_s)


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError) as error:
        raise RuntimeError(
            f"cannot read this host's memory size ({error}); build the profile by hand "
            f"(Hardware.from_json) with memory_gib set"
        ) from None


def build_profile(
    compute: Sequence[RankMeasurements],
    links: Sequence[CollectiveSample],
    *,
    world_size: int,
    name: str = "cpu-calibrated",
) -> Hardware:
    """A :class:`Hardware` from the ranks' measurements (medians over ranks) and the link samples
    (``inter_node`` repeats the measured link; :func:`with_measured_links` puts a measured network there)."""
    if not compute:
        raise ValueError("no measurements to build a profile from")
    dtypes = set.intersection(*(set(m.matmul_flops_per_s) for m in compute))
    peak_tflops = {d: statistics.median(m.matmul_flops_per_s[d] for m in compute) / 1e12 for d in sorted(dtypes)}
    bandwidth = statistics.median(m.copy_bytes_per_s for m in compute)
    sizes = sorted(set.intersection(*(set(dict(m.copy_curve)) for m in compute)))
    curve_points = [(size, statistics.median(dict(m.copy_curve)[size] for m in compute)) for size in sizes]
    gemv_sizes = sorted(set.intersection(*(set(dict(m.gemv_curve)) for m in compute)))
    gemv_points = [(size, statistics.median(dict(m.gemv_curve)[size] for m in compute)) for size in gemv_sizes]
    floor = statistics.median(m.kernel_floor_s for m in compute)
    view = statistics.median(m.view_op_s for m in compute)
    transcendental = statistics.median(m.transcendental_element_s for m in compute)
    cold_sizes = sorted(set.intersection(*(set(dict(m.cold_curve)) for m in compute)))
    cold_curve = tuple((size, statistics.median(dict(m.cold_curve)[size] for m in compute)) for size in cold_sizes)
    shared_samples = [sample for sample in links if sample.kind == SHARED_MEMORY_KIND]
    gloo_samples = [sample for sample in links if sample.kind != SHARED_MEMORY_KIND]
    group_size = links[0].group_size
    hostname = socket.gethostname()
    loopback, fit, bandwidth_bound = measured_link(gloo_samples, f"gloo-loopback-{group_size}ranks")
    # where the ranks share a host, inference graphs sum through shared memory (its own link)
    shared_fit = _fit_shared_memory_link(shared_samples, bandwidth) if shared_samples else None
    shared_link = None if shared_fit is None else LinkProfile(
        name=f"shared-memory-{group_size}ranks",
        bandwidth_gbps=shared_fit.bandwidth_bytes_per_s / 1e9,
        latency_s=shared_fit.latency_s,
        base_latency_s=shared_fit.base_latency_s,
    )
    unmeasured_network = dataclasses.replace(loopback, name="not-measured-same-as-loopback")
    # The GEMM curve: fitted on rank 0's samples, its kernels priced by its own measurements. The
    # host terms: fitted on every rank's graphs (wall times are the group's, the work each
    # rank's own), the median over ranks of each term, steadier than one rank's fit; a rank's
    # dispatch per node is its own tiny-kernel floor, scaled as its graphs say (fit_in_graph_scale).
    first = compute[0]
    kernels = kernel_profile(first.matmul_flops_per_s, first.copy_bytes_per_s, first.kernel_floor_s,
                              first.view_op_s, first.gemm_samples, first.transcendental_element_s,
                              first.copy_curve, first.op_element_s, first.gemv_curve)
    if shared_link is None:  # the cold cost is the shared-memory collective's: nothing to price without one
        cold_curve = ()
    host = _median_host_fit([fit_host_terms(m.graphs, view_op_s=m.view_op_s, link=loopback,
                                            shared_memory_link=shared_link, shared_memory_cold_curve=cold_curve,
                                            kernel_floor_s=m.kernel_floor_s,
                                            fair_core_share=m.fair_core_share or None)
                             for m in compute if m.graphs])
    graph_link_before = loopback if shared_link is None else shared_link  # the link the graphs' all-reduces ran on
    if host is not None and host.link_base_adjust_s < 0:
        # collectives in a graph take less than back to back (graph_calibration._fit_compute_then_wait)
        adjusted = max(0.0, graph_link_before.base_latency_s + host.link_base_adjust_s)
        if shared_link is None:
            loopback = dataclasses.replace(loopback, base_latency_s=adjusted)
            unmeasured_network = dataclasses.replace(loopback, name="not-measured-same-as-loopback")
        else:
            shared_link = dataclasses.replace(shared_link, base_latency_s=adjusted)
    threads = compute[0].threads
    source = (
        f"calibrated on {hostname} by `autotp calibrate`: {world_size} rank(s) x {threads} thread(s), "
        f"torch {torch.__version__}; matmul peak, copy bandwidth, tiny-op floor measured with all ranks "
        f"busy; gloo links over {group_size} processes, alpha/beta fitted to the ring formulas on "
        f"{fit.samples} samples (median |relative error| {fit.median_abs_rel_error:.1%})"
        + (f" (bandwidth not told apart from the latency by the sizes measured: at least "
           f"{fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s, the fastest message's bytes over its time)"
           if bandwidth_bound else "")
        + f"; inter_node not measured (copy of intra_node); memory_gib = host memory / {world_size}"
        + (f"; shared-memory all-reduce fitted on {shared_fit.samples} samples (median |relative error| "
           f"{shared_fit.median_abs_rel_error:.1%})" if shared_fit is not None else "")
        + (f"; eager host terms fitted on {host.samples} rank-local graphs (median |relative error| "
           f"{host.median_abs_rel_error:.1%})" if host is not None else "; host terms not measured")
    )
    scale = kernels.peak_tflops["float32"] * 1e12 / first.matmul_flops_per_s["float32"] if first.gemm_samples else 1.0
    # The kernels were timed on the work clock (a rank's own work), each on its own in a loop: in a graph
    # every single-op price costs in_graph_scale times as much, and a rank gets only a share of a core (other
    # ranks, other processes), so every work rate slows by both.
    in_graph = host.in_graph_scale if host is not None else 1.0
    core_share = host.core_share if host is not None else 1.0
    pace = core_share / in_graph  # a single-op rate's share of itself in a graph
    if host is not None:
        source += f"; work in the graphs {in_graph:.2f} x what their single ops price (in_graph_scale)"
    if core_share < 1.0:
        source += f"; work terms divided by the share of a core a rank got in the graphs ({core_share:.2f})"
    if host is not None and host.core_share_call_s:
        source += f", {host.core_share_call_s * 1e6:.0f} us lost once per call"
    if host is not None and host.core_share_range_s:
        source += (f", up to their longest compute ({host.core_share_range_s * 1e3:.1f} ms), at the fair share "
                   f"({host.fair_core_share:.2f}) beyond")
    if host is not None and host.link_base_adjust_s < 0:
        graph_link = loopback if shared_link is None else shared_link
        source += (f"; per-call {graph_link.name} latency {graph_link_before.base_latency_s * 1e6:.0f} us back to "
                   f"back, {graph_link.base_latency_s * 1e6:.0f} us in graphs")
    return Hardware(
        name=name,
        # the GEMM curve's asymptote: the best measured rate (at a finite shape) times the fitted scale
        peak_tflops={d: tflops * scale * pace for d, tflops in peak_tflops.items()},
        memory_bandwidth_gbps=bandwidth * pace / 1e9,
        memory_gib=_host_memory_bytes() / world_size / 2**30,
        # With graphs measured, a node's fixed cost is the fitted dispatch (the chain of tiny ops,
        # timed in a tight loop at another moment, is only the fallback).
        kernel_floor_s=0.0 if host is not None else floor,
        view_op_s=view / pace,
        intra_node=loopback,
        inter_node=unmeasured_network,
        devices_per_node=max(world_size, group_size),
        source=source,
        runtime_mode="eager",
        host_is_device=True,
        host_dispatch_s=host.host_dispatch_s if host is not None else 0.0,
        collective_wait_s=host.collective_wait_s if host is not None else 0.0,
        call_sync_wait_s=host.call_sync_wait_s if host is not None else 0.0,
        call_sync_wait_per_compute=host.call_sync_wait_per_compute if host is not None else 0.0,
        call_sync_wait_compute_range_s=host.call_sync_wait_compute_range_s if host is not None else 0.0,
        graph_launch_s=host.graph_launch_s if host is not None else 0.0,
        gemm_half_efficiency_dim=kernels.gemm_half_efficiency_dim,
        transcendental_element_s=transcendental / pace,
        op_element_s=_median_by_name([m.op_element_s for m in compute], pace),
        op_fixed_s=_median_by_name([m.op_fixed_s for m in compute], pace),
        first_call_s=_median_by_name([m.first_call_s for m in compute], pace),
        # timed on a model's own call, not priced from single ops: the core share alone
        model_call_s=statistics.median(m.model_call_s for m in compute) / core_share,
        memory_bandwidth_curve=tuple((size, rate * pace / 1e9) for size, rate in curve_points),
        # the figure at the largest working set, as memory_bandwidth_gbps; graphs resolve the curve
        gemv_bandwidth_gbps=gemv_points[-1][1] * pace / 1e9 if gemv_points else 0.0,
        gemv_bandwidth_curve=tuple((size, rate * pace / 1e9) for size, rate in gemv_points),
        # gloo: the inference runtime sums through shared memory on one host, else small all-reduces in one round
        small_all_reduce=CollectiveForm.ONE_SHOT if shared_link is None else CollectiveForm.SHARED_MEMORY,
        shared_memory_link=shared_link,
        # the figure at the largest working set (DRAM), as memory_bandwidth_gbps; graphs resolve the curve
        shared_memory_cold_call_s=cold_curve[-1][1] if cold_curve else 0.0,
        shared_memory_cold_curve=cold_curve,
        core_share=core_share,
        core_share_range_s=host.core_share_range_s if host is not None else 0.0,
        core_share_call_s=host.core_share_call_s if host is not None else 0.0,
        fair_core_share=host.fair_core_share if host is not None else 1.0,
        # the ranks measured together share one machine's cores
        ranks_per_machine=world_size if compute[0].busy_compute_scale else 0,
        busy_compute_scale=compute[0].busy_compute_scale,
    )


def _median_by_name(per_rank: Sequence[Sequence[tuple[str, float]]], pace: float) -> tuple[tuple[str, float], ...]:
    """Per name (an op family's fixed cost, an op's rate per element): the median over the ranks that measured it,
    divided by ``pace`` (the core share over the in-graph scale, as every single-op price)."""
    by_name: dict[str, list[float]] = {}
    for measured in per_rank:
        for name, seconds in measured:
            by_name.setdefault(name, []).append(seconds)
    return tuple((name, statistics.median(values) / pace) for name, values in by_name.items())


def _median_host_fit(fits: Sequence[HostFit]) -> HostFit | None:
    """Each host term's median over the ranks' fits (None without any)."""
    if not fits:
        return None
    medians = {field.name: statistics.median(getattr(fit, field.name) for fit in fits)
               for field in dataclasses.fields(HostFit)}
    return HostFit(**{**medians, "samples": fits[0].samples})


def with_nodes(profile: Hardware, *, devices_per_node: int | None = None,
               inter_node_bandwidth_gbps: float | None = None, inter_node_latency_s: float | None = None,
               inter_node_base_latency_s: float | None = None) -> Hardware:
    """``profile`` as one node of a two-level machine: ``devices_per_node`` devices share the measured
    link; between nodes, a link of the given bandwidth (GB/s per direction per device) and latency.

    The inter-node figures are the user's (a datasheet or an nccl-tests run across nodes; one
    machine cannot measure them); ``source`` records them. Unset figures keep the profile's.
    """
    link = profile.inter_node
    given = {}
    if inter_node_bandwidth_gbps is not None:
        given["bandwidth_gbps"] = inter_node_bandwidth_gbps
    if inter_node_latency_s is not None:
        given["latency_s"] = inter_node_latency_s
    if inter_node_base_latency_s is not None:
        given["base_latency_s"] = inter_node_base_latency_s
    if given:
        link = LinkProfile(**{**link.to_dict(), **given, "name": "inter-node-given"})
    devices = profile.devices_per_node if devices_per_node is None else devices_per_node
    described = [f"devices_per_node={devices}"] + [f"inter_node.{key}={value!r}" for key, value in given.items()]
    return dataclasses.replace(
        profile, devices_per_node=devices, inter_node=link,
        # a send's own link was measured with the network it replaces
        inter_node_send=None if given else profile.inter_node_send,
        source=f"{profile.source}; two-level machine as given by the user: {', '.join(described)}",
    )


