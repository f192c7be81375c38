"""Unit tests of autotp.cost_model: published formulas against hand-computed values.

Tier (a): no process group, no GPU. Every expected value below is worked out by hand from the
formula it tests, with round numbers so that the arithmetic can be checked in one's head.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from autotp.cost_model import (
    COLLECTIVE_KINDS,
    KNOWN_HARDWARE,
    Hardware,
    LinkProfile,
    aten_flops,
    aten_memory_bytes,
    collective_time_s,
    compute_time_s,
    get_hardware,
    tensor_bytes,
)

aten = torch.ops.aten

# A link with round numbers: alpha = 1 us per step, B = 100 GB/s, no per-call base latency,
# so collective times are exactly the textbook formulas.
ALPHA_S = 1e-6
BANDWIDTH_BYTES_PER_S = 100e9
ROUND_LINK = LinkProfile(name="round", bandwidth_gbps=100.0, latency_s=ALPHA_S)
SLOW_LINK = LinkProfile(name="slow", bandwidth_gbps=10.0, latency_s=10e-6)
ROUND_HW = Hardware(
    name="round",
    peak_tflops={"float32": 10.0, "bfloat16": 100.0},
    memory_bandwidth_gbps=1000.0,
    memory_gib=16.0,
    kernel_floor_s=5e-6,
    intra_node=ROUND_LINK,
    inter_node=SLOW_LINK,
    devices_per_node=8,
)
N_BYTES = 8e6  # 8 MB: n/B = 80 us on ROUND_LINK


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-12, abs_tol=0.0)


# ---------------------------------------------------------------------------------------------
# Collectives: every kind, ring and tree, against the published formulas
# ---------------------------------------------------------------------------------------------

# (kind, algorithm, p, expected seconds) with alpha = 1 us, n/B = 80 us.
COLLECTIVE_CASES = [
    # ring all-reduce 2(p-1)a + 2(p-1)/p n/B, p=4: 6 us + 1.5 * 80 us = 126 us
    ("all_reduce", "ring", 4, 6e-6 + 120e-6),
    # tree all-reduce 2 ceil(log2 p) a + 2 n/B, p=8: 6 us + 160 us
    ("all_reduce", "tree", 8, 6e-6 + 160e-6),
    # p=5 -> ceil(log2 5) = 3: 6 us + 160 us
    ("all_reduce", "tree", 5, 6e-6 + 160e-6),
    # all-gather ring (p-1)a + (p-1)/p n/B, p=4: 3 us + 60 us
    ("all_gather", "ring", 4, 3e-6 + 60e-6),
    # all-gather recursive doubling log2(p) a + (p-1)/p n/B, p=8: 3 us + 70 us
    ("all_gather", "tree", 8, 3e-6 + 70e-6),
    # reduce-scatter ring, p=2: 1 us + 40 us
    ("reduce_scatter", "ring", 2, 1e-6 + 40e-6),
    # reduce-scatter recursive halving, p=4: 2 us + 60 us
    ("reduce_scatter", "tree", 4, 2e-6 + 60e-6),
    # all-to-all pairwise exchange (p-1)a + (p-1)/p n/B, p=8: 7 us + 70 us
    ("all_to_all", "ring", 8, 7e-6 + 70e-6),
    # all-to-all Bruck log2(p) a + log2(p)/2 n/B, p=8: 3 us + 1.5 * 80 us
    ("all_to_all", "tree", 8, 3e-6 + 120e-6),
    # broadcast pipelined ring (p-1)a + n/B, p=4: 3 us + 80 us
    ("broadcast", "ring", 4, 3e-6 + 80e-6),
    # broadcast binomial tree ceil(log2 p)(a + n/B), p=4: 2 * 81 us
    ("broadcast", "tree", 4, 2 * 81e-6),
]


@pytest.mark.parametrize(("kind", "algorithm", "group_size", "expected_s"), COLLECTIVE_CASES)
def test_collective_matches_published_formula(kind: str, algorithm: str, group_size: int, expected_s: float):
    """Single node, intra-node link; alpha = 1 us, B = 100 GB/s, n = 8 MB."""
    actual = collective_time_s(kind, N_BYTES, group_size, ROUND_HW, algorithm=algorithm)
    assert close(actual, expected_s), (
        f"{kind}/{algorithm} p={group_size}: expected {expected_s}, got {actual}"
    )


def test_every_kind_and_algorithm_is_covered():
    covered = {(kind, algorithm) for kind, algorithm, _, _ in COLLECTIVE_CASES}
    expected = {(kind, algorithm) for kind in COLLECTIVE_KINDS for algorithm in ("ring", "tree")}
    assert covered == expected, f"untested: {sorted(expected - covered)}"


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_group_of_one_or_zero_bytes_costs_nothing(kind: str, algorithm: str):
    """p=1 (no split) and n=0 issue no collective."""
    assert collective_time_s(kind, N_BYTES, 1, ROUND_HW, algorithm=algorithm) == 0.0
    assert collective_time_s(kind, 0, 8, ROUND_HW, algorithm=algorithm) == 0.0


def test_spans_nodes_uses_inter_node_link():
    """tp=4 across nodes: ring all-reduce on the slow link (alpha = 10 us, B = 10 GB/s)."""
    # 2(p-1) * 10 us + 2(p-1)/p * 8 MB / 10 GB/s = 60 us + 1.5 * 800 us
    expected = 60e-6 + 1200e-6
    actual = collective_time_s("all_reduce", N_BYTES, 4, ROUND_HW, spans_nodes=True)
    assert close(actual, expected), f"expected {expected}, got {actual}"


def test_gloo_prices_its_reduce_scatter_as_an_all_reduce():
    """tp=2 and 4: gloo (a CPU profile) runs a reduce-scatter as an all-reduce of the whole input, so a CPU profile
    prices it at the all-reduce's time; a GPU profile (NCCL) keeps the ring reduce-scatter, half the all-reduce's
    bytes and steps."""
    cpu = dataclasses.replace(ROUND_HW, host_is_device=True, small_all_reduce="ring")
    for group_size in (2, 4):
        all_reduce = collective_time_s("all_reduce", N_BYTES, group_size, cpu)
        assert collective_time_s("reduce_scatter", N_BYTES, group_size, cpu) == all_reduce
        nccl = collective_time_s("reduce_scatter", N_BYTES, group_size, ROUND_HW)
        assert close(nccl, collective_time_s("all_reduce", N_BYTES, group_size, ROUND_HW) / 2)
        assert collective_time_s("all_gather", N_BYTES, group_size, cpu) == nccl  # gloo's all-gather stays a ring


def test_base_latency_is_paid_once_per_call():
    """NCCL's baseLat: one fixed term per collective, on top of the alpha-beta formula."""
    link = LinkProfile(name="with-base", bandwidth_gbps=100.0, latency_s=ALPHA_S, base_latency_s=7e-6)
    hw = Hardware(
        name="with-base",
        peak_tflops={"float32": 1.0},
        memory_bandwidth_gbps=100.0,
        memory_gib=1.0,
        kernel_floor_s=0.0,
        intra_node=link,
        inter_node=link,
        devices_per_node=8,
    )
    expected = 7e-6 + 6e-6 + 120e-6  # base + ring all-reduce p=4 (see COLLECTIVE_CASES)
    actual = collective_time_s("all_reduce", N_BYTES, 4, hw)
    assert close(actual, expected), f"expected {expected}, got {actual}"


def test_bus_bandwidth_definition_of_nccl_tests():
    """Large ring all-reduce: algbw * 2(p-1)/p recovers the link bandwidth B (nccl-tests)."""
    p, n = 8, 1e12  # latency negligible at 1 TB
    t = collective_time_s("all_reduce", n, p, ROUND_HW)
    bus_bw = n / t * 2 * (p - 1) / p
    assert math.isclose(bus_bw, BANDWIDTH_BYTES_PER_S, rel_tol=1e-6), (
        f"busbw: expected {BANDWIDTH_BYTES_PER_S}, got {bus_bw}"
    )


def test_unknown_kind_or_algorithm_lists_valid_ones():
    with pytest.raises(ValueError, match="all_reduce, all_gather, reduce_scatter, all_to_all, broadcast"):
        collective_time_s("allreduce", N_BYTES, 4, ROUND_HW)
    with pytest.raises(ValueError, match="ring, tree"):
        collective_time_s("all_reduce", N_BYTES, 4, ROUND_HW, algorithm="butterfly")
    with pytest.raises(ValueError, match="group_size"):
        collective_time_s("all_reduce", N_BYTES, 0, ROUND_HW)


def test_nvlink_beats_pcie_for_the_same_all_reduce():
    """tp=8 all-reduce of 16 MB: NVLink4 (450 GB/s) is faster than PCIe Gen4 (32 GB/s)."""
    nvlink = collective_time_s("all_reduce", 16e6, 8, get_hardware("h100-sxm"))
    pcie = collective_time_s("all_reduce", 16e6, 8, get_hardware("pcie-gpu"))
    assert nvlink < pcie, f"NVLink {nvlink} s should beat PCIe {pcie} s"


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------


def test_roofline_compute_bound():
    """bf16 GEMM 1024^3 on 100 TFLOP/s: 2*1024^3 FLOPs / 1e14 + 5 us floor."""
    flops = 2 * 1024**3
    memory_bytes = 3 * 1024 * 1024 * 2  # A, B, C in bf16: 6 MiB / 1 TB/s = 6.3 us < 21.5 us
    expected = flops / 100e12 + 5e-6
    actual = compute_time_s(flops, memory_bytes, torch.bfloat16, ROUND_HW)
    assert close(actual, expected), f"expected {expected}, got {actual}"


def test_roofline_memory_bound():
    """fp32 elementwise add of 1M elements: 12 MB / 1000 GB/s = 12 us (+5 us floor) > 1M/10T."""
    numel = 1 << 20
    memory_bytes = 3 * numel * 4
    expected = memory_bytes / 1000e9 + 5e-6
    actual = compute_time_s(numel, memory_bytes, torch.float32, ROUND_HW)
    assert close(actual, expected), f"expected {expected}, got {actual}"


def test_roofline_is_dtype_aware():
    """The same FLOPs take 10x longer in fp32 (10 TFLOP/s) than in bf16 (100 TFLOP/s)."""
    flops = 1e12
    fp32 = compute_time_s(flops, 0, torch.float32, ROUND_HW) - ROUND_HW.kernel_floor_s
    bf16 = compute_time_s(flops, 0, torch.bfloat16, ROUND_HW) - ROUND_HW.kernel_floor_s
    assert close(fp32, 0.1) and close(bf16, 0.01), f"fp32 {fp32} s, bf16 {bf16} s"


def test_roofline_floor_and_no_kernel():
    """A tiny op costs the kernel floor; an op with no FLOPs and no bytes costs nothing."""
    assert compute_time_s(0, 0, torch.float32, ROUND_HW) == 0.0
    tiny = compute_time_s(2, 8, torch.float32, ROUND_HW)  # 8 B / 1 TB/s = 8 ps above the floor
    assert close(tiny, 8 / 1000e9 + 5e-6), f"expected the 5 us floor + 8 ps, got {tiny}"


def test_roofline_achievable_fractions_scale_the_roofs():
    """Half the achievable compute doubles compute-bound time (floor excluded)."""
    derated = Hardware(**{**ROUND_HW.__dict__, "name": "derated", "achievable_fraction_compute": 0.5})
    flops = 1e12
    actual = compute_time_s(flops, 0, torch.float32, derated) - derated.kernel_floor_s
    assert close(actual, 0.2), f"expected 0.2 s, got {actual}"


def test_roofline_missing_dtype_names_the_fix():
    with pytest.raises(ValueError, match=r"no peak_tflops for dtype 'float16'.*bfloat16, float32"):
        compute_time_s(1e9, 0, torch.float16, ROUND_HW)
    # Pure data movement does not need the dtype's peak.
    assert compute_time_s(0, 1000, torch.int64, ROUND_HW) > 0


def test_tensor_bytes():
    assert tensor_bytes((4, 8), torch.bfloat16) == 64
    assert tensor_bytes(torch.Size([3, 5]), torch.float32) == 60
    assert tensor_bytes((), torch.float64) == 8


# ---------------------------------------------------------------------------------------------
# FLOP counts agree with torch.utils.flop_counter
# ---------------------------------------------------------------------------------------------


def counted_flops(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as mode:
        fn(*args, **kwargs)
    return mode.get_total_flops()


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def test_linear_flops_match_flop_counter():
    """linear (batch 3, seq 5, in 7 -> out 11): 2*15*11*7."""
    x, w, b = torch.randn(3, 5, 7), torch.randn(11, 7), torch.randn(11)
    expected = counted_flops(F.linear, x, w, b)
    actual = aten_flops(aten.linear.default, (meta(3, 5, 7), meta(11, 7), meta(11)), {}, meta(3, 5, 11))
    assert actual == expected == 2 * 15 * 11 * 7, f"expected {expected}, got {actual}"


def test_addmm_mm_bmm_flops_match_flop_counter():
    a, b, bias = torch.randn(6, 4), torch.randn(4, 9), torch.randn(9)
    assert aten_flops(aten.addmm.default, (bias, a, b), {}, None) == counted_flops(torch.addmm, bias, a, b)
    assert aten_flops(aten.mm.default, (a, b), {}, None) == counted_flops(torch.mm, a, b) == 2 * 6 * 9 * 4
    x, y = torch.randn(3, 6, 4), torch.randn(3, 4, 9)
    expected = counted_flops(torch.bmm, x, y)
    actual = aten_flops(aten.bmm.default, (meta(3, 6, 4), meta(3, 4, 9)), {}, meta(3, 6, 9))
    assert actual == expected == 2 * 3 * 6 * 9 * 4, f"expected {expected}, got {actual}"


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [((2, 3, 4, 5), (5, 6)), ((2, 1, 4, 5), (3, 5, 6)), ((4, 5), (5, 6))],
)
def test_matmul_flops_match_flop_counter(a_shape, b_shape):
    """torch.matmul with broadcasting batch dims decomposes into mm/bmm."""
    expected = counted_flops(torch.matmul, torch.randn(a_shape), torch.randn(b_shape))
    actual = aten_flops(aten.matmul.default, (meta(*a_shape), meta(*b_shape)), {}, None)
    assert actual == expected, f"matmul {a_shape} @ {b_shape}: expected {expected}, got {actual}"


def test_sdpa_flops_match_flop_counter_and_formula():
    """SDPA (B=2, H=4, Sq=8, Sk=10, D=16): 4*B*H*Sq*Sk*D, as the math backend's two bmm count it."""
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
    with sdpa_kernel(SDPBackend.MATH):
        expected = counted_flops(F.scaled_dot_product_attention, q, k, v)
    actual = aten_flops(
        aten.scaled_dot_product_attention.default,
        (meta(2, 4, 8, 16), meta(2, 4, 10, 16), meta(2, 4, 10, 16)),  # (batch, heads, seq, head_dim)
        {},
    )
    assert actual == expected == 4 * 2 * 4 * 8 * 10 * 16, f"expected {expected}, got {actual}"


def test_conv_flops_match_flop_counter():
    """conv2d (N=2, C 3->8, 16x16, k=3, stride 2, pad 1) with and without the output given."""
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    expected = counted_flops(F.conv2d, x, w, None, 2, 1)
    out = F.conv2d(x, w, None, 2, 1)
    args = (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    assert aten_flops(aten.convolution.default, args, {}, out) == expected
    assert aten_flops(aten.convolution.default, args, {}, None) == expected
    assert aten_flops(aten.conv2d.default, (x, w, None, [2, 2], [1, 1]), {}, None) == expected


def test_elementwise_ops_count_zero_flops_but_move_bytes():
    x = meta(4, 8)
    assert aten_flops(aten.add.Tensor, (x, x), {}, x) == 0
    assert aten_memory_bytes(aten.add.Tensor, (x, x), {}, x) == 3 * 4 * 8 * 4
    assert aten_memory_bytes(aten.view.default, (x, [32]), {}, meta(32)) == 0


# ---------------------------------------------------------------------------------------------
# Hardware profiles: known names, errors, JSON round trip
# ---------------------------------------------------------------------------------------------


def test_known_hardware_names():
    required = {"h100-sxm", "h200", "a100-sxm", "pcie-gpu", "h100-multinode", "cpu-gloo"}
    assert required <= set(KNOWN_HARDWARE), f"missing {required - set(KNOWN_HARDWARE)}"
    for name, hw in KNOWN_HARDWARE.items():
        assert hw.name == name
        assert {"float32", "bfloat16", "float16"} <= set(hw.peak_tflops), f"{name}: {dict(hw.peak_tflops)}"
    assert get_hardware("h100-sxm") is KNOWN_HARDWARE["h100-sxm"]
    assert get_hardware(ROUND_HW) is ROUND_HW


def test_pcie_profile_has_no_nvlink():
    pcie = get_hardware("pcie-gpu")
    assert pcie.intra_node.bandwidth_gbps < 64, f"PCIe Gen4 x16 per direction, got {pcie.intra_node}"


def test_unknown_name_lists_known_ones_and_json():
    with pytest.raises(ValueError) as info:
        get_hardware("h900")
    message = str(info.value)
    for name in KNOWN_HARDWARE:
        assert name in message, f"{name!r} not listed in: {message}"
    assert ".json" in message, message


@pytest.mark.parametrize("name", sorted(KNOWN_HARDWARE))
def test_json_round_trip(name: str, tmp_path):
    hw = KNOWN_HARDWARE[name]
    assert Hardware.from_json(hw.to_json()) == hw
    path = tmp_path / f"{name}.json"
    path.write_text(hw.to_json())
    loaded = get_hardware(path)
    assert loaded == hw and hash(loaded) == hash(hw)
    assert get_hardware(str(path)) == hw
    assert loaded.source == hw.source


def test_corrupt_json_names_file_and_field(tmp_path):
    data = json.loads(get_hardware("h100-sxm").to_json())
    del data["memory_bandwidth_gbps"]
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing\.json.*memory_bandwidth_gbps"):
        get_hardware(missing)

    data = json.loads(get_hardware("h100-sxm").to_json())
    data["intra_node"]["bandwidth_gbps"] = -1
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"negative\.json.*intra_node.*bandwidth_gbps"):
        get_hardware(negative)

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match=r"garbage\.json.*not valid JSON"):
        get_hardware(garbage)

    with pytest.raises(ValueError, match=r"nowhere\.json"):
        get_hardware(tmp_path / "nowhere.json")


def test_hardware_validates_where_built():
    with pytest.raises(ValueError, match="devices_per_node"):
        Hardware(**{**ROUND_HW.__dict__, "devices_per_node": 0})
    with pytest.raises(ValueError, match="achievable_fraction_memory"):
        Hardware(**{**ROUND_HW.__dict__, "achievable_fraction_memory": 1.5})
    with pytest.raises(ValueError, match="latency_s"):
        LinkProfile(name="bad", bandwidth_gbps=1.0, latency_s=-1.0)


def test_hardware_is_immutable():
    hw = get_hardware("h100-sxm")
    with pytest.raises(TypeError):
        hw.peak_tflops["bfloat16"] = 1.0  # type: ignore[index]
