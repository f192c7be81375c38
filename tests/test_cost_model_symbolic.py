"""Symbolic costs (sympy expressions of batch and sequence length) agree with the numeric model.

Tier (a): no process group. The symbolic functions share their formulas with the numeric ones,
so at any concrete size the two must give the same number.
"""

from __future__ import annotations

import math

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from autotp.cost_model import (
    COLLECTIVE_KINDS,
    aten_flops,
    collective_time_s,
    compute_time_s,
    get_hardware,
    tensor_bytes,
)
from autotp.cost_model.symbolic import (
    BATCH,
    SEQ,
    crossover,
    evaluate_s,
    rename_symbols,
    symbolic_aten_flops,
    symbolic_collective_time_s,
    symbolic_compute_time_s,
    symbolic_tensor_bytes,
)

aten = torch.ops.aten
HIDDEN, FFN = 4096, 11008
SIZES = [(1, 1), (1, 4096), (8, 1), (4, 512)]  # (batch, seq): decode and prefill


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-9)


def test_symbolic_flops_of_common_ops():
    """linear (B, S, 4096) -> 11008: 2*B*S*4096*11008; SDPA with H=32, D=128: 4*B*32*S*S*128."""
    linear = symbolic_aten_flops(aten.linear.default, ((BATCH, SEQ, HIDDEN), (FFN, HIDDEN)))
    assert sympy.simplify(linear - 2 * BATCH * SEQ * HIDDEN * FFN) == 0, linear
    qkv = (BATCH, 32, SEQ, 128)
    sdpa = symbolic_aten_flops(aten.scaled_dot_product_attention.default, (qkv, qkv, qkv))
    assert sympy.simplify(sdpa - 4 * BATCH * 32 * SEQ**2 * 128) == 0, sdpa
    mm = symbolic_aten_flops(aten.mm.default, ((BATCH * SEQ, HIDDEN), (HIDDEN, FFN)))
    assert sympy.simplify(mm - linear) == 0, mm
    assert symbolic_aten_flops(aten.add.Tensor, ((BATCH, SEQ), (BATCH, SEQ))) == 0


@pytest.mark.parametrize(("batch", "seq"), SIZES)
@pytest.mark.parametrize("hardware_name", ["h100-sxm", "pcie-gpu"])
def test_symbolic_roofline_equals_numeric(batch: int, seq: int, hardware_name: str):
    """An MLP up-projection in bf16, decode (memory bound) and prefill (compute bound) sizes."""
    hw = get_hardware(hardware_name)
    flops = symbolic_aten_flops(aten.linear.default, ((BATCH, SEQ, HIDDEN), (FFN, HIDDEN)))
    moved = sum(
        symbolic_tensor_bytes(shape, torch.bfloat16)
        for shape in [(BATCH, SEQ, HIDDEN), (FFN, HIDDEN), (BATCH, SEQ, FFN)]
    )
    expr = symbolic_compute_time_s(flops, moved, torch.bfloat16, hw)
    numeric_flops = 2 * batch * seq * HIDDEN * FFN
    numeric_bytes = sum(
        tensor_bytes(shape, torch.bfloat16)
        for shape in [(batch, seq, HIDDEN), (FFN, HIDDEN), (batch, seq, FFN)]
    )
    expected = compute_time_s(numeric_flops, numeric_bytes, torch.bfloat16, hw)
    actual = evaluate_s(expr, {BATCH: batch, SEQ: seq})
    assert close(actual, expected), f"B={batch} S={seq} on {hardware_name}: expected {expected}, got {actual}"


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_symbolic_collective_equals_numeric(kind: str, algorithm: str):
    """tp=8 on H100 NVLink, and tp=16 across nodes, for an activation of (B, S, 4096) bf16."""
    hw = get_hardware("h100-multinode")
    nbytes = symbolic_tensor_bytes((BATCH, SEQ, HIDDEN), torch.bfloat16)
    for group_size, spans_nodes in [(8, False), (16, True), (1, False)]:
        expr = symbolic_collective_time_s(
            kind, nbytes, group_size, hw, spans_nodes=spans_nodes, algorithm=algorithm
        )
        for batch, seq in SIZES:
            expected = collective_time_s(
                kind, batch * seq * HIDDEN * 2, group_size, hw, spans_nodes=spans_nodes, algorithm=algorithm
            )
            actual = evaluate_s(expr, {BATCH: batch, SEQ: seq})
            assert close(actual, expected) or actual == expected == 0.0, (
                f"{kind}/{algorithm} p={group_size} B={batch} S={seq}: expected {expected}, got {actual}"
            )


def test_symbolic_sizes_from_fake_tensors():
    """FakeTensors with dynamic batch and seq (as torch.export makes them) give SymInt sizes."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]
    )
    static = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(4, 8, 16), symbolic_context=dynamic)  # (batch, seq, hidden)
    weight = mode.from_tensor(torch.empty(32, 16), symbolic_context=static)  # (out, in)
    batch_name, seq_name = str(x.shape[0]), str(x.shape[1])
    flops = symbolic_aten_flops(aten.linear.default, (x, weight))
    expr = rename_symbols(flops, {batch_name: BATCH, seq_name: SEQ})
    assert sympy.simplify(expr - 2 * BATCH * SEQ * 32 * 16) == 0, expr
    # The numeric count uses the example sizes (4, 8) without guarding on them.
    assert aten_flops(aten.linear.default, (x, weight)) == 2 * 4 * 8 * 32 * 16


def split_vs_whole(hardware_name: str, tp: int) -> tuple[sympy.Expr, sympy.Expr]:
    """Row-parallel down-projection (B, S, 11008) -> 4096 in bf16: whole vs split over tp + all-reduce."""
    hw = get_hardware(hardware_name)
    flops = symbolic_aten_flops(aten.linear.default, ((BATCH, SEQ, FFN), (HIDDEN, FFN)))
    shapes = [(BATCH, SEQ, FFN), (HIDDEN, FFN), (BATCH, SEQ, HIDDEN)]
    moved = sum(symbolic_tensor_bytes(shape, torch.bfloat16) for shape in shapes)
    whole = symbolic_compute_time_s(flops, moved, torch.bfloat16, hw)
    out_bytes = symbolic_tensor_bytes((BATCH, SEQ, HIDDEN), torch.bfloat16)
    split = symbolic_compute_time_s(flops / tp, moved / tp, torch.bfloat16, hw) + symbolic_collective_time_s(
        "all_reduce", out_bytes, tp, hw
    )
    return split, whole


def test_crossover_where_a_split_starts_to_pay():
    """tp=8: on NVLink the split pays from a short sequence; on PCIe only from a longer one."""
    split, whole = split_vs_whole("h100-sxm", 8)
    nvlink_seq = crossover(split, whole, SEQ, values={BATCH: 1})
    split_pcie, whole_pcie = split_vs_whole("pcie-gpu", 8)
    pcie_seq = crossover(split_pcie, whole_pcie, SEQ, values={BATCH: 1})
    assert nvlink_seq is not None and pcie_seq is not None
    # The answer is the first size where the split is cheaper.
    for expr_split, expr_whole, seq in [(split, whole, nvlink_seq), (split_pcie, whole_pcie, pcie_seq)]:
        assert evaluate_s(expr_split - expr_whole, {BATCH: 1, SEQ: seq}) < 0
        if seq > 1:
            assert evaluate_s(expr_split - expr_whole, {BATCH: 1, SEQ: seq - 1}) >= 0
    assert nvlink_seq <= pcie_seq, f"NVLink crossover {nvlink_seq} should not exceed PCIe {pcie_seq}"


def test_crossover_edges():
    x = sympy.Symbol("x", positive=True)
    assert crossover(x, 10 + 0 * x, x) == 1  # cheaper from the start: x=1 < 10
    assert crossover(100 - x, 50 + 0 * x, x) == 51  # 100 - x < 50 from x = 51
    assert crossover(x + 1, x, x, high=1024) is None  # never cheaper
    with pytest.raises(ValueError, match="still depends on"):
        evaluate_s(x * SEQ, {x: 1})
