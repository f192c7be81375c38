"""Memory bandwidth at a graph's working set, and the one-shot all-reduce priced where it runs.

Tier (b): formulas and planning on the meta device; no process group.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.fx as fx
from models import tiny_mlp

import autotp
from autotp.cost_model import Hardware, collective_time_s, get_hardware
from autotp.cost_model.bandwidth import at_working_set, bandwidth_at_gbps, graph_profile, graph_working_set_bytes
from autotp.cost_model.collectives import ONE_SHOT_MAX_BYTES, link_collective_time_s, uses_one_shot_all_reduce

MIB = 2**20

# L2-, cache- and DRAM-sized working sets, as `autotp calibrate` measures them; DRAM is the flat figure
CURVE = ((1 * MIB, 400.0), (16 * MIB, 200.0), (1024 * MIB, 2.0))


def _cpu(curve: tuple[tuple[float, float], ...] = CURVE) -> Hardware:
    """cpu-gloo with a slow DRAM figure (2 GB/s) and, optionally, a working-set curve; no host terms, a flat
    GEMM rate: only memory, the link and the kernel floor price a small decode step."""
    return dataclasses.replace(get_hardware("cpu-gloo"), memory_bandwidth_gbps=2.0, memory_bandwidth_curve=curve)


def test_bandwidth_interpolates_in_log_working_set_and_clamps() -> None:
    """No parallelism: the measured points are returned as is, halfway in log(bytes) is halfway in GB/s,
    and sizes outside the curve take its end points (L2 below, DRAM above)."""
    hw = _cpu()
    assert bandwidth_at_gbps(hw, 16 * MIB) == 200.0, "a measured point is returned as is"
    assert bandwidth_at_gbps(hw, 4 * MIB) == pytest.approx(300.0), "4 MiB is halfway (in log) from 1 to 16 MiB"
    assert bandwidth_at_gbps(hw, 1024) == 400.0 and bandwidth_at_gbps(hw, 2**40) == 2.0, "clamped to the ends"
    assert at_working_set(hw, 4 * MIB).memory_bandwidth_gbps == pytest.approx(300.0)
    again = at_working_set(at_working_set(hw, 4 * MIB), 1024 * MIB)
    assert again.memory_bandwidth_gbps == 2.0, f"resolving again starts from the curve, got {again.memory_bandwidth_gbps}"


def test_gpu_profiles_and_old_cpu_profiles_price_as_before() -> None:
    """No parallelism: a profile without a curve (GPU datasheets; CPU JSON written before the curve) is
    priced at memory_bandwidth_gbps at every size; old JSON loads, its all-reduce read from host_is_device.
    The NVSwitch GPUs sum small all-reduces in symmetric memory, the PCIe one keeps NCCL's ring."""
    for name, small in (("h100-sxm", "symmetric_memory"), ("a100-sxm", "symmetric_memory"), ("pcie-gpu", "ring")):
        gpu = get_hardware(name)
        assert gpu.memory_bandwidth_curve == () and gpu.small_all_reduce == small, gpu
        assert at_working_set(gpu, 40 * MIB) is gpu, f"{name}: no curve, the profile is unchanged"
    old = _cpu().to_dict()
    del old["memory_bandwidth_curve"], old["small_all_reduce"]
    loaded = Hardware.from_dict(old)
    assert loaded.memory_bandwidth_curve == () and loaded.small_all_reduce == "one_shot", loaded
    old_gpu = get_hardware("h100-sxm").to_dict()
    del old_gpu["small_all_reduce"]
    assert Hardware.from_dict(old_gpu).small_all_reduce == "ring"
    assert Hardware.from_json(_cpu().to_json()) == _cpu(), "the curve round-trips through JSON"
    with pytest.raises(ValueError, match="ascending working_set_bytes"):
        _cpu(((16 * MIB, 200.0), (1 * MIB, 400.0)))
    with pytest.raises(ValueError, match="memory_bandwidth_curve\\[0\\] needs"):
        Hardware.from_dict({**_cpu().to_dict(), "memory_bandwidth_curve": [{"bandwidth_gbps": 3.0}]})


def test_graph_working_set_counts_placeholders_and_the_largest_value() -> None:
    """No parallelism: a weight (4 KiB), an input (64 B) and two results (1 KiB, 4 B): 4 KiB + 64 B + 1 KiB."""
    graph = fx.Graph()
    weight, x = graph.placeholder("weight"), graph.placeholder("x")
    product = graph.call_function(torch.ops.aten.mm.default, (weight, x))
    total = graph.call_function(torch.ops.aten.sum.default, (product,))
    graph.output(total)
    for node, shape in ((weight, (32, 32)), (x, (16,)), (product, (32, 8)), (total, ())):
        node.meta["val"] = torch.empty(shape, device="meta")  # float32
    assert graph_working_set_bytes(graph) == 4096 + 64 + 1024, graph_working_set_bytes(graph)


def _decode_plan(hardware: Hardware) -> autotp.Plan:
    model, args, _ = tiny_mlp(batch=1, seq_len=1, device="meta")  # 2 MiB of weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, args, world_size=2,
                           options=autotp.PlanOptions(dynamic=False, hardware=hardware, memory_budget=None))


def test_decode_is_priced_at_its_working_set_and_kept_whole() -> None:
    """tp=2, batch 1, one token, no memory budget: at DRAM's 2 GB/s the 2 MiB of weights take ~1 ms, so
    splitting them pays for an all-reduce and the planner splits; priced at the bandwidth of its 2 MiB
    working set (~350 GB/s) the same step takes microseconds and the planner keeps it whole."""
    flat = _decode_plan(_cpu(()))
    assert flat.collective_counts(), f"expected a split at a flat 2 GB/s, got no collective: {flat.parameters}"
    curved = _decode_plan(_cpu())
    assert curved.collective_counts() == {}, f"expected no collective at the working set's bandwidth, got " \
                                             f"{curved.collective_counts()}"
    assert curved.predicted_time_s < flat.predicted_time_s / 10, (curved.predicted_time_s, flat.predicted_time_s)


def test_one_shot_all_reduce_is_priced_where_the_runtime_runs_it() -> None:
    """tp=2, 3 and 4 on a gloo profile: an all-reduce of <= ONE_SHOT_MAX_BYTES over >= 3 ranks costs one
    all-to-all round of p copies; at tp 2, above the threshold, on NCCL profiles and in training graphs,
    the ring."""
    gloo = get_hardware("cpu-gloo")
    link = gloo.intra_node
    small = 2 * 1024
    for p in (3, 4):
        expected = link.base_latency_s + (p - 1) * link.latency_s + (p - 1) * small / link.bandwidth_bytes_per_s
        assert collective_time_s("all_reduce", small, p, gloo) == pytest.approx(expected + gloo.collective_wait_s)
        ring = link_collective_time_s("all_reduce", small, p, link)
        assert collective_time_s("all_reduce", small, p, gloo) < ring, f"tp={p}: one round is cheaper than the ring"
    for p, nbytes in ((2, small), (4, ONE_SHOT_MAX_BYTES + 4)):
        assert not uses_one_shot_all_reduce(p, nbytes)
        assert collective_time_s("all_reduce", nbytes, p, gloo) == pytest.approx(
            link_collective_time_s("all_reduce", nbytes, p, link) + gloo.collective_wait_s), (p, nbytes)
    training = graph_profile(gloo, 0, training=True)
    assert collective_time_s("all_reduce", small, 4, training) == pytest.approx(
        link_collective_time_s("all_reduce", small, 4, link)), "training graphs keep the functional all-reduce"
    pcie = get_hardware("pcie-gpu")
    assert collective_time_s("all_reduce", small, 4, pcie) == pytest.approx(
        link_collective_time_s("all_reduce", small, 4, pcie.intra_node)), "NCCL over PCIe keeps its own all-reduce"
    # the plan itself: tp 4 Megatron MLP at decode, its one all-reduce of 1 KiB priced as the one-shot
    model, args, _ = tiny_mlp(batch=1, seq_len=1, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, args, world_size=4, options=autotp.PlanOptions(dynamic=False, hardware="cpu-gloo"))
    reduces = [c for c in plan.collectives if c.steps == ("all_reduce",)]
    assert reduces, f"expected an all-reduce in the default-budget tp-4 plan, got {plan.collective_counts()}"
    for decision in reduces:
        one_round = link_collective_time_s("all_to_all", 4 * decision.nbytes, 4, link) + gloo.collective_wait_s
        assert math.isclose(decision.time_s, one_round, rel_tol=1e-9), (decision, one_round)


def test_one_token_linear_is_bandwidth_bound_at_its_working_set() -> None:
    """No parallelism: a one-token linear (512 x 512 float32 weight: 1 MiB) costs its bytes at the working
    set's bandwidth, not the shape curve's rate at d = 1; two tokens already run on the GEMM curve."""
    from autotp.cost_model import compute_time_s

    hw = dataclasses.replace(_cpu(), gemm_half_efficiency_dim=32.0, kernel_floor_s=0.0)
    resolved = at_working_set(hw, 40 * MIB)
    moved = 4 * (512 * 512 + 2 * 512)
    gemv = compute_time_s(2 * 512 * 512, moved, torch.float32, resolved, gemm_min_dim=1)
    assert gemv == pytest.approx(moved / (resolved.memory_bandwidth_gbps * 1e9)), gemv
    two = compute_time_s(2 * 2 * 512 * 512, moved, torch.float32, resolved, gemm_min_dim=2)
    assert two == pytest.approx(2 * 2 * 512 * 512 / (resolved.peak_tflops["float32"] * 1e12 * 2 / 34)), two


def test_a_matrix_vector_product_streams_its_matrix_at_its_own_measured_rate() -> None:
    """No parallelism: where the profile measured how fast a one-row linear reads its matrix (half the copy's
    figure at every working set here), the cost pass resolves that rate at the graph's working set as it resolves
    the copy's, and prices an eager matrix-vector product's bytes at it; a GEMM of two rows, an elementwise op and
    a compiled graph's one-row linear keep the copy's rate, and a profile without the curve prices as before."""
    from autotp.cost_model import compute_time_s

    plain = dataclasses.replace(_cpu(), gemm_half_efficiency_dim=32.0, kernel_floor_s=0.0)
    hw = dataclasses.replace(plain, gemv_bandwidth_gbps=1.0,
                             gemv_bandwidth_curve=tuple((size, gbps / 2) for size, gbps in CURVE))
    resolved = at_working_set(hw, 4 * MIB)
    assert resolved.gemv_bandwidth_gbps == pytest.approx(150.0) and resolved.memory_bandwidth_gbps == pytest.approx(300.0)
    assert at_working_set(resolved, 1024 * MIB).gemv_bandwidth_gbps == 1.0, "resolved again from the curve"
    moved = 4 * (512 * 512 + 2 * 512)
    gemv = compute_time_s(2 * 512 * 512, moved, torch.float32, resolved, gemm_min_dim=1)
    assert gemv == pytest.approx(moved / 150e9), gemv
    two_rows = compute_time_s(2 * 2 * 512 * 512, moved, torch.float32, resolved, gemm_min_dim=2)
    unmeasured = at_working_set(plain, 4 * MIB)
    assert two_rows == compute_time_s(2 * 2 * 512 * 512, moved, torch.float32, unmeasured, gemm_min_dim=2)
    assert compute_time_s(0, moved, torch.float32, resolved) == pytest.approx(moved / 300e9), "elementwise: the copy's"
    assert compute_time_s(2 * 512 * 512, moved, torch.float32, unmeasured, gemm_min_dim=1) == pytest.approx(moved / 300e9)
    # a compiled CPU decode graph sums its one-row linears in one fused pass: the copy's rate
    compiled = dataclasses.replace(resolved, runtime_mode="compiled")
    assert compute_time_s(2 * 512 * 512, moved, torch.float32, compiled, gemm_min_dim=1) == pytest.approx(moved / 300e9)
    assert Hardware.from_json(hw.to_json()) == hw and "gemv_bandwidth_curve" not in plain.to_json()
    with pytest.raises(ValueError, match="gemv_bandwidth_curve must be in ascending"):
        dataclasses.replace(hw, gemv_bandwidth_curve=((2 * MIB, 1.0), (1 * MIB, 2.0)))


def test_symbolic_all_reduce_prices_the_one_shot_below_the_threshold() -> None:
    """tp=4 on a gloo profile: the symbolic all-reduce of ``seq`` x 1 KiB equals the numeric price on both
    sides of ONE_SHOT_MAX_BYTES (one round below, the ring above)."""
    from autotp.cost_model.symbolic import SEQ, evaluate_s, symbolic_collective_time_s

    gloo = get_hardware("cpu-gloo")
    expression = symbolic_collective_time_s("all_reduce", SEQ * 1024, 4, gloo)
    for seq in (2, 256, 257, 4096):
        numeric = collective_time_s("all_reduce", seq * 1024, 4, gloo)
        assert math.isclose(evaluate_s(expression, {SEQ: seq}), numeric, rel_tol=1e-9), (seq, numeric)


def test_shared_memory_all_reduce_is_priced_on_its_own_link() -> None:
    """tp=2 and 4 on a gloo profile of one host (small_all_reduce="shared_memory"): every all-reduce inside a
    node, small or large, costs base + (p-1) alpha + (p+1) n/B on shared_memory_link, numerically and
    symbolically, an all-gather (p+1)/p n/B; other kinds and groups spanning nodes (no shared memory: the one-shot fallback) price as
    before; the link round-trips through JSON and is required; one condition says where the runtime uses it."""
    from autotp.cost_model import LinkProfile
    from autotp.cost_model.collectives import uses_shared_memory_all_reduce
    from autotp.cost_model.symbolic import SEQ, evaluate_s, symbolic_collective_time_s

    shm = LinkProfile(name="shm", bandwidth_gbps=4.0, latency_s=20e-6, base_latency_s=5e-6)
    hw = dataclasses.replace(get_hardware("cpu-gloo"), small_all_reduce="shared_memory", shared_memory_link=shm)
    fallback = dataclasses.replace(hw, small_all_reduce="one_shot", shared_memory_link=None)
    for p, nbytes in ((2, 2048), (4, 2048), (4, 8 * MIB)):
        expected = 5e-6 + (p - 1) * 20e-6 + (p + 1) * nbytes / 4e9 + hw.collective_wait_s
        got = collective_time_s("all_reduce", nbytes, p, hw)
        assert got == pytest.approx(expected), f"tp={p}, {nbytes} B: expected {expected}, got {got}"
    expression = symbolic_collective_time_s("all_reduce", SEQ * 1024, 4, hw)
    for seq in (1, 4096):
        numeric = collective_time_s("all_reduce", seq * 1024, 4, hw)
        assert math.isclose(evaluate_s(expression, {SEQ: seq}), numeric, rel_tol=1e-9), (seq, numeric)
    gather = 5e-6 + 3 * 20e-6 + 5 / 4 * 2048 / 4e9 + hw.collective_wait_s  # its n/4 in, the n of the output read
    assert collective_time_s("all_gather", 2048, 4, hw) == pytest.approx(gather), "the all-gather runs there too"
    assert collective_time_s("reduce_scatter", 2048, 4, hw) == collective_time_s("reduce_scatter", 2048, 4, fallback)
    assert collective_time_s("all_reduce", 2048, 16, hw, spans_nodes=True) == pytest.approx(
        collective_time_s("all_reduce", 2048, 16, fallback, spans_nodes=True)), "across hosts: the one-shot fallback"
    assert Hardware.from_json(hw.to_json()) == hw, "shared_memory_link round-trips through JSON"
    assert "shared_memory_link" not in fallback.to_dict(), "profiles without it write what they wrote before"
    with pytest.raises(ValueError, match="needs shared_memory_link"):
        dataclasses.replace(hw, shared_memory_link=None)
    assert uses_shared_memory_all_reduce(backend="gloo", one_host=True, machine="x86_64")
    for backend, one_host, machine in (("nccl", True, "x86_64"), ("gloo", False, "x86_64"), ("gloo", True, "aarch64")):
        assert not uses_shared_memory_all_reduce(backend=backend, one_host=one_host, machine=machine), (
            f"{backend}, one host {one_host}, {machine}: expected gloo's own all-reduce")
    assert not uses_shared_memory_all_reduce(backend="gloo", one_host=True, machine="x86_64", device_type="cuda"), (
        "CUDA tensors on a gloo group: the segment is host memory, so gloo's own all-reduce")


def test_symmetric_memory_all_reduce_is_priced_where_the_runtime_takes_it() -> None:
    """tp=2, 4 and 8 on h100-sxm (small_all_reduce="symmetric_memory"): an all-reduce of at most
    ONE_SHOT_MAX_BYTES inside the node costs one kernel launch, two barriers and (p-1) n/B of loads from the
    peers, numerically and symbolically, below NCCL's ring; above it, of float16 (the kernel sums float32 and
    bfloat16), across nodes and in training graphs, NCCL's ring or tree; one condition says where the runtime
    takes it."""
    from autotp.cost_model.collectives import symmetric_memory_takes, uses_symmetric_memory_all_reduce
    from autotp.cost_model.symbolic import SEQ, evaluate_s, symbolic_collective_time_s

    h100 = get_hardware("h100-sxm")
    nvlink = h100.intra_node
    ring = dataclasses.replace(h100, small_all_reduce="ring")
    for p in (2, 4, 8):
        for nbytes in (2048, ONE_SHOT_MAX_BYTES):
            expected = h100.kernel_floor_s + 2 * nvlink.latency_s + (p - 1) * nbytes / nvlink.bandwidth_bytes_per_s
            got = collective_time_s("all_reduce", nbytes, p, h100)
            assert got == pytest.approx(expected), f"tp={p}, {nbytes} B: expected {expected}, got {got}"
            assert got < collective_time_s("all_reduce", nbytes, p, ring), f"tp={p}, {nbytes} B: below NCCL's ring"
        above = ONE_SHOT_MAX_BYTES + 4
        assert not symmetric_memory_takes(p, above)
        assert collective_time_s("all_reduce", above, p, h100) == collective_time_s("all_reduce", above, p, ring)
        expression = symbolic_collective_time_s("all_reduce", SEQ * 1024, p, h100)
        for seq in (1, 256, 257, 4096):
            numeric = collective_time_s("all_reduce", seq * 1024, p, h100)
            assert math.isclose(evaluate_s(expression, {SEQ: seq}), numeric, rel_tol=1e-9), (p, seq, numeric)
    assert collective_time_s("all_gather", 2048, 4, h100) == collective_time_s("all_gather", 2048, 4, ring), (
        "all-gathers keep NCCL")
    for dtype, kernel in ((torch.float32, True), (torch.bfloat16, True), (torch.float16, False), ("float16", False)):
        expected = collective_time_s("all_reduce", 2048, 4, h100 if kernel else ring)
        assert collective_time_s("all_reduce", 2048, 4, h100, dtype=dtype) == expected, f"{dtype}: kernel {kernel}"
        symbolic = symbolic_collective_time_s("all_reduce", SEQ * 1024, 4, h100, dtype=dtype)
        assert math.isclose(evaluate_s(symbolic, {SEQ: 2}), expected, rel_tol=1e-9), f"{dtype}, symbolic"
    # a plan's all-reduce step passes its tensor's dtype: 512 x 2-byte elements
    from autotp.base.reshard import ReshardKind, ReshardStep
    from autotp.passes.resharding import step_time_terms

    step = ReshardStep(ReshardKind.ALL_REDUCE)
    for dtype, profile in ((torch.bfloat16, h100), (torch.float16, ring)):
        assert step_time_terms(step, (1, 512), dtype, 4, h100)[0] == collective_time_s("all_reduce", 1024, 4, profile)
    multinode = get_hardware("h100-multinode")
    assert collective_time_s("all_reduce", 2048, 16, multinode, spans_nodes=True) == collective_time_s(
        "all_reduce", 2048, 16, dataclasses.replace(multinode, small_all_reduce="ring"), spans_nodes=True), (
        "across nodes: NCCL")
    training = graph_profile(h100, 0, training=True)
    assert collective_time_s("all_reduce", 2048, 4, training) == collective_time_s("all_reduce", 2048, 4, ring), (
        "training graphs keep the functional all-reduce")
    assert uses_symmetric_memory_all_reduce(one_host=True, device_types={"cuda"}, has_kernel=True)
    for one_host, types, kernel in ((False, {"cuda"}, True), (True, {"cuda", "cpu"}, True), (True, {"cpu"}, True),
                                    (True, {"cuda"}, False)):
        assert not uses_symmetric_memory_all_reduce(one_host=one_host, device_types=types, has_kernel=kernel), (
            one_host, types, kernel)


def test_shared_memory_collectives_pay_for_slots_pushed_out_of_cache() -> None:
    """A profile with a ``shared_memory_cold_curve``: each graph's shared-memory collectives pay the
    curve's value at the graph's working set per call (nothing where the working set stays cached,
    the DRAM figure beyond the last point, log-interpolated between), numerically and symbolically
    alike; the curve round-trips through JSON and older profiles read none."""
    import json

    from autotp.cost_model import LinkProfile
    from autotp.cost_model.symbolic import evaluate_s, symbolic_collective_time_s

    shm = LinkProfile(name="shm", bandwidth_gbps=4.0, latency_s=0.0, base_latency_s=5e-6)
    warm = dataclasses.replace(_cpu(), small_all_reduce="shared_memory", shared_memory_link=shm)
    cold = dataclasses.replace(warm, shared_memory_cold_call_s=80e-6,
                               shared_memory_cold_curve=((MIB, 0.0), (16 * MIB, 20e-6), (1024 * MIB, 80e-6)))
    nbytes = 24 * 2**10
    base = collective_time_s("all_reduce", nbytes, 2, at_working_set(warm, 4096 * MIB))
    for size, extra in ((MIB // 2, 0.0), (MIB, 0.0), (4 * MIB, 10e-6), (16 * MIB, 20e-6), (4096 * MIB, 80e-6)):
        resolved = at_working_set(cold, size)
        assert resolved.shared_memory_cold_call_s == pytest.approx(extra), size
        assert collective_time_s("all_reduce", nbytes, 2, resolved) == pytest.approx(base + extra), size
        assert collective_time_s("all_gather", nbytes, 2, resolved) == pytest.approx(
            collective_time_s("all_gather", nbytes, 2, at_working_set(warm, size)) + extra), size
        assert evaluate_s(symbolic_collective_time_s("all_reduce", nbytes, 2, resolved), {}) == pytest.approx(
            collective_time_s("all_reduce", nbytes, 2, resolved)), size
    assert at_working_set(at_working_set(cold, MIB), 4096 * MIB) == at_working_set(cold, 4096 * MIB), \
        "resolving again starts from the curve"
    assert Hardware.from_json(cold.to_json()) == cold
    old = {key: value for key, value in cold.to_dict().items()
           if key not in ("shared_memory_cold_call_s", "shared_memory_cold_curve")}
    assert Hardware.from_json(json.dumps(old)).shared_memory_cold_curve == ()
    with pytest.raises(ValueError, match="shared_memory_cold_curve must be in ascending"):
        dataclasses.replace(cold, shared_memory_cold_curve=((MIB, 0.0), (MIB, 1e-6)))
