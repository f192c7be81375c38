"""Cost-model fidelity (issue 16): host terms per runtime mode, in-graph fits, GEMM curve, profiles.

Tier (a): pure functions on synthetic measurements and datasheet profiles, no process group;
one tiny Llama planned on meta at tp=2 for the estimate's host lines.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
from inspect_helpers import tiny_plan
from models import tiny_cnn, tiny_mlp

import autotp
from autotp.calibration.graphs import block_graph, local_stand_ins
from autotp.capture.tracing import capture
from autotp.cost_model import Hardware, collective_time_s, compute_time_s, get_hardware, link_collective_time_s
from autotp.cost_model.bandwidth import cold_call_at_s
from autotp.cost_model.compute import aten_memory_bytes, gemm_dims, gemm_efficiency, op_name
from autotp.cost_model.graph_calibration import (
    GRAPH_FAMILIES,
    GemmSample,
    GraphSample,
    GraphShape,
    fit_core_share,
    fit_gemm_curve,
    fit_host_terms,
    fit_in_graph_scale,
    fit_wait_line,
    fit_wait_terms,
    graph_link_s,
    priced_work_s,
)
from autotp.cost_model.hardware import RUNTIME_MODES, LinkProfile
from autotp.cost_model.runtime import graph_host_s
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.strategies import build_strategy_graph

CPU = dataclasses.replace(
    get_hardware("cpu-gloo"), peak_tflops={"float32": 0.05}, memory_bandwidth_gbps=5.0, kernel_floor_s=6e-6,
    view_op_s=2e-6, host_dispatch_s=20e-6, host_is_device=True,
)
LINK = LinkProfile(name="synthetic", bandwidth_gbps=0.3, latency_s=0.0, base_latency_s=600e-6)


def test_host_fit_recovers_known_terms_from_synthetic_graphs() -> None:
    """tp=2 graphs of 1-4 blocks, the deepest without collectives (synthetic timings): the fit returns the
    dispatch, wait and call terms they were made with."""
    dispatch_s, wait_s, launch_s, view_s = 23e-6, 410e-6, 35e-6, 3e-6
    samples = []
    for layers in (1, 2, 4):
        for device_per_layer_s in (0.2e-3, 3e-3):
            kernels, views, device_s = 25 * layers, 8 * layers, device_per_layer_s * layers
            collectives = tuple(("all_reduce", 2**14 * (1 + layers), 2) for _ in range(2 * layers if layers < 4 else 0))
            link_s = sum(link_collective_time_s(k, n, p, LINK) for k, n, p in collectives)
            seconds = device_s + kernels * dispatch_s + views * view_s + link_s + len(collectives) * wait_s + launch_s
            samples.append(GraphSample(kernels, views, device_s, collectives, seconds))
    fit = fit_host_terms(samples, view_op_s=view_s, link=LINK)
    for name, expected, actual in (("host_dispatch_s", dispatch_s, fit.host_dispatch_s),
                                   ("collective_wait_s", wait_s, fit.collective_wait_s),
                                   ("graph_launch_s", launch_s, fit.graph_launch_s)):
        assert math.isclose(actual, expected, rel_tol=1e-6), f"{name}: expected {expected}, got {actual}"
    assert fit.median_abs_rel_error < 1e-9, fit


def test_host_fit_without_collectives_and_with_too_few_graphs() -> None:
    """tp=1 graphs: no collective term; fewer graphs than unknowns is a clear error."""
    samples = [GraphSample(25 * n, 8 * n, 1e-3 * n, (), 1e-3 * n + 25 * n * 7e-6 + 8 * n * 2e-6 + 5e-6) for n in (1, 3)]
    fit = fit_host_terms(samples, view_op_s=2e-6, link=None)
    assert math.isclose(fit.host_dispatch_s, 7e-6, rel_tol=1e-6) and fit.collective_wait_s == 0.0, fit
    with pytest.raises(ValueError, match="at least 2 graph samples"):
        fit_host_terms(samples[:1], view_op_s=2e-6, link=None)


def test_gemm_fit_recovers_the_half_rate_dim_and_the_peak() -> None:
    """Linear (m, 256) @ (256, 256) at m = 1..256 timed by the model with d_half = 32: the fit returns 32, and
    the peak the curve tends to from the best rate measured (that of m = 256, 256/288 of the peak)."""
    truth = dataclasses.replace(CPU, host_dispatch_s=0.0, gemm_half_efficiency_dim=32.0)
    samples = []
    for m in (1, 4, 16, 64, 256):
        flops, moved = 2 * m * 256 * 256, 4 * (m * 256 + 256 * 256 + 256 + m * 256)
        samples.append(GemmSample(m, 256, 256, compute_time_s(flops, moved, torch.float32, truth, gemm_min_dim=m)))
    best_rate = {"float32": truth.peak_tflops["float32"] * 256 / (256 + 32)}
    fitted = fit_gemm_curve(samples, dataclasses.replace(truth, gemm_half_efficiency_dim=0.0, peak_tflops=best_rate))
    assert fitted.half_dim == 32.0, f"expected d_half 32, got {fitted}"
    assert math.isclose(fitted.peak_scale, 288 / 256, rel_tol=0.05), f"expected a peak scale of 1.125, got {fitted}"


def test_gemm_efficiency_is_monotone_and_saturates() -> None:
    """The shape curve: increasing in the smallest dim from 2, 1/2 at d_half, below 1, flat 1 without a curve;
    a dim of 1 (a matrix-vector product, bandwidth bound) is not derated."""
    profile = dataclasses.replace(CPU, gemm_half_efficiency_dim=48.0)
    assert gemm_efficiency(1, profile) == 1.0, "a GEMV's roof is its bytes"
    values = [gemm_efficiency(d, profile) for d in (2, 8, 48, 64, 512, 8192)]
    assert all(a < b for a, b in zip(values, values[1:])), f"not increasing: {values}"
    assert math.isclose(gemm_efficiency(48, profile), 0.5) and values[-1] < 1, values
    assert gemm_efficiency(1, CPU) == 1.0, "no curve: the peak at every shape"
    aten = torch.ops.aten
    x, w = torch.empty(2, 3, 64, device="meta"), torch.empty(128, 64, device="meta")
    assert gemm_dims(aten.linear.default, (x, w)) == (6, 128, 64), gemm_dims(aten.linear.default, (x, w))
    assert gemm_dims(aten.add.Tensor, (x, x)) is None


def test_skinny_gemm_and_transcendentals_cost_more_where_compute_bound() -> None:
    """The roofline uses the curve (a 1-token GEMM runs below peak) and prices exp per element when that bounds it."""
    curved = dataclasses.replace(CPU, host_dispatch_s=0.0, gemm_half_efficiency_dim=64.0, memory_bandwidth_gbps=1e4)
    flat = dataclasses.replace(curved, gemm_half_efficiency_dim=0.0)
    flops, moved = 2 * 4 * 4096 * 4096, 4 * 4096 * 4096
    assert compute_time_s(flops, moved, torch.float32, curved, gemm_min_dim=4) > 10 * compute_time_s(
        flops, moved, torch.float32, flat, gemm_min_dim=4), "a 4-row GEMM at 4/68 of peak"
    slow_exp = dataclasses.replace(flat, transcendental_element_s=1e-9)
    numel = 2**20
    memory_only = compute_time_s(0, 8 * numel, torch.float32, slow_exp)
    with_exp = compute_time_s(0, 8 * numel, torch.float32, slow_exp, rated_elements=numel)
    assert math.isclose(with_exp, numel * 1e-9 + slow_exp.kernel_floor_s + 0.0), (memory_only, with_exp)
    assert with_exp > memory_only, (memory_only, with_exp)


class _TanhPlusExp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + torch.exp(x)


def test_a_transcendental_op_measured_by_name_is_priced_at_its_own_rate() -> None:
    """One op's own rate (tanh at 3 ns per element) prices it; an op not named (exp) keeps the median rate; a traced
    graph's tanh node costs more than its exp node of the same size; the rates survive JSON, alone() divides them
    by the core share, and a malformed table is refused naming the field."""
    rated = dataclasses.replace(CPU, host_dispatch_s=0.0, memory_bandwidth_gbps=1e4, transcendental_element_s=0.6e-9,
                                op_element_s=(("tanh", 3e-9),), core_share=0.5)
    numel = 2**20
    tanh_s = compute_time_s(0, 8 * numel, torch.float32, rated, rated_elements=numel, rated_op="tanh")
    exp_s = compute_time_s(0, 8 * numel, torch.float32, rated, rated_elements=numel, rated_op="exp")
    assert tanh_s == pytest.approx(numel * 3e-9 + rated.kernel_floor_s), tanh_s
    assert exp_s == pytest.approx(numel * 0.6e-9 + rated.kernel_floor_s), exp_s
    assert op_name(torch.ops.aten.tanh.default) == "tanh" and op_name(torch.ops.aten.gelu.default) == "gelu"
    captured = capture(_TanhPlusExp(), (torch.randn(256, 1024),), None)
    costed = cost_strategy_graph(build_strategy_graph(captured.graph_module, 1, {}, frozenset()), rated)
    by_op = {str(node.target): costed.compute_s[node.name][0] for node in captured.graph_module.graph.nodes
             if node.op == "call_function" and node.target in (torch.ops.aten.tanh.default, torch.ops.aten.exp.default)}
    assert by_op["aten.tanh.default"] > 3 * by_op["aten.exp.default"], by_op
    assert Hardware.from_json(rated.to_json()) == rated
    assert rated.alone().element_rate_s("tanh") == pytest.approx(1.5e-9), rated.alone()
    with pytest.raises(ValueError, match="op_element_s"):
        dataclasses.replace(CPU, op_element_s=(("tanh", 1e-9), ("tanh", 2e-9)))


def test_runtime_mode_changes_the_prediction_in_the_expected_direction() -> None:
    """A tiny op: eager pays its dispatch (added on a CPU, overlapped on a GPU); compiled and cuda_graph do not."""
    tiny = (0, 64)  # flops, bytes
    cpu = {mode: compute_time_s(*tiny, torch.float32, dataclasses.replace(CPU, runtime_mode=mode))
           for mode in RUNTIME_MODES}
    assert math.isclose(cpu["eager"] - cpu["cuda_graph"], CPU.host_dispatch_s), cpu
    assert cpu["compiled"] == cpu["cuda_graph"] < cpu["eager"], cpu
    h200 = dataclasses.replace(get_hardware("h200"), runtime_mode="eager")
    gpu = {mode: compute_time_s(*tiny, torch.bfloat16, dataclasses.replace(h200, runtime_mode=mode))
           for mode in RUNTIME_MODES}
    assert gpu["eager"] == h200.host_dispatch_s > gpu["cuda_graph"], f"host-bound tiny op on a GPU: {gpu}"
    big = (2 * 8192**3, 3 * 2 * 8192**2)  # a large GEMM hides the dispatch on a GPU
    eager_big = compute_time_s(*big, torch.bfloat16, h200)
    graph_big = compute_time_s(*big, torch.bfloat16, dataclasses.replace(h200, runtime_mode="cuda_graph"))
    assert eager_big == graph_big, (eager_big, graph_big)


def test_collective_in_a_graph_pays_its_wait() -> None:
    """tp=2: a collective costs its link time plus collective_wait_s; nothing when nothing is sent."""
    waiting = dataclasses.replace(CPU, collective_wait_s=300e-6)
    bare = collective_time_s("all_reduce", 4096, 2, CPU)
    assert math.isclose(collective_time_s("all_reduce", 4096, 2, waiting), bare + 300e-6), bare
    assert collective_time_s("all_reduce", 4096, 1, waiting) == 0.0


def test_profiles_save_and_load_the_new_fields_and_old_json_gets_defaults(tmp_path) -> None:
    """Round trip of every host field; a profile JSON from before them loads with eager, no host terms."""
    profile = dataclasses.replace(CPU, runtime_mode="cuda_graph", graph_launch_s=9e-6, collective_wait_s=1e-4,
                                  call_sync_wait_s=7e-4, call_sync_wait_per_compute=0.3, gemm_half_efficiency_dim=24.0,
                                  transcendental_element_s=2e-9, call_sync_wait_compute_range_s=4e-3)
    assert Hardware.from_json(profile.to_json()) == profile
    old = json.loads(profile.to_json())
    for key in ("runtime_mode", "host_dispatch_s", "host_is_device", "graph_launch_s", "collective_wait_s",
                "call_sync_wait_s", "call_sync_wait_per_compute", "gemm_half_efficiency_dim",
                "transcendental_element_s", "call_sync_wait_compute_range_s"):
        del old[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = get_hardware(str(path))
    assert (loaded.runtime_mode, loaded.host_dispatch_s, loaded.host_is_device, loaded.graph_launch_s,
            loaded.collective_wait_s, loaded.call_sync_wait_s, loaded.call_sync_wait_per_compute,
            loaded.gemm_half_efficiency_dim, loaded.call_sync_wait_compute_range_s) == (
                "eager", 0.0, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), loaded
    assert compute_time_s(0, 64, torch.float32, loaded) == compute_time_s(
        0, 64, torch.float32, dataclasses.replace(CPU, host_dispatch_s=0.0)), "old profiles price as before"
    with pytest.raises(ValueError, match="runtime_mode must be one of"):
        dataclasses.replace(CPU, runtime_mode="graph")


def test_core_share_round_trips_old_json_reads_one_and_alone_undoes_it(tmp_path) -> None:
    """tp=4 on 2 cores (synthetic profile, core share 0.5): the share survives JSON; a profile written before
    the field loads with 1.0 (alone() is then the profile itself); alone() gives every work rate at a whole
    core (rates x2, host and per-element times /2) and leaves the links; a share outside (0, 1] is refused."""
    busy = dataclasses.replace(CPU, core_share=0.5, graph_launch_s=40e-6, transcendental_element_s=2e-9,
                               memory_bandwidth_curve=((2**20, 40.0), (2**28, 8.0)))
    assert Hardware.from_json(busy.to_json()) == busy and json.loads(busy.to_json())["core_share"] == 0.5
    old = json.loads(busy.to_json())
    del old["core_share"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = get_hardware(str(path))
    assert loaded.core_share == 1.0 and loaded.alone() is loaded, loaded
    alone = busy.alone()
    for name, expected, actual in (
            ("peak_tflops", 0.1, alone.peak_tflops["float32"]),
            ("memory_bandwidth_gbps", 10.0, alone.memory_bandwidth_gbps),
            ("memory_bandwidth_curve", (80.0, 16.0), tuple(gbps for _, gbps in alone.memory_bandwidth_curve)),
            ("view_op_s", 1e-6, alone.view_op_s),
            ("host_dispatch_s", 10e-6, alone.host_dispatch_s),
            ("graph_launch_s", 20e-6, alone.graph_launch_s),
            ("transcendental_element_s", 1e-9, alone.transcendental_element_s),
            ("core_share", 1.0, alone.core_share),
            ("kernel_floor_s", busy.kernel_floor_s, alone.kernel_floor_s)):
        assert expected == pytest.approx(actual), f"alone().{name}: expected {expected}, got {actual}"
    assert (alone.intra_node, alone.inter_node) == (busy.intra_node, busy.inter_node), "links unchanged"
    assert compute_time_s(2 * 64**3, 3 * 64 * 64 * 4, torch.float32, alone) < compute_time_s(
        2 * 64**3, 3 * 64 * 64 * 4, torch.float32, busy), "a whole core computes faster than half of one"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"core_share must be"):
            dataclasses.replace(CPU, core_share=bad)


def test_the_core_share_holds_up_to_the_graphs_longest_compute_and_the_fair_share_beyond(tmp_path) -> None:
    """tp=4 on 2 cores (synthetic timings at a core share of 0.4, the fair share 0.5): the fit records the longest
    compute of the graphs as the share's range and the fair share; without the fair share recorded, or at a
    share equal to it, there is no range. A profile prices a call's compute as is up to the range and the rest at
    the fair share; the fields survive JSON, a profile written before them reads no range; alone() drops the
    range and the loss a call pays for taking turns; a share above the fair one is refused."""
    floor_s, view_s = 5e-6, 2e-6
    samples = _graphs_scaled(1.2, floor_s, view_s, 0.4)
    longest_s = max(sample.compute_s for sample in samples)
    fit = fit_host_terms(samples, view_op_s=view_s, link=None, kernel_floor_s=floor_s, fair_core_share=0.5)
    assert (fit.core_share, fit.core_share_range_s, fit.fair_core_share) == pytest.approx((0.4, longest_s, 0.5))
    assert fit.median_abs_rel_error < 1e-9, "no graph is beyond the range it sets"
    assert fit_host_terms(samples, view_op_s=view_s, link=None, kernel_floor_s=floor_s).core_share_range_s == 0.0
    at_fair = _graphs_scaled(1.2, floor_s, view_s, 0.5)
    assert fit_host_terms(at_fair, view_op_s=view_s, link=None, kernel_floor_s=floor_s,
                          fair_core_share=0.5).core_share_range_s == 0.0

    busy = dataclasses.replace(CPU, core_share=0.4, fair_core_share=0.5, core_share_range_s=10e-3,
                               core_share_call_s=0.3e-3)
    assert graph_host_s(busy) == pytest.approx(graph_host_s(CPU) + 0.3e-3), "the loss is paid once per call"
    assert busy.shared_core_compute_s(8e-3) == 8e-3
    assert busy.shared_core_compute_s(30e-3) == pytest.approx(10e-3 + 20e-3 * 0.4 / 0.5)
    assert CPU.shared_core_compute_s(30e-3) == 30e-3, "no range: the share holds for any compute"
    assert Hardware.from_json(busy.to_json()) == busy
    old = json.loads(busy.to_json())
    del old["core_share_range_s"], old["fair_core_share"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert get_hardware(str(path)).shared_core_compute_s(30e-3) == 30e-3
    alone = busy.alone()
    assert (alone.core_share_range_s, alone.fair_core_share, alone.core_share_call_s) == (0.0, 1.0, 0.0), alone
    assert dataclasses.replace(CPU, core_share_call_s=0.3e-3).alone().core_share_call_s == 0.0
    with pytest.raises(ValueError, match="cannot exceed fair_core_share"):
        dataclasses.replace(CPU, core_share=0.6, fair_core_share=0.5)


def test_the_core_share_and_the_loss_per_call_are_a_line_over_the_graphs() -> None:
    """tp=4 on 2 cores (synthetic timings): graphs of 0.2-6 ms of work whose wall time is work / 0.45 + 0.3 ms give
    back both numbers (their ratio of work to wall alone runs from 0.24 to 0.42); one graph that lost 5 ms moves
    neither by more than 2%; a line steeper than the fair share is held at it; fewer than three graphs, or one
    length of work, give the ratio and no loss; bad inputs are clear errors."""
    work = [0.2e-3, 0.5e-3, 0.8e-3, 1.2e-3, 2e-3, 3e-3, 4.5e-3, 6e-3]
    wall = [w / 0.45 + 0.3e-3 for w in work]
    assert fit_core_share(work, wall, at_most=0.5) == pytest.approx((0.45, 0.3e-3), rel=1e-6)
    slow = list(wall)
    slow[3] += 5e-3
    share, per_call = fit_core_share(work, slow, at_most=0.5)
    assert share == pytest.approx(0.45, rel=0.02) and per_call == pytest.approx(0.3e-3, rel=0.02), (share, per_call)
    assert fit_core_share(work, wall, at_most=0.4)[0] == pytest.approx(0.4)
    assert fit_core_share(work[:2], wall[:2], at_most=0.5) == pytest.approx((sum(work[:2]) / sum(wall[:2]), 0.0))
    assert fit_core_share([1e-3] * 4, [2.5e-3] * 4, at_most=0.5) == pytest.approx((0.4, 0.0))
    for bad, match in (((work, wall[:3]), "one wall time per work"), (([0.0, 1e-3], [1e-3, 1e-3]), "must be > 0")):
        with pytest.raises(ValueError, match=match):
            fit_core_share(*bad)
    with pytest.raises(ValueError, match="at_most must be in"):
        fit_core_share(work, wall, at_most=0.0)


def test_estimate_shows_host_time_per_runtime_mode() -> None:
    """tp=2, tiny Llama on meta, H100 SXM: the estimate lists host dispatch per forward, eager above cuda_graph."""
    estimate = autotp.estimate(tiny_plan("llama", 2))
    host = estimate.host
    assert host is not None and host.kernels > 50, host
    h100 = get_hardware("h100-sxm")
    assert math.isclose(host.by_mode["eager"], host.kernels * h100.host_dispatch_s + h100.graph_launch_s), host
    assert host.by_mode["cuda_graph"] == h100.graph_launch_s < host.by_mode["eager"], host
    assert estimate.time_per_call_s == estimate.time_s + h100.graph_launch_s
    assert "host dispatch per forward" in estimate.summary() and "cuda_graph" in estimate.summary()


def _graphs_scaled(scale: float, floor_s: float, view_s: float, share: float) -> list[GraphSample]:
    """Graphs of 1-3 blocks of small kernels (2 tokens) and of large ones (a wide layer), without collectives,
    whose work is ``scale`` times what their single ops price (roofline, ``view_s`` per view, ``floor_s`` per
    kernel node): both clocks and the compute form."""
    samples = []
    for layers in (1, 2, 3):
        for kernel_s in ((1e-6, 3e-6, 20e-6), (2e-6, 50e-6, 400e-6), (1e-3, 3e-3)):
            kernels = tuple(kernel_s) * 10 * layers
            sample = GraphSample(len(kernels), 12 * layers, sum(kernels), (), 0.0, kernel_s=kernels)
            work_s = scale * priced_work_s(sample, view_s, floor_s)
            samples.append(dataclasses.replace(sample, seconds=work_s / share, work_s=work_s, core_share=share,
                                               compute_s=work_s / share, compute_work_s=work_s))
    return samples


def test_the_graphs_scale_every_single_op_price_by_one_fitted_number() -> None:
    """No parallelism (synthetic timings): graphs whose work is 1.6 times what their single ops price give back
    that scale, on the compute form and on the work clock alone; the dispatch per kernel node is the tiny-kernel
    floor so scaled (in wall time: over the core share), and no call is fitted. Graphs that took less than their
    single ops price (timed in a faster spell of the machine) scale by 1, not below. Timings a few percent off
    leave the scale a few percent off (the total over the total, where four fitted terms swung several-fold
    between calibrations); graphs of no work, or that price at none, are clear errors."""
    floor_s, view_s, share = 5e-6, 2e-6, 0.5
    for scale in (1.6, 0.8):
        samples = _graphs_scaled(scale, floor_s, view_s, share)
        for graphs in (samples, [dataclasses.replace(s, compute_s=0.0, compute_work_s=0.0) for s in samples]):
            fit = fit_host_terms(graphs, view_op_s=view_s, link=None, kernel_floor_s=floor_s)
            _check_host_fit(fit, scale=max(1.0, scale), floor_s=floor_s, share=share, wait_s=0.0)
            assert (fit.median_abs_rel_error < 1e-9) == (scale >= 1), fit
    samples = _graphs_scaled(1.6, floor_s, view_s, share)
    noisy = [s.compute_work_s * (1.04 if index % 2 else 0.96) for index, s in enumerate(samples)]
    assert fit_in_graph_scale(samples, noisy, view_op_s=view_s, node_s=floor_s) == pytest.approx(1.6, rel=0.04)
    with pytest.raises(ValueError, match="work must be > 0"):
        fit_in_graph_scale(samples[:1], [0.0], view_op_s=view_s, node_s=floor_s)
    with pytest.raises(ValueError, match="one work per graph"):
        fit_in_graph_scale(samples, noisy[:2], view_op_s=view_s, node_s=floor_s)
    with pytest.raises(ValueError, match="price at no work"):
        fit_in_graph_scale([GraphSample(0, 0, 0.0, (), 1e-3)], [1e-3], view_op_s=view_s, node_s=floor_s)


def test_a_profile_of_an_earlier_release_loads_unless_it_prices_a_kernel_extra() -> None:
    """Profiles from earlier releases of ``autotp calibrate`` carry an extra per kernel in a graph, which this
    release does not price: at 0 (as the calibration left it since the in-graph scale) the profile loads and
    prices as the same profile without the fields; at any other value it is refused, with what to run."""
    data = CPU.to_dict()
    assert Hardware.from_dict({**data, "kernel_extra_fraction": 0.0, "kernel_extra_cap_s": 0.0}) == CPU
    with pytest.raises(ValueError, match=r"'kernel_extra_fraction' = 0.5.*run `autotp calibrate` again"):
        Hardware.from_dict({**data, "kernel_extra_fraction": 0.5, "kernel_extra_cap_s": 1e-5})


def test_host_fit_on_the_work_clock_divides_by_the_core_share_and_takes_the_median_wait() -> None:
    """tp=4 on two cores (synthetic timings): graphs timed on the work clock with a core share of 1/2; the fit
    returns the scale of the single-op prices (fitted on the graphs without collectives, whose work is all
    compute), the dispatch in wall time (work / share), the share, and the median wait, which one disturbed
    graph does not move."""
    scale, floor_s, view_s, share, wait_s = 1.5, 6e-6, 2e-6, 0.5, 700e-6
    samples = []
    for layers in (1, 2, 3, 4):
        kernels, views, device_s = 30 * layers, 9 * layers, 0.4e-3 * layers
        work_s = scale * (device_s + kernels * floor_s + views * view_s)
        for with_collectives in (True, False):
            collectives = tuple(("all_reduce", 2**14, 4) for _ in range(2 * layers)) if with_collectives else ()
            # at tp 4 the graphs run each 16 KiB all-reduce in one round (passes/small_collectives.py)
            link_s = sum(link_collective_time_s(k, n, p, LINK, small_all_reduce="one_shot") for k, n, p in collectives)
            seconds = work_s / share + link_s + len(collectives) * wait_s * (3.0 if layers == 4 else 1.0)
            samples.append(GraphSample(kernels, views, device_s, collectives, seconds, work_s, share))
    fit = fit_host_terms(samples, view_op_s=view_s, link=LINK, kernel_floor_s=floor_s)
    _check_host_fit(fit, scale=scale, floor_s=floor_s, share=share, wait_s=wait_s)


def _check_host_fit(fit, *, scale: float, floor_s: float, share: float, wait_s: float) -> None:
    """The fitted host terms equal the ones the synthetic timings were made with (the dispatch: the floor scaled,
    per unit of core share; no call term)."""
    for name, expected, actual in (("in_graph_scale", scale, fit.in_graph_scale),
                                   ("host_dispatch_s", scale * floor_s / share, fit.host_dispatch_s),
                                   ("graph_launch_s", 0.0, fit.graph_launch_s),
                                   ("core_share", share, fit.core_share),
                                   ("collective_wait_s", wait_s, fit.collective_wait_s)):
        assert math.isclose(actual, expected, rel_tol=1e-6), f"{name}: expected {expected}, got {actual}"


def test_host_fit_prices_the_core_share_while_computing_as_compute_and_the_wait_beyond_measured_compute() -> None:
    """tp=4 on two cores (synthetic timings): each graph's compute is timed apart (collectives replaced by
    stand-ins) at a core share of 1/2. The fit takes the share from that compute, not from graphs without
    collectives alone, so compute is priced at the share a rank gets while computing; the wait is what the
    real form adds beyond measured compute and link, so a compute the kernels underprice (the deepest
    graphs here) does not leak into it; the real form's own work (host work of the collectives) is not used."""
    scale, floor_s, view_s, share, wait_s = 1.3, 8e-6, 2e-6, 0.5, 250e-6
    samples = []
    for layers in (1, 2, 3, 4):
        kernels, views, device_s = 30 * layers, 9 * layers, 0.4e-3 * layers
        compute_work_s = scale * (device_s + kernels * floor_s + views * view_s)
        compute_wall_s = compute_work_s / share
        for with_collectives in (True, False):
            collectives = tuple(("all_reduce", 2**14, 4) for _ in range(2 * layers)) if with_collectives else ()
            link_s = sum(link_collective_time_s(k, n, p, LINK, small_all_reduce="one_shot") for k, n, p in collectives)
            measured_compute_s = compute_wall_s * (1.5 if layers == 4 and with_collectives else 1.0)
            seconds = measured_compute_s + link_s + len(collectives) * wait_s
            real_work_s = compute_work_s + len(collectives) * 400e-6  # spinning in gloo: not compute
            samples.append(GraphSample(kernels, views, device_s, collectives, seconds, real_work_s, share,
                                       measured_compute_s, compute_work_s))
    fit = fit_host_terms(samples, view_op_s=view_s, link=LINK, kernel_floor_s=floor_s)
    _check_host_fit(fit, scale=scale, floor_s=floor_s, share=share, wait_s=wait_s)
    assert fit.link_base_adjust_s == 0.0, f"expected no link adjustment, got {fit.link_base_adjust_s}"
    # collectives that take less in a graph than back to back: no wait, the difference taken off the link
    faster = [dataclasses.replace(s, seconds=s.seconds - 2 * wait_s * len(s.collectives)) for s in samples]
    fit = fit_host_terms(faster, view_op_s=view_s, link=LINK, kernel_floor_s=floor_s)
    assert fit.collective_wait_s == 0.0 and math.isclose(fit.link_base_adjust_s, -wait_s, rel_tol=1e-6), (
        f"expected wait 0 and link adjustment {-wait_s}, got {fit.collective_wait_s}, {fit.link_base_adjust_s}")


def test_host_fit_separates_the_wait_of_a_call_from_the_wait_per_collective() -> None:
    """tp=4 on two cores (synthetic timings): graphs with 2 to 8 collectives and 0.6-9 ms of compute whose real
    form waits 0.9 ms once per call (ranks entering out of step), 0.3 ms per collective and 0.25 s per second of
    compute (ranks drifting apart while computing) beyond measured compute and link. The fit returns the three
    terms, not their mix per collective (the median of wait over count), which overprices many collectives
    and underprices one; graphs without collectives pay none of them. The compute the drift was fitted over
    ends at the largest graph's (18 ms): the range beyond which a call's compute adds no wait."""
    scale, floor_s, view_s, share = 1.2, 8e-6, 2e-6, 0.5
    sync_s, wait_s, per_compute = 900e-6, 300e-6, 0.25
    samples = []
    for layers in (1, 2, 3, 4):
        for device_per_layer_s in (0.2e-3, 1e-3):
            kernels, views, device_s = 30 * layers, 9 * layers, device_per_layer_s * layers
            compute_work_s = scale * (device_s + kernels * floor_s + views * view_s)
            compute_wall_s = compute_work_s / share
            for with_collectives in (True, False):
                collectives = tuple(("all_reduce", 2**14, 4) for _ in range(2 * layers)) if with_collectives else ()
                link_s = sum(link_collective_time_s(k, n, p, LINK, small_all_reduce="one_shot")
                             for k, n, p in collectives)
                waited_s = (sync_s + len(collectives) * wait_s + per_compute * compute_wall_s) if collectives else 0.0
                samples.append(GraphSample(kernels, views, device_s, collectives, compute_wall_s + link_s + waited_s,
                                           compute_work_s, share, compute_wall_s, compute_work_s))
    fit = fit_host_terms(samples, view_op_s=view_s, link=LINK, kernel_floor_s=floor_s)
    _check_host_fit(fit, scale=scale, floor_s=floor_s, share=share, wait_s=wait_s)
    for name, expected, actual in (("call_sync_wait_s", sync_s, fit.call_sync_wait_s),
                                   ("call_sync_wait_per_compute", per_compute, fit.call_sync_wait_per_compute)):
        assert math.isclose(actual, expected, rel_tol=1e-6), f"{name}: expected {expected}, got {actual}"
    assert fit.link_base_adjust_s == 0.0 and fit.median_abs_rel_error < 1e-9, fit
    largest_s = max(sample.compute_s for sample in samples if sample.collectives)
    assert fit.call_sync_wait_compute_range_s == largest_s, (fit.call_sync_wait_compute_range_s, largest_s)


def test_wait_terms_keep_a_negative_wait_per_collective_and_need_enough_graphs() -> None:
    """Collectives faster in a graph than back to back: a negative wait per collective is returned (the
    profile takes it off the link); with fewer than 4 graphs, the line over counts alone."""
    counts, compute = [2, 4, 6, 2, 4], [1e-3, 2e-3, 3e-3, 4e-3, 6e-3]
    waits = [0.5e-3 - 0.1e-3 * n + 0.2 * c for n, c in zip(counts, compute)]
    assert fit_wait_terms(counts, compute, waits) == pytest.approx((0.5e-3, -0.1e-3, 0.2), rel=1e-6, abs=1e-12)
    assert fit_wait_terms([2, 4, 6], [1e-3] * 3, [1.6e-3, 2.2e-3, 2.8e-3]) == pytest.approx((1.0e-3, 0.3e-3, 0.0))
    with pytest.raises(ValueError, match="one count, compute and wait per graph"):
        fit_wait_terms([2, 4], [1e-3], [1e-3, 2e-3])


def test_one_graph_that_lost_a_time_slice_does_not_move_the_wait_terms() -> None:
    """Eight graphs on ``0.2 ms + 0.05 ms per collective + 0.1 x compute``, one of them waiting 4 ms more (its
    ranks lost a time slice): the fit stays within 10% of each term (Cauchy loss), where least squares puts the
    outlier's wait into them (per collective 14 instead of 50 us)."""
    counts = [2, 4, 6, 2, 4, 6, 2, 6]
    compute = [1e-3, 2e-3, 3e-3, 3e-3, 6e-3, 9e-3, 5e-3, 5e-3]
    waits = [0.2e-3 + 0.05e-3 * n + 0.1 * c for n, c in zip(counts, compute)]
    waits[4] += 4e-3
    per_call, per_collective, per_compute = fit_wait_terms(counts, compute, waits)
    for name, got, expected in (("per call", per_call, 0.2e-3), ("per collective", per_collective, 0.05e-3),
                                ("per compute", per_compute, 0.1)):
        assert got == pytest.approx(expected, rel=0.1), f"{name}: {got:.3g}, expected {expected:.3g}"


def test_wait_per_compute_is_bounded_by_the_time_a_rank_is_off_its_core() -> None:
    """Two ranks on two cores (core share 0.98): graphs whose wait grows 0.3 s per second of compute cannot be
    drift (a rank is off its core 2% of the time), so the fit keeps that term at its bound and puts the rest
    in the per-call and per-collective terms; at a bound of 0 the term is dropped; a negative bound is refused."""
    counts, compute = [2, 4, 6, 2, 4, 6], [1e-3, 2e-3, 3e-3, 3e-3, 6e-3, 9e-3]
    waits = [0.1e-3 + 0.05e-3 * n + 0.3 * c for n, c in zip(counts, compute)]
    assert fit_wait_terms(counts, compute, waits)[2] == pytest.approx(0.3, rel=1e-6)
    per_call, per_collective, per_compute = fit_wait_terms(counts, compute, waits, per_compute_at_most=0.02)
    assert per_compute == pytest.approx(0.02, rel=1e-6), per_compute
    assert per_call >= 0.0 and per_collective > 0.05e-3, (per_call, per_collective)
    assert fit_wait_terms(counts, compute, waits, per_compute_at_most=0.0)[2] == 0.0
    with pytest.raises(ValueError, match="per_compute_at_most must be >= 0"):
        fit_wait_terms(counts, compute, waits, per_compute_at_most=-0.1)


def test_wait_line_falls_back_to_a_wait_per_collective() -> None:
    """The line through (collectives, wait): exact on a line; all of it per collective when the graphs all have
    one count (nothing tells the two terms apart) or when the intercept would be negative; nothing without
    graphs; a negative slope (collectives faster in a graph than back to back) is kept for the link."""
    assert fit_wait_line([2, 4, 6], [1.6e-3, 2.2e-3, 2.8e-3]) == pytest.approx((1.0e-3, 0.3e-3))
    assert fit_wait_line([2, 2, 2], [1.0e-3, 1.2e-3, 5.0e-3]) == pytest.approx((0.0, 0.6e-3))
    assert fit_wait_line([2, 4, 6], [0.8e-3, 2.4e-3, 4.0e-3]) == pytest.approx((0.0, 0.6e-3))  # 0.4-0.67 ms
    assert fit_wait_line([], []) == (0.0, 0.0)
    assert fit_wait_line([2, 4], [-0.2e-3, -0.4e-3]) == pytest.approx((0.0, -0.1e-3))
    with pytest.raises(ValueError, match="one wait per graph"):
        fit_wait_line([2, 4], [1e-3])


def test_estimate_pays_the_call_sync_wait_once_with_collectives() -> None:
    """tp=2 and tp=1, tiny Llama on meta, H100 SXM with a call sync wait of 1 ms and 0.1 s per second of
    compute: the tp=2 plan (with collectives) pays it once per call, in its communication, on a quarter of its
    compute where the profile's range ends there; the tp=1 plan never waits for another rank."""
    h100 = dataclasses.replace(get_hardware("h100-sxm"), call_sync_wait_s=1e-3, call_sync_wait_per_compute=0.1)
    split = tiny_plan("llama", 2)
    assert sum(split.collective_counts().values()) > 1, split.collective_counts()
    estimate = autotp.estimate(split, h100)
    expected = 1e-3 + 0.1 * estimate.compute_s
    assert math.isclose(estimate.call_sync_wait_s, expected), (estimate.call_sync_wait_s, expected)
    assert math.isclose(estimate.comm_per_call_s, estimate.comm_s + expected), estimate
    assert math.isclose(estimate.time_per_call_s, estimate.time_s + h100.graph_launch_s + expected), estimate
    assert "ranks out of step" in estimate.summary()
    bounded = dataclasses.replace(h100, call_sync_wait_compute_range_s=estimate.compute_s / 4)
    assert math.isclose(autotp.estimate(split, bounded).call_sync_wait_s, 1e-3 + 0.1 * estimate.compute_s / 4), (
        "a compute beyond the range the drift was fitted over adds no wait")
    alone = autotp.estimate(tiny_plan("llama", 1), h100)
    assert alone.call_sync_wait_s == 0.0 and alone.comm_per_call_s == alone.comm_s == 0.0, alone


def test_estimate_and_plan_price_compute_beyond_the_core_share_range_at_the_fair_share() -> None:
    """tp=2, tiny Llama on meta, H100 SXM with a core share of 0.25 up to a quarter of the plan's compute and the
    fair 0.5 beyond: the estimate takes off half the compute beyond the range, says so, and the plan the same
    profile makes predicts the same compute (the solver's accounting); the wait per compute is unchanged."""
    h100 = get_hardware("h100-sxm")
    split = tiny_plan("llama", 2)
    plain = autotp.estimate(split, h100)
    compute_s = sum(node.compute_s for node in split.nodes)
    shared = dataclasses.replace(h100, core_share=0.25, fair_core_share=0.5, core_share_range_s=compute_s / 4)
    estimate = autotp.estimate(split, shared)
    assert estimate.fair_share_saving_s == pytest.approx(compute_s * 3 / 4 * 0.5), estimate.fair_share_saving_s
    assert estimate.time_s == pytest.approx(plain.time_s - estimate.fair_share_saving_s)
    assert "at the fair share of a core" in estimate.summary() and "fair share" not in plain.summary()
    replanned = tiny_plan("llama", 2, hardware=shared)
    again = autotp.estimate(replanned, shared)
    assert again.fair_share_saving_s > 0 and replanned.predicted_compute_s == pytest.approx(again.time_s - again.comm_s)


def test_solver_weighs_the_call_sync_wait_against_splitting() -> None:
    """tp=2 tiny MLP on meta, memory_budget=None, a CPU profile slow enough that splitting pays: with a small
    call sync wait the plan splits (one all-reduce) and its predicted communication holds the wait once; with a
    wait dearer than what splitting saves, the solver keeps every tensor whole (no collective)."""
    from models import tiny_mlp

    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01)
    plans = {}
    for sync_s in (1e-4, 10.0):
        hardware = dataclasses.replace(slow, call_sync_wait_s=sync_s)
        model, args, kwargs = tiny_mlp(device="meta")
        plan = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(memory_budget=None, hardware=hardware))
        plans[sync_s] = (plan, hardware)
    split, hardware = plans[1e-4]
    assert split.collective_counts() == {"all_reduce": 1}, split.collective_counts()
    estimate = autotp.estimate(split, hardware)
    assert math.isclose(split.predicted_comm_s, estimate.comm_s + 1e-4), (split.predicted_comm_s, estimate.comm_s)
    assert math.isclose(estimate.comm_per_call_s, split.predicted_comm_s), estimate
    whole, _ = plans[10.0]
    assert whole.collective_counts() == {} and whole.predicted_comm_s == 0.0, whole.collective_counts()


def test_solver_weighs_the_wait_per_second_of_compute_against_splitting() -> None:
    """tp=2 tiny MLP on meta, memory_budget=None, the slow CPU profile above with no call sync wait but a wait per
    second of compute: at 0.1 s per s the plan splits (one all-reduce) and its predicted communication holds
    0.1 x its compute; at 1.5 s per s a split (half the compute, plus 1.5 x that half as wait) costs more than
    the whole compute, and the solver keeps every tensor whole — as ``autotp.estimate(plan)`` prices it."""
    from models import tiny_mlp

    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01,
                               call_sync_wait_s=0.0)
    plans = {}
    for per_compute in (0.1, 1.5):
        hardware = dataclasses.replace(slow, call_sync_wait_per_compute=per_compute)
        model, args, kwargs = tiny_mlp(device="meta")
        plans[per_compute] = (autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(memory_budget=None, hardware=hardware)),
                              hardware)
    split, hardware = plans[0.1]
    assert split.collective_counts() == {"all_reduce": 1}, split.collective_counts()
    estimate = autotp.estimate(split, hardware)
    nodes_s = sum(node.compute_s for node in split.nodes)  # the nodes' compute; the bias's zeros are not drift
    assert math.isclose(estimate.call_sync_wait_s, 0.1 * nodes_s), estimate
    assert math.isclose(split.predicted_comm_s, estimate.comm_s + 0.1 * nodes_s), (
        split.predicted_comm_s, estimate.comm_s, nodes_s)
    assert math.isclose(split.predicted_compute_s, estimate.compute_s), (split.predicted_compute_s, estimate.compute_s)
    whole, _ = plans[1.5]
    assert whole.collective_counts() == {} and whole.predicted_comm_s == 0.0, whole.collective_counts()


def test_local_stand_ins_keep_shapes_and_weights_without_a_process_group() -> None:
    """tp=2 calibration graph (llama block, all-reduces after the row-split projections) and an all-gather
    then reduce-scatter at tp=4: the compute form has no collective left, runs without a process group,
    gives the real outputs' shapes and shares the weights; a graph without collectives has no compute form."""
    module, example = block_graph(GraphShape(1, 4, 32, heads=4), 2, "not-a-group")
    compute = local_stand_ins(module)
    assert compute is not None, "a graph with collectives has a compute form"
    left = [str(n.target) for n in compute.graph.nodes if n.op == "call_function" and "c10d" in str(n.target)]
    assert not left, f"expected no collective in the compute form, found {left}"
    assert compute(example).shape == example.shape, f"expected {tuple(example.shape)}, got {compute(example).shape}"
    assert compute.p0 is module.p0, "the compute form shares the real graph's weights"
    c10d = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    gathered = graph.call_function(c10d.wait_tensor.default,
                                   (graph.call_function(c10d.all_gather_into_tensor.default, (x, 4, "g")),))
    graph.output(graph.call_function(c10d.reduce_scatter_tensor.default, (gathered, "sum", 4, "g")))
    shape = tuple(local_stand_ins(torch.fx.GraphModule(torch.nn.Module(), graph))(torch.ones(3, 5)).shape)
    assert shape == (3, 5), f"all-gather then reduce-scatter over 4 ranks keeps (3, 5), got {shape}"
    alone, _ = block_graph(GraphShape(1, 4, 32, heads=4), 1, None)
    assert local_stand_ins(alone) is None, "a graph without collectives is its own compute"


def test_lookups_read_rows_and_attention_runs_as_small_gemms() -> None:
    """Pricing terms on meta tensors: an embedding reads the rows it returns, not its table; attention's
    GEMM dims are (Sq, Sk, head dim), so a short sequence runs it below peak."""
    aten = torch.ops.aten
    table, ids = torch.empty(50_000, 64, device="meta"), torch.empty(2, 16, dtype=torch.long, device="meta")
    rows = torch.empty(2, 16, 64, device="meta")
    expected = 2 * 2 * 16 * 64 * 4 + 2 * 16 * 8
    assert aten_memory_bytes(aten.embedding.default, (table, ids), {}, rows) == expected, (
        f"expected {expected} bytes, got {aten_memory_bytes(aten.embedding.default, (table, ids), {}, rows)}")
    q, k = torch.empty(2, 8, 16, 32, device="meta"), torch.empty(2, 8, 24, 32, device="meta")
    dims = gemm_dims(aten.scaled_dot_product_attention.default, (q, k, k))
    assert dims == (16, 24, 32), f"expected (16, 24, 32), got {dims}"


def test_convolutions_run_as_their_implicit_gemm() -> None:
    """Pricing terms on meta tensors: a convolution's GEMM dims are (batch x output positions, output channels of
    a group, a group's input channels x kernel positions), with stride and padding; a depthwise one has n = 1 (priced
    by its bytes) and a transposed one none; a 3-channel stem convolution is priced below the peak."""
    aten = torch.ops.aten
    images, stem = torch.empty(2, 3, 16, 16, device="meta"), torch.empty(32, 3, 3, 3, device="meta")
    assert gemm_dims(aten.conv2d.default, (images, stem, None, [1, 1], [1, 1])) == (2 * 16 * 16, 32, 27)
    features, strided = torch.empty(2, 32, 16, 16, device="meta"), torch.empty(64, 32, 3, 3, device="meta")
    assert gemm_dims(aten.conv2d.default, (features, strided, None, [2, 2], [1, 1])) == (2 * 8 * 8, 64, 288)
    depthwise = torch.empty(32, 1, 3, 3, device="meta")
    assert gemm_dims(aten.conv2d.default, (features, depthwise, None, [1, 1], [1, 1], [1, 1], 32)) == (512, 1, 9)
    assert gemm_dims(aten.convolution.default, (features, strided, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)) \
        == (128, 64, 288)
    assert gemm_dims(aten.convolution.default, (features, strided, None, [2, 2], [1, 1], [1, 1], True, [0, 0], 1)) \
        is None
    curved = dataclasses.replace(CPU, gemm_half_efficiency_dim=32.0)
    flops, fixed_s = 2 * 512 * 32 * 27, CPU.kernel_floor_s + CPU.host_dispatch_s
    at_peak = compute_time_s(flops, 0, torch.float32, curved)
    as_gemm = compute_time_s(flops, 0, torch.float32, curved, gemm_min_dim=min(
        gemm_dims(aten.conv2d.default, (images, stem, None, [1, 1], [1, 1]))))
    assert math.isclose(as_gemm - fixed_s, (at_peak - fixed_s) * (27 + 32) / 27, rel_tol=1e-9), (as_gemm, at_peak)


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_calibration_graphs_hold_the_op_kinds_of_hf_graphs(family: str) -> None:
    """tp=1, one tiny block of each family: the graph runs and holds the prologue (arange, mask, embedding) and
    the family's norm, attention and activation; an ``"mlp"`` block is a feed-forward layer alone. At tp=2 an
    ``"mlp"`` block has one all-reduce, the others two (``GraphShape.all_reduces``)."""
    shape = GraphShape(1, 4, 32, heads=4, family=family)
    module, example = block_graph(shape, 1, None)
    out = module(example)
    assert out.shape == example.shape, f"expected {tuple(example.shape)}, got {tuple(out.shape)}"
    targets = {str(node.target) for node in module.graph.nodes if node.op == "call_function"}
    if family == "mlp":
        expected = {"aten.linear.default", "aten.gelu.default"}
        assert "aten.scaled_dot_product_attention.default" not in targets, targets
    else:
        expected = {"aten.arange.start", "aten.le.Tensor", "aten.embedding.default",
                    "aten.scaled_dot_product_attention.default"}
        expected |= ({"aten.layer_norm.default", "aten.gelu.default"} if family == "gpt"
                     else {"aten.rsqrt.default", "aten.silu.default", "aten.cat.default"})
    assert expected <= targets, f"missing {sorted(expected - targets)}"
    split, _ = block_graph(dataclasses.replace(shape, layers=3), 2, "a-group")
    all_reduces = sum(1 for node in split.graph.nodes if node.target is torch.ops._c10d_functional.all_reduce.default)
    assert all_reduces == dataclasses.replace(shape, layers=3).all_reduces == (3 if family == "mlp" else 6), all_reduces


def test_the_wait_fit_takes_the_shared_memory_cold_cost_out_as_a_model_is_priced_with_it() -> None:
    """tp=2 graphs of 1-4 blocks through the shared-memory all-reduce (synthetic timings), their working sets
    1-8 MiB: each collective pays the cold-cache cost of the profile's curve at its graph's working set, and the
    ranks wait 40 us per collective beyond it. Fitted with the curve, the wait per collective is those 40 us; a
    model's collective is priced with the curve too (``collective_time_s``), so the cold cost is counted once.
    Fitted without the curve, the wait holds the cold cost as well (the double count the curve removes)."""
    shared = LinkProfile(name="shared-memory-2ranks", bandwidth_gbps=10.0, latency_s=0.0, base_latency_s=12e-6)
    cold = ((2**20, 10e-6), (8 * 2**20, 35e-6))
    dispatch_s, launch_s, view_s, wait_s = 8e-6, 30e-6, 2e-6, 40e-6
    samples = []
    for layers in (1, 2, 3, 4):
        for device_per_layer_s in (0.2e-3, 0.6e-3):
            kernels, views, device_s = 30 * layers, 9 * layers, device_per_layer_s * layers
            compute_s = device_s + kernels * dispatch_s + views * view_s + launch_s
            working_set = 2**20 * 2 ** (layers - 1)
            for with_collectives in (True, False):
                collectives = tuple(("all_reduce", 2**15, 2) for _ in range(2 * layers)) if with_collectives else ()
                sample = GraphSample(kernels, views, device_s, collectives, 0.0, compute_s, 1.0, compute_s, compute_s,
                                     working_set_bytes=working_set)
                link_s = graph_link_s(sample, LINK, shared, cold)
                assert math.isclose(link_s, graph_link_s(sample, LINK, shared) + len(collectives) * cold_call_at_s(
                    cold, working_set)), "each shared-memory collective pays the cold cost at its graph's working set"
                samples.append(dataclasses.replace(sample, seconds=compute_s + link_s + len(collectives) * wait_s))
    fit = fit_host_terms(samples, view_op_s=view_s, link=LINK, shared_memory_link=shared,
                         shared_memory_cold_curve=cold)
    assert math.isclose(fit.collective_wait_s, wait_s, rel_tol=1e-3), fit
    assert fit.call_sync_wait_s < 1e-7 and fit.call_sync_wait_per_compute < 1e-4, fit
    blind = fit_host_terms(samples, view_op_s=view_s, link=LINK, shared_memory_link=shared)
    assert blind.collective_wait_s > wait_s + 10e-6 or blind.call_sync_wait_s > 50e-6, (
        f"without the curve the fitted wait must hold the cold cost too: {blind}")
    profile = dataclasses.replace(CPU, small_all_reduce="shared_memory", shared_memory_link=shared,
                                  shared_memory_cold_call_s=cold_call_at_s(cold, 4 * 2**20), collective_wait_s=wait_s)
    priced = collective_time_s("all_reduce", 2**15, 2, profile)
    assert math.isclose(priced, link_collective_time_s("all_reduce", 2**15, 2, LINK, small_all_reduce="shared_memory",
                                                       shared_memory_link=shared)
                        + cold_call_at_s(cold, 4 * 2**20) + wait_s), priced


def test_reshardings_without_a_collective_count_as_compute() -> None:
    """tp=2 tiny MLP on meta: its plan zeroes the second linear's bias on rank 1 (a local resharding) and
    all-reduces the output. The estimate counts the zeros as compute of the bias (they run on the rank like any
    op, and the accuracy benchmark's compute form runs them), the all-reduce as communication; the plan's
    predicted split says the same."""
    from models import tiny_mlp

    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01)
    model, args, kwargs = tiny_mlp(device="meta")
    plan = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(memory_budget=None, hardware=slow))
    local = [c for c in plan.collectives if all(str(step) in ("zero", "slice") for step in c.steps)]
    talking = [c for c in plan.collectives if c not in local]
    assert local and talking, plan.collectives
    estimate = autotp.estimate(plan, slow)
    assert math.isclose(estimate.comm_s, sum(c.time_s for c in talking)), estimate
    nodes = {node.name: node for node in estimate.nodes}
    for collective in local:
        assert nodes[collective.producer].comm_s == 0.0, nodes[collective.producer]
        assert math.isclose(nodes[collective.producer].compute_s,
                            next(n.compute_s for n in plan.nodes if n.name == collective.producer) + collective.time_s)
    assert math.isclose(estimate.compute_s, sum(n.compute_s for n in plan.nodes) + sum(c.time_s for c in local))
    assert math.isclose(plan.predicted_compute_s, estimate.compute_s), (plan.predicted_compute_s, estimate.compute_s)
    assert math.isclose(plan.predicted_comm_s, estimate.comm_per_call_s), (plan.predicted_comm_s, estimate)


def test_an_op_family_pays_its_fixed_cost_in_every_pricing_path() -> None:
    """No parallelism: a convolution pays the profile's ``op_fixed_s["convolution"]`` on top of its kernel (an add
    and a view nothing), in `compute_time_s` and in a plan of a small CNN (two convolutions: twice the cost);
    the field survives JSON, scales with the core share in `alone`, and a bad entry is a clear error."""
    from autotp.cost_model.compute import op_family
    from autotp.cost_model.hardware import OP_FAMILIES

    aten = torch.ops.aten
    assert op_family(aten.conv2d.default) == "convolution" and op_family(aten.max_pool2d.default) == "pooling"
    assert op_family(aten.scaled_dot_product_attention.default) == "attention" and op_family(aten.add.Tensor) is None
    plain = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0)
    fixed = dataclasses.replace(plain, op_fixed_s=(("convolution", 1e-3), ("pooling", 2e-6)))
    assert fixed.op_fixed_cost_s("convolution") == 1e-3 and fixed.op_fixed_cost_s("attention") == 0.0
    d = compute_time_s(1e6, 1e5, torch.float32, plain, fixed=[("convolution", 1)])
    assert compute_time_s(1e6, 1e5, torch.float32, fixed, fixed=[("convolution", 1)]) == pytest.approx(d + 1e-3)
    assert compute_time_s(1e6, 1e5, torch.float32, fixed, fixed=[("pooling", 3)]) == pytest.approx(d + 6e-6)
    assert compute_time_s(1e6, 1e5, torch.float32, fixed) == pytest.approx(d), "no family, no fixed cost"

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    example = (torch.randn(2, 3, 8, 8),)
    with_fixed, without = (autotp.estimate(autotp.plan(model, example, world_size=1, options=autotp.PlanOptions(hardware=profile, memory_budget=None)), profile).time_per_call_s
                           for profile in (fixed, plain))
    assert with_fixed - without == pytest.approx(2e-3, rel=1e-6), (with_fixed, without)

    data = fixed.to_dict()
    assert data["op_fixed_s"] == {"convolution": 1e-3, "pooling": 2e-6}
    assert Hardware.from_dict(json.loads(json.dumps(data))) == fixed
    del data["op_fixed_s"]
    assert Hardware.from_dict(data).op_fixed_s == (), "a profile written before the field reads none"
    assert dataclasses.replace(fixed, core_share=0.5).alone().op_fixed_cost_s("convolution") == pytest.approx(5e-4)
    for bad, match in (((("fft", 1e-6),), "the fixed costs are"), ((("convolution", -1.0),), "op_fixed_s"),
                       ((("pooling", 1e-6), ("pooling", 2e-6)), "twice")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(plain, op_fixed_s=bad)
    assert set(OP_FAMILIES) >= {"convolution", "pooling", "batch_norm", "attention"}
    with pytest.raises(ValueError, match="op_fixed_s"):
        Hardware.from_dict({**fixed.to_dict(), "op_fixed_s": [1, 2]})


@pytest.mark.slow  # times a Python loop's host calls against its price: about 8 s on 2 cores
def test_a_python_loop_pays_the_host_calls_it_makes() -> None:
    """transformers' grouped_mm_fallback runs a Python loop: per group of rows one ``torch.mm`` on three views,
    after zero-filling its output and reading the groups' offsets to the host. Each call pays those host calls
    at the profile's dispatch of a kernel node and of a view (in compiled mode too, where the loop still runs in
    Python; none where a CUDA graph replays), as
    ``fixed_costs`` counts them from its local shapes (no more groups than rows), in a plan of a Mixtral."""
    import transformers.integrations.moe  # noqa: F401 - registers the op
    from models import tiny_mixtral

    from autotp.cost_model.compute import fixed_costs

    loop = torch.ops.transformers.grouped_mm_fallback.default
    assert fixed_costs(loop, ((64, 256), (4, 256, 128), (4,))) == (("kernel_call", 5), ("view_call", 13))
    assert fixed_costs(loop, ((2, 256), (4, 256, 128), (4,))) == (("kernel_call", 3), ("view_call", 7))
    plain = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0, view_op_s=0.0, first_call_s=())
    host = dataclasses.replace(plain, host_dispatch_s=2e-6, view_op_s=1e-6)
    calls = (("kernel_call", 5), ("view_call", 13))
    d = compute_time_s(1e6, 1e5, torch.float32, plain, fixed=calls)
    assert compute_time_s(1e6, 1e5, torch.float32, host, fixed=calls) == pytest.approx(d + 2e-6 + 5 * 2e-6 + 13e-6)
    compiled = dataclasses.replace(host, runtime_mode="compiled")  # the node pays no dispatch, its loop does
    assert compute_time_s(1e6, 1e5, torch.float32, compiled, fixed=calls) == pytest.approx(d + 5 * 2e-6 + 13e-6)
    replayed = dataclasses.replace(host, runtime_mode="cuda_graph")
    assert compute_time_s(1e6, 1e5, torch.float32, replayed, fixed=calls) == pytest.approx(d)

    model, args, kwargs = tiny_mixtral(layers=1)  # 4 experts, top 2 of 2 x 16 tokens: 64 rows, 4 groups
    priced = {}
    for name, profile in (("plain", plain), ("host", host)):
        plan = autotp.plan(model, args, kwargs, world_size=1, options=autotp.PlanOptions(hardware=profile, memory_budget=None))
        priced[name] = [node.compute_s for node in plan.nodes if "grouped_mm_fallback" in node.op]
    assert len(priced["host"]) == 2, priced  # the experts' two projections
    for with_calls, without in zip(priced["host"], priced["plain"]):
        assert with_calls - without == pytest.approx(2e-6 + 5 * 2e-6 + 13e-6, rel=1e-6), priced


def _runs_math_kernel(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, value: torch.Tensor | None = None,
                      **options: object) -> bool:
    """Whether PyTorch ran this attention in its math kernel, as its profiler saw the call (``value``: ``key``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        torch.ops.aten.scaled_dot_product_attention.default(query, key, key if value is None else value, mask,
                                                            **options)
    return any("_scaled_dot_product_attention_math" in event.name for event in profiler.events())


@pytest.mark.slow  # runs PyTorch's profiler over attentions and traces two models: about 12 s on 2 cores
def test_attention_pays_per_block_and_per_call_in_the_flash_kernel_and_once_in_the_math_kernel() -> None:
    """``fixed_costs`` of an attention: per (batch, head) block of up to 32 queries plus once per call where PyTorch
    runs its flash kernel; once, ``"attention_math"``, where it runs its math kernel, as PyTorch's profiler shows it
    does for values of another head size than the queries' and, on torch 2.13 (not 2.14), for keys of one head
    under queries of eight (Falcon's multi-query attention), and not with ``enable_gqa``. In plans: a tiny Llama's
    attention at tp 2 pays both flash costs at its local heads, a tiny Falcon's what its kernel on this torch costs."""
    from heldout_models import tiny_falcon
    from models import tiny_llama

    from autotp.cost_model.compute import attention_blocks, attention_runs_math, fixed_costs

    aten = torch.ops.aten
    sdpa = aten.scaled_dot_product_attention.default
    assert attention_blocks((2, 8, 16, 32)) == 16 and attention_blocks((1, 1, 200, 64)) == 4
    assert attention_blocks((1, 4, 1000, 64)) == 16  # 256 queries per block from 768 on
    assert fixed_costs(aten.linear.default, ((2, 8, 16, 32),)) == ()
    assert fixed_costs(sdpa, ((2, 8, 16, 32),) * 3) == (("attention", 16), ("attention_call", 1))
    query, mask = torch.randn(2, 8, 16, 32), torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    for key, options in ((torch.randn(2, 8, 16, 32), {}), (torch.randn(2, 1, 16, 32), {}),
                         (torch.randn(2, 1, 16, 32), {"enable_gqa": True})):
        expected = _runs_math_kernel(query, key, mask, **options)
        assert attention_runs_math(sdpa, (query, key, key, mask), options) == expected, (key.shape, options)
        shapes = (query.shape, key.shape, key.shape, mask.shape)  # shapes, as the cost pass gives them: the same
        assert attention_runs_math(sdpa, shapes, options) == expected
    # keys of one head under queries of eight: the math kernel on torch 2.13, the flash one on 2.14
    multi_query_math = _runs_math_kernel(query, torch.randn(2, 1, 16, 32), mask)
    assert attention_runs_math(sdpa, (query, torch.randn(2, 1, 16, 32)) * 2)
    assert (fixed_costs(sdpa, (query.shape, (2, 1, 16, 32), (2, 1, 16, 32), mask.shape)) == (("attention_math", 1),)
            ) == multi_query_math
    # values of another head size than the queries' (latent attention): the math kernel on both
    assert _runs_math_kernel(query, torch.randn(2, 8, 16, 32), mask, torch.randn(2, 8, 16, 16))
    assert fixed_costs(sdpa, (query.shape, (2, 8, 16, 32), (2, 8, 16, 16), mask.shape)) == (("attention_math", 1),)

    costs = (("attention", 1e-5), ("attention_call", 3e-6), ("attention_math", 7e-5))
    base = dataclasses.replace(get_hardware("cpu-gloo"), op_fixed_s=tuple((name, 0.0) for name, _ in costs))
    fixed = dataclasses.replace(base, op_fixed_s=costs)
    for build, world_size, heads, math_kernel in ((tiny_llama, 2, 8, False), (tiny_falcon, 2, 8, multi_query_math)):
        model, args, kwargs = build()
        attention = [{node.name: node for node in autotp.plan(model, args, kwargs, world_size=world_size,
                                                               options=autotp.PlanOptions(hardware=profile)).nodes
                      if "scaled_dot_product" in node.op} for profile in (base, fixed)]
        assert attention[1], f"no attention node in the plan of {build.__name__}"
        for name, node in attention[1].items():
            assert node.inputs == attention[0][name].inputs, "the same split in both plans"
            local_heads = heads // world_size if node.inputs[0].startswith("S(1)") else heads
            expected = 7e-5 if math_kernel else 1e-5 * 2 * local_heads + 3e-6
            added = node.compute_s - attention[0][name].compute_s
            assert added == pytest.approx(expected), (build.__name__, name, node.inputs, added)


def test_the_calibrations_attention_instances_run_the_kernels_their_costs_name() -> None:
    """The calibration times attention at one block of queries, at ``ATTENTION_BLOCKS_TIMED``, both in PyTorch's
    flash kernel, and once in its math kernel (as PyTorch's profiler sees each call), so that its three figures
    are the costs ``fixed_costs`` charges."""
    from autotp.calibration.graphs import ATTENTION_BLOCKS_TIMED, _attention_instance
    from autotp.cost_model.compute import fixed_costs

    for heads, value_size, expected in ((1, 16, (("attention", 1), ("attention_call", 1))),
                                        (ATTENTION_BLOCKS_TIMED, 16,
                                         (("attention", ATTENTION_BLOCKS_TIMED), ("attention_call", 1))),
                                        (4, 8, (("attention_math", 1),))):
        op, (query, key, value, mask) = _attention_instance(heads, value_size)
        assert fixed_costs(op, (query, key, value, mask)) == expected
        assert _runs_math_kernel(query, key, mask, value) == (value_size != 16), (heads, value_size)


def test_a_convolution_pays_the_fixed_cost_only_where_pytorch_runs_it_through_onednn() -> None:
    """PyTorch runs a 1 x 1 convolution of a small batch on one thread in its own kernel, a 3 x 3 one through
    oneDNN (``torch._C._select_conv_backend``); only the second pays ``op_fixed_s["convolution"]``, in
    ``fixed_costs`` and in a plan of a CNN with both (shapes given as tensors or as shapes alike)."""
    from autotp.cost_model.compute import convolution_sets_up_primitive, fixed_costs

    aten = torch.ops.aten
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # PyTorch's rule reads the thread count: a 1 x 1 convolution is oneDNN's on several
    try:
        one_by_one = ((2, 64, 4, 4), (64, 64, 1, 1))
        three_by_three = ((2, 8, 8, 8), (8, 8, 3, 3), None, [1, 1], [1, 1])
        assert not convolution_sets_up_primitive(aten.conv2d.default, one_by_one)
        assert convolution_sets_up_primitive(aten.conv2d.default, three_by_three)
        assert fixed_costs(aten.conv2d.default, one_by_one) == (("convolution", 0),)
        assert fixed_costs(aten.conv2d.default, tuple(torch.randn(shape) for shape in three_by_three[:2])) == (
            ("convolution", 1),)
        assert fixed_costs(aten.conv2d.default, ((32, 64, 4, 4), (64, 64, 1, 1))) == (("convolution", 1),), \
            "a batch of 32: oneDNN"
        plain = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0)
        fixed = dataclasses.replace(plain, op_fixed_s=(("convolution", 1e-3),))
        model = torch.nn.Sequential(torch.nn.Conv2d(8, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 1))
        captured = capture(model, (torch.randn(2, 8, 4, 4),), None)
        costs = [cost_strategy_graph(build_strategy_graph(captured.graph_module, 1, {}, frozenset()), profile)
                 for profile in (plain, fixed)]
        convolutions = [node.name for node in captured.graph_module.graph.nodes
                        if node.target is aten.conv2d.default]
        extra = [costs[1].compute_s[name][0] - costs[0].compute_s[name][0] for name in convolutions]
        assert extra == pytest.approx([1e-3, 0.0]), extra
        depthwise = ((2, 32, 8, 8), (32, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], 64)  # half of 64 groups on a rank
        assert convolution_sets_up_primitive(aten.conv2d.default, depthwise)
        cnn, example, _ = tiny_cnn(device="meta")
        for world_size in (1, 2, 4):  # the depthwise convolution split over channels: priced, not refused
            assert autotp.plan(cnn, example, world_size=world_size, options=autotp.PlanOptions(hardware=fixed, memory_budget=None)).nodes
    finally:
        torch.set_num_threads(threads)


def test_a_pooling_op_is_priced_per_element_of_its_windows() -> None:
    """A max pool of windows 2 x 2 on (2, 64, 8, 8) compares 8,192 elements, an adaptive average pool its input's;
    at 5 ns per window element the max pool costs 41 us where its bytes take 1.6; a pooling op without a rate of its
    own stays priced by its bytes, a transcendental op without one at the median rate; the calibration rates every
    pooling op it times."""
    from autotp.calibration.graphs import measure_element_rates
    from autotp.cost_model.compute import has_element_rate, rated_elements

    aten = torch.ops.aten
    x = torch.randn(2, 64, 8, 8)
    pooled = aten.max_pool2d.default(x, [2, 2], [2, 2])
    assert rated_elements(aten.max_pool2d.default, (x, [2, 2], [2, 2]), {}, pooled.numel()) == 8192
    assert rated_elements(aten.max_pool2d.default, (x, 3, 2), {}, 10) == 90
    assert rated_elements(aten.adaptive_avg_pool2d.default, (x, [1, 1]), {}, 128, x.numel()) == x.numel()
    assert rated_elements(aten.exp.default, (x,), {}, 7) == 7 and rated_elements(aten.relu.default, (x,), {}, 7) == 0
    assert has_element_rate(aten.avg_pool1d.default) and not has_element_rate(aten.add.Tensor)
    rated = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0, memory_bandwidth_gbps=25.0,
                                transcendental_element_s=1e-9, op_element_s=(("max_pool2d", 5e-9),))
    nbytes = (x.numel() + pooled.numel()) * 4
    assert compute_time_s(0, nbytes, torch.float32, rated, rated_elements=8192, rated_op="max_pool2d") == \
        pytest.approx(8192 * 5e-9)
    assert compute_time_s(0, nbytes, torch.float32, rated, rated_elements=8192, rated_op="avg_pool2d") == \
        pytest.approx(nbytes / 25e9), "a pooling op not rated: its bytes"
    assert compute_time_s(0, 8, torch.float32, rated, rated_elements=8192, rated_op="exp") == pytest.approx(8192e-9)
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    captured = capture(model, (x,), None)
    costed = cost_strategy_graph(build_strategy_graph(captured.graph_module, 1, {}, frozenset()), rated)
    pool = next(node.name for node in captured.graph_module.graph.nodes if node.target is aten.max_pool2d.default)
    assert costed.compute_s[pool][0] == pytest.approx(8192 * 5e-9), costed.compute_s[pool]
    median, rates = measure_element_rates(2**12, min_time_s=1e-4, repeats=1)
    names = dict(rates)
    assert median > 0 and {"tanh", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool3d"} <= set(names)
    assert all(rate > 0 for rate in names.values()), rates


def test_the_first_call_of_each_kernel_in_a_graph_pays_its_first_call_cost() -> None:
    """With ``first_call_s`` ("kernel" 1 ms, "convolution" 5 ms): in the cost pass and in the calibration's
    recorder alike, the first ReLU, the first GELU and the first convolution of a graph pay it once (the
    convolution its family's figure) and a second ReLU or convolution nothing; a plan's estimate grows by their
    sum; the table survives JSON, scales with the core share in ``alone`` and refuses a name it does not take;
    the calibration measures every kind, at least 0."""
    from autotp.base.shapes import concrete_shape
    from autotp.calibration.graphs import _Recorder, measure_first_call_s
    from autotp.cost_model.hardware import FIRST_CALL_KINDS

    plain = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0)
    first = dataclasses.replace(plain, first_call_s=(("kernel", 1e-3), ("convolution", 5e-3)))
    assert first.first_call_cost_s(None) == 1e-3 and first.first_call_cost_s("convolution") == 5e-3
    assert first.first_call_cost_s("pooling") == 1e-3, "a family not measured: the kernel's figure"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                torch.nn.ReLU(), torch.nn.GELU())
    example = (torch.randn(2, 3, 8, 8),)
    captured = capture(model, example, None)
    costs = [cost_strategy_graph(build_strategy_graph(captured.graph_module, 1, {}, frozenset()), profile)
             for profile in (plain, first)]
    calls = [node for node in captured.graph_module.graph.nodes if node.op == "call_function"]
    extra = {node.name: costs[1].compute_s[node.name][0] - costs[0].compute_s[node.name][0] for node in calls}
    expected = {"conv2d": 5e-3, "relu": 1e-3, "conv2d_1": 0.0, "relu_1": 0.0, "gelu": 1e-3}
    assert extra == pytest.approx(expected), extra
    estimates = [autotp.estimate(autotp.plan(model, example, world_size=1, options=autotp.PlanOptions(hardware=profile, memory_budget=None)),
                                 profile).time_per_call_s for profile in (plain, first)]
    assert estimates[1] - estimates[0] == pytest.approx(7e-3), estimates
    values = [torch.randn(concrete_shape(node.meta["val"])) for node in captured.graph_module.graph.nodes
              if node.op == "placeholder"]  # weights and images alike: every input is a float tensor here
    recorders = [_Recorder(captured.graph_module, profile) for profile in (plain, first)]
    for recorder in recorders:
        recorder.run(*values)
    assert recorders[1].device_s - recorders[0].device_s == pytest.approx(7e-3)
    assert recorders[1].kernel_s == recorders[0].kernel_s, "the first call is no part of the roofline"
    assert Hardware.from_json(first.to_json()) == first
    assert dataclasses.replace(first, core_share=0.5).alone().first_call_cost_s(None) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="the names it takes are"):
        dataclasses.replace(plain, first_call_s=(("relu", 1e-6),))
    measured = measure_first_call_s(runs=2)
    assert [kind for kind, _ in measured] == list(FIRST_CALL_KINDS)
    assert all(seconds >= 0.0 for _, seconds in measured), measured


def test_a_model_call_is_priced_once_per_call_beside_its_graph_call() -> None:
    """``model_call_s`` (2 ms) adds once to a plan's time per call and to its graph call, survives JSON, scales
    with the core share in ``alone``, is off in ``device_only`` (the calibration's own graphs are called bare) and
    in the cross-validation's ``model_call`` term; without a process group the calibration leaves it unmeasured."""
    from autotp.calibration.model_call import measure_model_call_s
    from autotp.cost_model.crossval import without
    from autotp.cost_model.graph_calibration import device_only

    model, example, _ = tiny_mlp()
    plain = dataclasses.replace(CPU, graph_launch_s=1e-3)
    called = dataclasses.replace(plain, model_call_s=2e-3)
    estimates = [autotp.estimate(autotp.plan(model, example, world_size=2, options=autotp.PlanOptions(hardware=profile, memory_budget=None)),
                                 profile) for profile in (plain, called)]
    assert estimates[1].time_per_call_s - estimates[0].time_per_call_s == pytest.approx(2e-3), estimates
    assert estimates[1].graph_call_s == pytest.approx(3e-3), estimates[1]
    assert Hardware.from_json(called.to_json()) == called
    assert dataclasses.replace(called, core_share=0.5).alone().model_call_s == pytest.approx(1e-3)
    assert device_only(called).model_call_s == 0.0
    assert without(called, ["model_call"]) == plain
    if not dist.is_initialized():  # another test of this process may have left a group
        assert measure_model_call_s(runs=3) == 0.0


def test_op_family_fixed_costs_are_measured_and_priced_beside_the_kernel_roofline() -> None:
    """`measure_op_fixed_s` returns every fixed cost, each at least 0; a graph's recorder adds a convolution's
    fixed cost to the graph's priced kernel time but not to the kernel's roofline (``kernel_s``). (How attention's
    cost splits into blocks and a call is checked on given timings below; which costs more on this machine is a
    timing, which the breakdown benchmark shows and a test on a loaded machine cannot.)"""
    from autotp.calibration.graphs import _Recorder, measure_op_fixed_s
    from autotp.cost_model.hardware import OP_FIXED_COSTS

    plain = dataclasses.replace(CPU, host_dispatch_s=0.0, kernel_floor_s=0.0)
    measured = dict(measure_op_fixed_s(plain, min_time_s=1e-3, repeats=3))
    assert sorted(measured) == sorted(OP_FIXED_COSTS)
    assert all(seconds >= 0.0 for seconds in measured.values()), measured
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("0.weight")
    graph.output(graph.call_function(torch.ops.aten.conv2d.default, (x, weight)))
    module = torch.fx.GraphModule(module, graph)
    recorders = [_Recorder(module, profile) for profile in
                 (plain, dataclasses.replace(plain, op_fixed_s=(("convolution", 1e-3),)))]
    for recorder in recorders:
        recorder.run(torch.randn(2, 3, 6, 6))  # batch 2: PyTorch runs it through oneDNN
    assert recorders[1].kernel_s == recorders[0].kernel_s and len(recorders[0].kernel_s) == 1
    assert recorders[1].device_s == pytest.approx(recorders[0].device_s + 1e-3)


def test_an_attention_s_cost_splits_into_blocks_and_a_call_within_one_call() -> None:
    """No parallelism (given timings): one block and sixteen give the cost per block (their difference over the
    fifteen added) and per call (the rest of one block's call); a sixteen-block timing a slow stretch lengthened
    prices a block at most a whole call and the call at 0, one no longer than one block's prices no block, and a
    negative one-block excess (a roofline above the timing) prices nothing."""
    from autotp.calibration.graphs import split_attention_cost

    assert split_attention_cost(33e-6, 89e-6, 16) == pytest.approx((56e-6 / 15, 33e-6 - 56e-6 / 15))
    assert split_attention_cost(20e-6, 6e-3, 16) == pytest.approx((20e-6, 0.0))  # 337 us per block, as timed once
    assert split_attention_cost(20e-6, 15e-6, 16) == pytest.approx((0.0, 20e-6))
    assert split_attention_cost(-1e-6, 30e-6, 16) == pytest.approx((0.0, 0.0))
    for one, many in ((33e-6, 89e-6), (20e-6, 6e-3), (5e-6, 2e-6)):
        block, call = split_attention_cost(one, many, 16)
        assert 0.0 <= block <= one and 0.0 <= call <= one and block + call == pytest.approx(one)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        split_attention_cost(1e-6, 2e-6, 1)


def test_grouped_gemms_count_their_flops_and_run_as_one_group_s_gemm() -> None:
    """A mixture-of-experts grouped GEMM, ``x (S, K)`` by ``w (E, K, N)``: every row meets one expert's weight,
    ``2 S K N`` FLOPs (it counted 0 and was priced by its bytes), the batched and K-grouped forms likewise, and its
    GEMM shape is one group's (``S / E`` rows); found by name, for ``aten._grouped_mm`` and the ``transformers``
    fallback alike."""
    from autotp.cost_model.compute import aten_flops

    x, w, offs = torch.empty(64, 32), torch.empty(8, 32, 48), torch.empty(8, dtype=torch.int32)
    grouped = torch.ops.aten._grouped_mm.default
    assert aten_flops(grouped, (x, w), {"offs": offs}) == 2 * 64 * 32 * 48
    assert gemm_dims(grouped, (x, w), {"offs": offs}) == (8, 48, 32)
    assert aten_flops(grouped, (torch.empty(8, 4, 32), w)) == 2 * 8 * 4 * 32 * 48
    assert aten_flops(grouped, (torch.empty(16, 64), torch.empty(64, 24)), {"offs": offs}) == 2 * 16 * 64 * 24
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    fallback = torch.ops.transformers.grouped_mm_fallback
    assert aten_flops(fallback.default, (x, w, offs)) == 2 * 64 * 32 * 48
    assert gemm_dims(fallback.default, (x, w, offs)) == (8, 48, 32)
