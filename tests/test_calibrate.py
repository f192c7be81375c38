"""Calibration: fitting alpha/beta, building a profile usable as ``hardware=``, measuring on gloo.

Tiers (a) (fitting and building from synthetic measurements), (c) (measuring on the shared pool
of 2 real gloo processes, quick mode) and the CLI with the measurement stubbed out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from models import tiny_mlp

import autotp
from autotp.calibration import calibrate as measuring
from autotp.calibration.calibrate import CalibrationConfig, measure_rank
from autotp.cli import main as cli
from autotp.cost_model import Hardware, LinkProfile, get_hardware, link_collective_time_s
from autotp.cost_model import calibrate as profile_fit
from autotp.cost_model.calibrate import SHARED_MEMORY_KIND, CollectiveSample, RankMeasurements, build_profile, fit_link
from autotp.cost_model.collectives import gloo_kind
from autotp.cost_model.graph_calibration import GraphSample

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20)
TRUE_LINK = LinkProfile(name="synthetic", bandwidth_gbps=2.5, latency_s=20e-6, base_latency_s=50e-6)


def synthetic_samples(link: LinkProfile = TRUE_LINK, group_sizes: tuple[int, ...] = (2, 4)) -> list[CollectiveSample]:
    """What gloo's collectives would measure on ``link``: its reduce-scatter runs as an all-reduce (``gloo_kind``)."""
    return [
        CollectiveSample(kind, p, n, link_collective_time_s(gloo_kind(kind), n, p, link))
        for p in group_sizes for kind in KINDS for n in SIZES
    ]


def synthetic_rank(rank: int, samples: list[CollectiveSample]) -> RankMeasurements:
    return RankMeasurements(rank=rank, threads=1, matmul_flops_per_s={"float32": 50e9 + rank * 10e9},
                            copy_bytes_per_s=8e9, kernel_floor_s=6e-6, view_op_s=2e-6, collectives=tuple(samples))


@pytest.mark.parametrize("group_sizes", [(2,), (4,), (2, 4)])
def test_fit_recovers_alpha_beta_of_exact_samples(group_sizes: tuple[int, ...]) -> None:
    """tp=2 and 4 (synthetic): samples made by the ring formulas give back base, alpha and bandwidth."""
    fit = fit_link(synthetic_samples(group_sizes=group_sizes))
    assert math.isclose(fit.bandwidth_bytes_per_s, 2.5e9, rel_tol=1e-6), fit
    assert math.isclose(fit.latency_s + fit.base_latency_s / 2, 20e-6 + 50e-6 / 2, rel_tol=1e-6), fit
    if len(group_sizes) > 1:  # two group sizes separate the per-call and per-step latencies
        assert math.isclose(fit.latency_s, 20e-6, rel_tol=1e-5), fit
        assert math.isclose(fit.base_latency_s, 50e-6, rel_tol=1e-5), fit
    assert fit.median_abs_rel_error < 1e-6 and fit.samples == len(group_sizes) * len(KINDS) * len(SIZES)


def test_fit_weighs_small_and_large_messages_alike() -> None:
    """tp=2 (synthetic): 10% noise on one large sample does not swamp the small ones' latency."""
    samples = synthetic_samples(group_sizes=(2,))
    worst = max(range(len(samples)), key=lambda i: samples[i].seconds)
    samples[worst] = dataclasses.replace(samples[worst], seconds=samples[worst].seconds * 1.1)
    fit = fit_link(samples)
    small = [s for s in samples if s.nbytes == SIZES[0]]
    for sample in small:
        predicted = link_collective_time_s(
            gloo_kind(sample.kind), sample.nbytes, 2,
            LinkProfile("fit", fit.bandwidth_bytes_per_s / 1e9, fit.latency_s, fit.base_latency_s),
        )
        assert math.isclose(predicted, sample.seconds, rel_tol=0.05), (sample, predicted)


def test_a_token_buckets_burst_does_not_lift_the_fitted_rate() -> None:
    """2 hosts (synthetic): a link shaped by a token bucket (200 Mbit/s, a 64 KiB burst) passes each transfer's
    first 64 KiB at once, so small transfers run faster than its rate; the bandwidth is the large messages'
    slope, the rate a large transfer pays, where a fit on relative error alone came out faster than the rate."""
    rate, burst, latency = 25e6, 64 * 2**10, 500e-6
    sizes = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20)
    samples = []
    for kind in KINDS:
        steps, factor = profile_fit._link_terms(CollectiveSample(kind, 2, 1, 1.0))
        samples += [CollectiveSample(kind, 2, n, latency * (1 + steps) + max(0.0, factor * n - burst) / rate)
                    for n in sizes]
    joint = profile_fit._fit_link_terms(samples, None)
    assert joint.bandwidth_bytes_per_s > 1.05 * rate, joint  # what the relative-error fit alone says
    fit = fit_link(samples)
    # the slope of the large messages; an all-gather of 64 KiB moves half the burst, so it is
    # flat yet large at the joint fit's rate and pulls its line a little
    assert math.isclose(fit.bandwidth_bytes_per_s, rate, rel_tol=0.01), fit
    for sample in samples:
        steps, factor = profile_fit._link_terms(sample)
        predicted = fit.base_latency_s + steps * fit.latency_s + factor * sample.nbytes / fit.bandwidth_bytes_per_s
        if sample.nbytes == sizes[-1]:  # a large transfer is priced at what it took, to the burst's time
            assert sample.seconds <= predicted <= sample.seconds + burst / rate, (sample, predicted)
        if sample.nbytes == sizes[0]:  # the latencies come from the small transfers
            assert math.isclose(predicted, sample.seconds, rel_tol=0.05), (sample, predicted)


def test_the_network_between_hosts_is_measured_past_a_token_buckets_burst() -> None:
    """The quick calibration's sizes (up to 1 MiB) get 4 MiB added between hosts, and at least nine repeats (a link
    shaped by a token bucket passes small transfers at its burst); the full calibration's sizes already reach it."""
    quick = CalibrationConfig.quick()
    assert max(quick.collective_bytes) < measuring.NETWORK_LARGEST_BYTES
    assert measuring.network_sizes(quick.collective_bytes) == (*quick.collective_bytes, measuring.NETWORK_LARGEST_BYTES)
    assert measuring.network_sizes(CalibrationConfig().collective_bytes) == CalibrationConfig().collective_bytes
    assert quick.repeats < measuring.NETWORK_MIN_REPEATS


def test_fit_needs_a_bandwidth_signal() -> None:
    """No parallelism: timings that do not grow with size, or too few samples, are errors that say why."""
    flat = [CollectiveSample("all_reduce", 2, n, 1e-3) for n in SIZES]
    with pytest.raises(ValueError, match="measure larger messages"):
        fit_link(flat)
    with pytest.raises(ValueError, match="at least 2"):
        fit_link(flat[:1])


def test_config_is_validated_where_built() -> None:
    """No parallelism: one collective size cannot separate latency from bandwidth."""
    with pytest.raises(ValueError, match="at least two different sizes"):
        CalibrationConfig(collective_bytes=(1024, 1024))
    with pytest.raises(ValueError, match="threads must be"):
        CalibrationConfig(threads=0)
    assert CalibrationConfig(threads=3).threads_for(8) == 3


def test_profile_is_usable_as_hardware_json(tmp_path) -> None:
    """tp=2 (synthetic measurements): the profile takes medians over ranks, round-trips through JSON
    and plans a model given as hardware="path.json"."""
    samples = synthetic_samples(group_sizes=(2,))
    profile = build_profile([synthetic_rank(0, samples), synthetic_rank(1, samples)], samples, world_size=2,
                            name="cpu-test")
    assert math.isclose(profile.peak_tflops["float32"], 55e9 / 1e12), profile.peak_tflops
    assert (profile.memory_bandwidth_gbps, profile.kernel_floor_s, profile.view_op_s) == (8.0, 6e-6, 2e-6)
    assert math.isclose(profile.intra_node.bandwidth_gbps, 2.5, rel_tol=1e-6), profile.intra_node
    assert "calibrated on" in profile.source and "not-measured" in profile.inter_node.name
    path = tmp_path / "cpu-test.json"
    path.write_text(profile.to_json())
    assert get_hardware(str(path)) == profile
    model, args, _ = tiny_mlp(device="meta")
    plan = autotp.plan(model, args, world_size=2, options=autotp.PlanOptions(hardware=str(path)))
    assert plan.hardware == "cpu-test"
    assert autotp.estimate(plan, profile).memory_capacity_bytes == pytest.approx(profile.memory_gib * 2**30)


def test_profile_scales_every_single_op_price_by_what_the_graphs_took() -> None:
    """tp=2 (synthetic measurements): graphs whose work was 1.5 times what their single ops price (roofline, the
    view chain's figure per view, the tiny-kernel floor per kernel node) make a profile whose every single-op
    price is 1.5 times as long: GEMM and memory rates, views, transcendental rates, op families' fixed costs and
    first calls; the dispatch is the floor so scaled; no call term and no kernel extra; the source says so. A
    compiled model's call, timed on its own, is not scaled."""
    samples = synthetic_samples(group_sizes=(2,))
    floor_s, view_s = 4e-6, 2e-6
    graphs = []
    for layers in (1, 2, 3):
        for kernel_s in ((1e-6, 3e-6, 20e-6), (2e-6, 50e-6, 400e-6), (1e-3, 3e-3)):
            kernels = tuple(kernel_s) * 20 * layers
            work_s = 1.5 * (sum(kernels) + len(kernels) * floor_s + 10 * layers * view_s)
            graphs.append(GraphSample(len(kernels), 10 * layers, sum(kernels), (), work_s, work_s, kernel_s=kernels))
    measured = dataclasses.replace(synthetic_rank(0, samples), transcendental_element_s=1e-9, kernel_floor_s=floor_s,
                                   view_op_s=view_s, op_fixed_s=(("convolution", 40e-6),),
                                   first_call_s=(("kernel", 30e-6),), model_call_s=100e-6)
    single_ops = build_profile([measured], samples, world_size=2)
    profile = build_profile([dataclasses.replace(measured, graphs=tuple(graphs))], samples, world_size=2)
    assert profile.peak_tflops["float32"] == pytest.approx(single_ops.peak_tflops["float32"] / 1.5)
    assert profile.memory_bandwidth_gbps == pytest.approx(single_ops.memory_bandwidth_gbps / 1.5)
    for field in ("view_op_s", "transcendental_element_s"):
        assert getattr(profile, field) == pytest.approx(1.5 * getattr(single_ops, field)), field
    assert profile.op_fixed_cost_s("convolution") == pytest.approx(1.5 * 40e-6)
    assert profile.first_call_cost_s(None) == pytest.approx(1.5 * 30e-6)
    assert profile.model_call_s == pytest.approx(100e-6) and profile.graph_launch_s == 0.0
    assert profile.host_dispatch_s == pytest.approx(1.5 * floor_s) and profile.kernel_floor_s == 0.0
    assert "1.50 x what their single ops price" in profile.source
    assert (profile.achievable_fraction_compute, profile.achievable_fraction_memory) == (1.0, 1.0)
    assert Hardware.from_json(profile.to_json()) == profile
    # the same graphs at 0.4 of a core while every rank computed, the fair share 0.5 recorded: the share holds up
    # to their longest compute; without the fair share recorded (older measurements), for any compute
    shared = tuple(dataclasses.replace(g, seconds=g.work_s / 0.4, core_share=0.4, compute_s=g.work_s / 0.4,
                                       compute_work_s=g.work_s) for g in graphs)
    busy = build_profile([dataclasses.replace(measured, graphs=shared, fair_core_share=0.5)], samples, world_size=2)
    assert (busy.core_share, busy.core_share_range_s, busy.fair_core_share) == pytest.approx(
        (0.4, max(g.compute_s for g in shared), 0.5))
    assert "at the fair share (0.50) beyond" in busy.source
    unrecorded = build_profile([dataclasses.replace(measured, graphs=shared)], samples, world_size=2)
    assert (unrecorded.core_share, unrecorded.core_share_range_s, unrecorded.fair_core_share) == pytest.approx(
        (0.4, 0.0, 1.0))


def test_view_op_field_is_optional_in_json() -> None:
    """No parallelism: a profile written before view_op_s existed still loads, with 0.0."""
    data = get_hardware("h100-sxm").to_dict()
    del data["view_op_s"]
    assert Hardware.from_dict(data).view_op_s == 0.0


def _measure_quick(rank: int, world_size: int) -> RankMeasurements:
    config = dataclasses.replace(CalibrationConfig.quick(), min_time_s=0.005, repeats=2, graph_runs=3,
                                 collective_bytes=(4 * 2**10, 4 * 2**20))  # 1000x apart: latency vs bandwidth
    before = torch.get_num_threads()
    measured = measure_rank(rank, world_size, config)
    assert torch.get_num_threads() == before, "measure_rank restores the thread count"
    return measured


def test_measure_on_gloo_and_build_a_profile(gloo) -> None:
    """tp=2, real gloo processes (shared pool), quick mode: every figure measured and positive, the
    ranks agree on the collective samples, and the profile validates."""
    ranks = gloo.run(2, _measure_quick)
    assert [m.rank for m in ranks] == [0, 1]
    for measured in ranks:
        assert measured.matmul_flops_per_s["float32"] > 1e8, measured
        assert measured.copy_bytes_per_s > 1e8 and 0 < measured.kernel_floor_s < 1e-2, measured
        assert 0 < measured.view_op_s < 1e-2, measured
        # a compiled model's call flattens, checks and builds around its graph's: more work, never less
        assert 0 < measured.model_call_s < 1e-2, measured.model_call_s
        assert 0 < measured.fair_core_share <= 1.0, measured.fair_core_share
    assert ranks[0].collectives == ranks[1].collectives, "every rank records the slowest rank's times"
    kinds = {(s.kind, s.nbytes) for s in ranks[0].collectives}
    # gloo's three kinds and, ranks on one x86-64 host, the shared-memory all-reduce: two sizes each
    assert {k for k, _ in kinds} == {*KINDS, SHARED_MEMORY_KIND} and len(kinds) == 8, kinds
    profile = build_profile(ranks, ranks[0].collectives, world_size=2)
    assert profile.intra_node.bandwidth_gbps > 0 and profile.devices_per_node == 2, profile
    assert profile.fair_core_share == ranks[0].fair_core_share and profile.core_share <= profile.fair_core_share
    # compute with 1 of the 2 ranks busy, then both, relative to both: the same figures on every rank, in the profile
    assert [k for k, _ in ranks[0].busy_compute_scale] == [1, 2] and ranks[0].busy_compute_scale[1][1] == 1.0, (
        ranks[0].busy_compute_scale)
    assert ranks[0].busy_compute_scale[0][1] > 0 and ranks[0].busy_compute_scale == ranks[1].busy_compute_scale
    assert profile.busy_compute_scale == ranks[0].busy_compute_scale and profile.ranks_per_machine == 2, profile
    assert Hardware.from_json(profile.to_json()).busy_compute_scale == profile.busy_compute_scale
    # a one-row linear's read of its matrices, at the copy's working sets; the profile's figure its largest
    assert [size for size, _ in ranks[0].gemv_curve] == [size for size, _ in ranks[0].copy_curve], ranks[0].gemv_curve
    assert all(rate > 1e8 for _, rate in ranks[0].gemv_curve), ranks[0].gemv_curve
    assert profile.gemv_bandwidth_gbps == profile.gemv_bandwidth_curve[-1][1] > 0, profile.gemv_bandwidth_curve
    # in-graph calibration: every graph shape timed on both ranks, one all-reduce per row-split projection
    quick = CalibrationConfig.quick()
    assert len(ranks[0].graphs) == len(quick.graph_shapes), ranks[0].graphs
    for shape, sample in zip(quick.graph_shapes, ranks[0].graphs):
        assert len(sample.collectives) == shape.all_reduces, (shape, sample)
        assert sample.seconds > 0 and sample.kernel_nodes > 0, sample
        assert sample.work_s > 0 and 0 < sample.core_share <= 1, f"work clock and core share measured: {sample}"
        assert sample.compute_s > 0 and sample.compute_work_s > 0, f"compute form measured: {sample}"
        assert sample.working_set_bytes > 0, f"the working set its cold cost is resolved at: {sample}"
    assert [g.seconds for g in ranks[0].graphs] == [g.seconds for g in ranks[1].graphs], "slowest rank's times"
    assert len(ranks[0].gemm_samples) == len(quick.gemm_tokens) and ranks[0].transcendental_element_s > 0, ranks[0]
    assert profile.runtime_mode == "eager" and profile.host_is_device, profile
    assert profile.model_call_s == pytest.approx(
        statistics.median(m.model_call_s for m in ranks) / profile.core_share), "work seconds over the core share"
    sizes = [size for size, _ in ranks[0].copy_curve]  # the quick working sets and the large copy, ascending
    assert sizes == sorted(sizes) and len(sizes) == len(quick.bandwidth_working_sets) + 1, ranks[0].copy_curve
    assert [size for size, _ in profile.memory_bandwidth_curve] == sizes, profile.memory_bandwidth_curve
    assert profile.small_all_reduce == "shared_memory" and profile.shared_memory_link is not None, (
        f"a gloo profile on one host prices the shared-memory all-reduce the runtime runs, got "
        f"{profile.small_all_reduce!r} on {profile.shared_memory_link}")
    assert profile.shared_memory_link.bandwidth_gbps > 0, profile.shared_memory_link
    assert "rank-local graphs" in profile.source, profile.source


def test_cli_calibrate_writes_the_profile(tmp_path, monkeypatch, capsys) -> None:
    """tp=2 (measurement stubbed): `autotp calibrate --quick --world-size 2 -o PATH` writes a loadable profile and
    prints its terms, the core share's range and loss among them."""
    samples = synthetic_samples(group_sizes=(2,))
    profile = build_profile([synthetic_rank(0, samples)], samples, world_size=2, name="cpu-stub")
    seen = {}

    def fake_calibrate(world_size: int, *, config: CalibrationConfig, name: str) -> Hardware:
        seen.update(world_size=world_size, config=config, name=name)
        return dataclasses.replace(profile, name=name, core_share=0.45, fair_core_share=0.5,
                                   core_share_range_s=15e-3, core_share_call_s=250e-6)

    monkeypatch.setattr(measuring, "calibrate", fake_calibrate)
    path = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--world-size", "2", "-o", str(path), "--name", "box"]) == 0
    assert seen["world_size"] == 2 and seen["name"] == "box" and seen["config"].progress, seen
    assert seen["config"].matmul_sizes == CalibrationConfig.quick().matmul_sizes, "--quick selects the quick sizes"
    assert get_hardware(str(path)).name == "box"
    out = capsys.readouterr().out
    assert "wrote" in out and "hardware=" in out, out
    assert "0.45 of a core per rank" in out and "up to 15.0 ms of a call's compute; 0.50 beyond; 250.0 us lost" in out


def test_shared_memory_link_keeps_the_copy_bandwidth_when_sizes_do_not_tell() -> None:
    """One host, 4 ranks on fewer cores: shared-memory timings flat in size (waking up dominates).
    The link is still fitted: latency from the samples, bandwidth the ranks' measured copy bandwidth."""
    flat = [CollectiveSample(SHARED_MEMORY_KIND, 4, n, t) for n, t in ((4 << 10, 4e-4), (16 << 10, 4e-4), (64 << 10, 3.9e-4))]
    with pytest.raises(ValueError, match="do not grow with message size"):
        fit_link(flat)
    fit = profile_fit._fit_shared_memory_link(flat, 10e9)
    assert fit.bandwidth_bytes_per_s == 10e9, f"expected the copy bandwidth 1e10 B/s, got {fit.bandwidth_bytes_per_s}"
    steps, factor = profile_fit._link_terms(flat[0])
    smallest = fit.base_latency_s + steps * fit.latency_s + factor * flat[0].nbytes / fit.bandwidth_bytes_per_s
    assert math.isclose(smallest, 4e-4, rel_tol=0.25), f"the 4 KiB call should cost about 0.4 ms, fitted {smallest}"


def test_a_gloo_link_whose_timings_do_not_grow_with_size_still_makes_a_profile() -> None:
    """tp=4 on fewer cores (synthetic): gloo timings flat in message size (waking up dominates every size; two of three
    quick calibrations at tp 4 on this project's 2-core VM). The profile is still built, its bandwidth the least the
    samples allow (the fastest message's bytes over its time, so no large message is priced faster than one was
    measured) and the latency fitted on it; the source says so."""
    flat = [CollectiveSample(kind, 4, n, 2e-3 - 1e-6 * index)
            for index, (kind, n) in enumerate((kind, n) for kind in KINDS for n in (4 << 10, 64 << 10, 1 << 20))]
    with pytest.raises(ValueError, match="do not grow with message size"):
        fit_link(flat)
    bound = profile_fit.bandwidth_lower_bound(flat)
    assert bound == pytest.approx(max(profile_fit._link_terms(s)[1] * s.nbytes / s.seconds for s in flat))
    profile = build_profile([synthetic_rank(0, flat)], flat, world_size=4)
    assert profile.intra_node.bandwidth_gbps == pytest.approx(bound / 1e9), profile.intra_node
    assert "bandwidth not told apart from the latency" in profile.source, profile.source
    largest = max(flat, key=lambda s: s.nbytes)
    assert link_collective_time_s(largest.kind, largest.nbytes, 4, profile.intra_node) >= 0.5 * largest.seconds
    with pytest.raises(ValueError, match="no collective samples"):
        profile_fit.bandwidth_lower_bound([])


def _call_times(rank: int, world_size: int) -> tuple[list[float], bool, float, float, float, float]:
    from autotp.calibration.graphs import common_start, group_call_s, ranks_share_a_clock, time_in_turn

    # rank 0 entered at 0.0 and left at 1.0, rank 1 entered at 0.4 and left at 1.1 (seconds on one clock)
    starts, ends = ([0.0], [1.0]) if rank == 0 else ([0.4], [1.1])
    shared = ranks_share_a_clock()
    group = group_call_s(starts, ends, share_a_clock=shared)
    moment = common_start(shared)
    arrived = time.perf_counter()
    tensor = torch.ones(4)

    def late_rank_one() -> None:  # rank 1 reaches the all-reduce 20 ms after rank 0, on every call
        if rank == 1:
            time.sleep(0.02)
        dist.all_reduce(tensor)

    def slow_rank_one() -> None:  # no collective: rank 1 takes 20 ms, rank 0 nothing
        if rank == 1:
            time.sleep(0.02)

    (together_s, _), (apart_s, _) = time_in_turn([late_rank_one, slow_rank_one], runs=3, warmup=1)
    return group, shared, moment, arrived, together_s, apart_s


def test_calls_are_timed_on_the_group_from_one_start(gloo) -> None:
    """tp=2, real gloo processes: the ranks share a clock (one host); a call counts from the first start to the
    last end (1.1 - 0.0 s); `common_start` names one moment on every rank and returns no earlier; a timed call
    where rank 1 reaches the all-reduce 20 ms late takes those 20 ms on every rank, and so does one without a
    collective where rank 1 alone takes 20 ms."""
    ranks = gloo.run(2, _call_times)
    for group, shared, moment, arrived, together_s, apart_s in ranks:
        assert shared, "ranks of one host share a clock"
        assert group == pytest.approx([1.1]), group
        assert arrived >= moment, (arrived, moment)
        assert together_s >= 0.02 and apart_s >= 0.02, (together_s, apart_s)
    assert ranks[0][2] == ranks[1][2], "every rank starts at one moment"
    assert ranks[0][4] == ranks[1][4] and ranks[0][5] == ranks[1][5], "every rank returns the same call time"


def _in_step_loops(rank: int, world_size: int) -> tuple[int, list[float]]:
    from autotp.calibration.graphs import median_work_s

    calls: list[float] = []
    work_s = 2e-4 if rank == 1 else 2e-5  # rank 1's op costs ten times rank 0's

    def run() -> None:
        calls.append(time.perf_counter())
        until = time.thread_time() + work_s
        while time.thread_time() < until:
            pass

    median_work_s(run, min_time_s=2e-2, repeats=3)  # 20 ms: longer than a rank waits for a core under load
    return len(calls), calls


def test_single_ops_are_timed_in_step_on_every_rank(gloo) -> None:
    """tp=2, real gloo processes: `median_work_s` loops as many calls on every rank (the most any rank needs: rank 0's
    ten-times-cheaper op sets it) and runs each timed repeat on both ranks at once, so that neither rank times its
    op beside a core the other left idle (timed on its own, rank 0 would finish its three repeats within rank 1's
    first)."""
    (count_0, calls_0), (count_1, calls_1) = gloo.run(2, _in_step_loops)
    assert count_0 == count_1, f"rank 0 called its op {count_0} times, rank 1 {count_1}"
    per_repeat = (count_0 - 2) // 3  # two untimed calls, then three repeats
    assert per_repeat >= 200, f"rank 0 needs about 1000 calls per 20 ms, rank 1 100; the ranks looped {per_repeat}"
    for repeat in range(3):
        first, last = 2 + repeat * per_repeat, 1 + (repeat + 1) * per_repeat
        assert calls_0[first] < calls_1[last] and calls_1[first] < calls_0[last], (
            f"repeat {repeat} ran on rank 0 from {calls_0[first]:.4f} to {calls_0[last]:.4f} s and on rank 1 from "
            f"{calls_1[first]:.4f} to {calls_1[last]:.4f} s: not at once")


def test_a_measured_network_becomes_the_inter_node_link() -> None:
    """2 hosts x 2 ranks (synthetic): samples across hosts of a 25 MB/s link become inter_node, the launcher's
    ranks per host devices_per_node; samples inside the hosts refit intra_node. The network differs from the
    loopback link the profile had there, so the check tells a measured network from the copied one."""
    from autotp.cost_model.calibrate import with_measured_links

    samples = synthetic_samples(group_sizes=(2,))
    profile = build_profile([synthetic_rank(0, samples)], samples, world_size=4)
    network = LinkProfile(name="slow", bandwidth_gbps=0.025, latency_s=300e-6, base_latency_s=100e-6)
    inside = LinkProfile(name="inside", bandwidth_gbps=0.5, latency_s=60e-6, base_latency_s=40e-6)
    assert math.isclose(profile.inter_node.bandwidth_gbps, 2.5, rel_tol=1e-6), profile.inter_node
    two_level = with_measured_links(profile, synthetic_samples(network, group_sizes=(2,)), devices_per_node=2,
                                    inside=synthetic_samples(inside, group_sizes=(2,)))
    assert math.isclose(two_level.inter_node.bandwidth_gbps, 0.025, rel_tol=1e-6), two_level.inter_node
    assert math.isclose(two_level.intra_node.bandwidth_gbps, 0.5, rel_tol=1e-6), two_level.intra_node
    assert two_level.devices_per_node == 2 and "measured across 2 hosts" in two_level.source, two_level.source
    assert two_level.peak_tflops == profile.peak_tflops, "compute terms are kept"
    with pytest.raises(ValueError, match="no collective samples across hosts"):
        with_measured_links(profile, (), devices_per_node=2)
    assert two_level.inter_node_send is None, "no sends measured: a send is priced on inter_node"


def test_one_way_sends_between_hosts_are_priced_on_their_own_line() -> None:
    """2 hosts (synthetic): collectives across hosts (both ways at once) at 20 MB/s, one-way sends at 25 MB/s. The
    line through the sends becomes inter_node_send (its slope the bandwidth, its intercept the latency), which prices
    a send between nodes (p2p_time_s) while collectives keep inter_node; a line that meets the axis below zero (a token
    bucket's burst) becomes the burst, off a send's bytes, and a send never costs less than one inside a node. It
    survives the JSON round trip, and a network the user describes instead (with_nodes) drops it."""
    from autotp.cost_model import p2p_time_s
    from autotp.cost_model.calibrate import SEND_KIND, with_measured_links, with_nodes

    samples = synthetic_samples(group_sizes=(2,))
    profile = build_profile([synthetic_rank(0, samples)], samples, world_size=4)
    exchanges = LinkProfile(name="exchanges", bandwidth_gbps=0.020, latency_s=300e-6, base_latency_s=100e-6)
    network = synthetic_samples(exchanges, group_sizes=(2,))

    def measured(seconds_of: Callable[[int], float]) -> Hardware:
        sends = [CollectiveSample(SEND_KIND, 2, n, seconds_of(n)) for n in (2**20, 4 * 2**20)]
        return with_measured_links(profile, [*network, *sends], devices_per_node=2)

    two_level = measured(lambda n: 4e-3 + n / 25e6)
    assert math.isclose(two_level.inter_node.bandwidth_gbps, 0.020, rel_tol=1e-6), two_level.inter_node
    send = two_level.inter_node_send
    assert send is not None and math.isclose(send.bandwidth_gbps, 0.025, rel_tol=1e-6), send
    assert math.isclose(send.latency_s, 4e-3, rel_tol=1e-6) and (send.base_latency_s, send.burst_bytes) == (0, 0), send
    nbytes = 4 * 2**20
    assert math.isclose(p2p_time_s(nbytes, two_level, spans_nodes=True), 4e-3 + nbytes / 25e6, rel_tol=1e-9)
    assert p2p_time_s(nbytes, two_level, spans_nodes=True) < p2p_time_s(nbytes, dataclasses.replace(
        two_level, inter_node_send=None), spans_nodes=True), "a send alone is priced faster than an exchange"
    assert Hardware.from_dict(two_level.to_dict()).inter_node_send == send
    assert with_nodes(two_level, inter_node_bandwidth_gbps=1.0).inter_node_send is None

    bucket = measured(lambda n: (n - 50_000) / 25e6)  # 2 ms below the rate: a 50 kB burst
    send = bucket.inter_node_send
    assert send is not None and send.latency_s == 0 and math.isclose(send.burst_bytes, 50_000, rel_tol=1e-6), send
    assert math.isclose(p2p_time_s(nbytes, bucket, spans_nodes=True), (nbytes - 50_000) / 25e6, rel_tol=1e-9)
    inside_s = bucket.intra_node.base_latency_s + bucket.intra_node.latency_s
    assert inside_s > 0 and math.isclose(p2p_time_s(32 * 2**10, bucket, spans_nodes=True), inside_s), \
        "a send within the burst costs a send's fixed cost inside a node"
    assert Hardware.from_dict(bucket.to_dict()).inter_node_send == send
