"""The plan responds to hardware and shapes as a person expects.

Tier (b): planning only, on the meta device; no process group. With the memory budget relaxed
(``memory_budget=None``: weights may stay whole), the same small model is

* kept whole on a PCIe-only server (``pcie-gpu``) at decode shapes (batch 1, one token): a
  split would save each linear at most a few microseconds of compute, less than the latency of
  the one collective it adds;
* split on NVLink (``h100-sxm``) at prefill shapes (batch 8, 2048 tokens): each linear then does
  hundreds of microseconds of work, and a quarter of it plus one collective is cheaper.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
from models import tiny_llama, tiny_mlp

import autotp
from autotp.cost_model import Hardware, collective_time_s, get_hardware
from autotp.planning.plan import Plan

WORLD_SIZE = 4
DECODE = {"batch": 1, "seq_len": 1}
PREFILL = {"batch": 8, "seq_len": 2048}
LINEAR = "aten.linear.default"

MODELS = {
    "mlp": lambda shapes: tiny_mlp(device="meta", **shapes),  # Linear(256, 1024), GELU, Linear(1024, 256)
    "llama": lambda shapes: tiny_llama(layers=1, device="meta", **shapes),  # hidden 256, 8 heads, 4 kv heads
}


def _plan(model_name: str, shapes: dict[str, int], hardware: str | Hardware, world_size: int = WORLD_SIZE) -> Plan:
    model, args, kwargs = MODELS[model_name](shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a rule (e.g. Llama's rotary index) are not the point here
        # static shapes: the flip is about these exact sizes, and only static dims (here also batch and
        # sequence) may be split, e.g. the tokens of a row-parallel linear's output
        return autotp.plan(model, args, kwargs, world_size=world_size,
                           options=autotp.PlanOptions(dynamic=False, hardware=hardware, memory_budget=None))


def _linears(plan: Plan) -> dict[str, Any]:
    return {node.name: node for node in plan.nodes if node.op == LINEAR}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_decode_on_pcie_keeps_small_layers_whole(model_name: str) -> None:
    """tp=4 on pcie-gpu, batch 1, seq 1: every linear replicated, no collective at all."""
    plan = _plan(model_name, DECODE, "pcie-gpu")
    linears = _linears(plan)
    assert linears, "expected linear nodes in the plan"
    split = {name: (n.inputs, n.output) for name, n in linears.items() if n.output != "R" or set(n.inputs) != {"R"}}
    assert not split, f"expected every linear kept whole (all 'R') at decode on PCIe, got splits: {split}"
    assert plan.collective_counts() == {}, f"expected no collectives, got {plan.collective_counts()}"
    # Why: the most any split saves is (1 - 1/N) of the layer's time, which is below what even the
    # cheapest collective (a few bytes, all-gather) costs on PCIe: the added latency.
    pcie = get_hardware("pcie-gpu")
    least_collective_s = collective_time_s("all_gather", 1, WORLD_SIZE, pcie)
    for name, node in linears.items():
        saved_s = node.compute_s * (1 - 1 / WORLD_SIZE)
        assert saved_s < least_collective_s, (
            f"{name}: at most {saved_s * 1e6:.2f} us saved by splitting, expected less than the "
            f"{least_collective_s * 1e6:.2f} us latency of one collective"
        )


@pytest.mark.parametrize("model_name", list(MODELS))
def test_prefill_on_nvlink_splits_the_same_layers(model_name: str) -> None:
    """tp=4 on h100-sxm, batch 8, seq 2048: every linear's work is split about 4 ways.

    Costed as replayed from a CUDA graph, so a node's time is its kernel's (in eager mode a small
    split kernel is paced by its host dispatch, which no split divides)."""
    h100 = dataclasses.replace(get_hardware("h100-sxm"), runtime_mode="cuda_graph")
    whole_plan = _plan(model_name, PREFILL, h100, world_size=1)
    whole = _linears(whole_plan)
    plan = _plan(model_name, PREFILL, h100)
    linears = _linears(plan)
    assert linears.keys() == whole.keys(), f"the same linears in both plans: {sorted(linears)} vs {sorted(whole)}"
    for name, node in linears.items():
        placements = {*node.inputs, node.output}
        assert placements != {"R"}, f"{name}: expected a split at prefill on NVLink, got {node.inputs} -> {node.output}"
        floor_s = h100.kernel_floor_s  # paid once per kernel, split or not
        ratio = (node.compute_s - floor_s) / (whole[name].compute_s - floor_s)
        assert ratio < 1.2 / WORLD_SIZE, (
            f"{name}: expected about 1/{WORLD_SIZE} of the whole layer's work per rank, got {ratio:.3f} "
            f"({node.compute_s * 1e6:.1f} us vs {whole[name].compute_s * 1e6:.1f} us)"
        )
    assert plan.predicted_comm_s > 0, "a split plan has collectives"
    assert plan.predicted_time_s < whole_plan.predicted_time_s, (
        f"expected the split plan faster than the whole model: {plan.predicted_time_s * 1e3:.3f} ms "
        f"vs {whole_plan.predicted_time_s * 1e3:.3f} ms"
    )

