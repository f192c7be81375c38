"""autotp.estimate(plan): time per forward broken down per node and per layer, memory per rank.

Tier (a) and (b): hand-built plans and plans of meta-device models; no process group.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
from models import tiny_llama

import autotp
from autotp.inspect.estimates import layer_of, local_nbytes
from autotp.planning.decisions import CollectiveDecision, NodeDecision
from autotp.planning.plan import Plan

KIB = 1024
F32 = "float32"


def _node(name: str, op: str, inputs: tuple[str, ...], output: str, shape: tuple[int, ...], *,
          input_nodes: tuple[str, ...] = (), compute_s: float = 0.0, module: str = "", target: str = "") -> NodeDecision:
    return NodeDecision(name=name, op=op, inputs=inputs, output=output, compute_s=compute_s, module=module,
                        input_nodes=input_nodes, target=target, shape=shape, dtype=F32)


def megatron_mlp_plan() -> Plan:
    """tp=2 by hand: x (2, 16, 256) -> column-split Linear(256, 1024) -> GELU -> row-split Linear(1024, 256)
    -> all-reduce. Per rank: x 32 KiB, hidden (2, 16, 512) 64 KiB, Partial output and its all-reduce 32 KiB each."""
    linear, gelu = "aten.linear.default", "aten.gelu.default"
    nodes = (
        _node("w1", "placeholder", (), "S(0)", (1024, 256), target="0.weight"),
        _node("w2", "placeholder", (), "S(1)", (256, 1024), target="2.weight"),
        _node("x", "placeholder", (), "R", (2, 16, 256)),
        _node("linear", linear, ("R", "S(0)"), "S(2)", (2, 16, 1024), input_nodes=("x", "w1"),
              compute_s=3e-6, module="0"),
        _node("gelu", gelu, ("S(2)",), "S(2)", (2, 16, 1024), input_nodes=("linear",), compute_s=1e-6, module="1"),
        _node("linear_1", linear, ("S(2)", "S(1)"), "P", (2, 16, 256), input_nodes=("gelu", "w2"),
              compute_s=2e-6, module="2"),
        _node("output", "output", ("R",), "R", (), input_nodes=("linear_1",)),
    )
    reduce = CollectiveDecision(producer="linear_1", src="P", dst="R", steps=("all_reduce",), nbytes=32 * KIB,
                                time_s=10e-6, consumers=("output",), module="2")
    return Plan(world_size=2, hardware="h100-sxm", nodes=nodes, parameters={"0.weight": "S(0)", "2.weight": "S(1)"},
                collectives=(reduce,), parameter_bytes_total=2 * 1024 * 256 * 4,
                parameter_bytes_per_rank=1024 * 256 * 4, memory_budget_bytes=None, predicted_compute_s=6e-6,
                predicted_comm_s=10e-6, fallback_ops=(), fingerprint="hand-built")


def test_layer_of_cuts_at_the_layer_index() -> None:
    """No parallelism: module FQN -> layer group."""
    cases = {
        "model.layers.3.mlp.up_proj": "model.layers.3",
        "transformer.h.0.attn.c_attn": "transformer.h.0",
        "encoder.layer.11.attention.self": "encoder.layer.11",
        "0": "0",
        "lm_head": "lm_head",
        "model.norm": "model.norm",
        "": "(top level)",
    }
    for module, expected in cases.items():
        assert layer_of(module) == expected, f"layer_of({module!r}): expected {expected!r}, got {layer_of(module)!r}"


def test_local_bytes_of_placements() -> None:
    """tp=3, uneven: S(d) holds ceil(size/3) of dim d on the largest rank; R and P hold everything."""
    assert local_nbytes((8, 10), F32, "R", 3) == 8 * 10 * 4
    assert local_nbytes((8, 10), F32, "P", 3) == 8 * 10 * 4
    assert local_nbytes((8, 10), F32, "S(0)", 3) == 3 * 10 * 4  # 8 rows over 3 ranks: 3, 3, 2
    assert local_nbytes((8, 12), F32, "S(1)x3", 2) == 8 * 3 * 2 * 4  # 3 blocks of 4 columns, 2 of each per rank


def test_estimate_adds_up_the_plan_per_node_and_per_layer() -> None:
    """tp=2, hand-built Megatron MLP: totals, per-node and per-layer sums equal the plan's costs."""
    estimate = autotp.estimate(megatron_mlp_plan())
    assert math.isclose(estimate.compute_s, 6e-6) and math.isclose(estimate.comm_s, 10e-6), estimate
    assert math.isclose(estimate.time_s, 16e-6), estimate.time_s
    by_node = {n.name: n for n in estimate.nodes}
    assert math.isclose(by_node["linear_1"].comm_s, 10e-6), "the all-reduce counts for the node it reduces"
    assert [layer.layer for layer in estimate.layers] == ["(top level)", "0", "1", "2"], estimate.layers
    assert math.isclose(estimate.layer("2").time_s, 12e-6), estimate.layer("2")
    assert estimate.layer("2").collectives == 1
    assert math.isclose(sum(layer.time_s for layer in estimate.layers), estimate.time_s)
    with pytest.raises(KeyError, match="layers: "):
        estimate.layer("model.layers.9")


def test_activation_peak_by_hand() -> None:
    """tp=2, hand-built Megatron MLP: the peak is while GELU runs — x 32 KiB + linear's 64 KiB + GELU's 64 KiB."""
    estimate = autotp.estimate(megatron_mlp_plan())
    assert estimate.activation_peak_bytes_per_rank == 160 * KIB, (
        f"expected 160 KiB, got {estimate.activation_peak_bytes_per_rank / KIB} KiB"
    )
    assert estimate.activation_peak_after == "gelu", estimate.activation_peak_after
    assert estimate.parameter_bytes_per_rank == 1024 * KIB
    assert estimate.memory_bytes_per_rank == 1024 * KIB + 160 * KIB
    assert estimate.memory_capacity_bytes == 80 * 2**30, "h100-sxm has 80 GiB"
    text = str(estimate)
    for expected in ("time per forward: 0.016 ms", "activations  0.16 MiB at peak (after gelu)", "of 80.0 GiB"):
        assert expected in text, f"expected {expected!r} in:\n{text}"


def test_views_share_storage_and_collectives_hold_a_new_buffer() -> None:
    """tp=2: a view after the all-reduce adds no bytes; the Partial output and the reduced copy both count."""
    plan = megatron_mlp_plan()
    view = _node("view", "aten.view.default", ("R",), "R", (32, 256), input_nodes=("linear_1",), module="2")
    output = dataclasses.replace(plan.nodes[-1], input_nodes=("view",))
    reduce = dataclasses.replace(plan.collectives[0], consumers=("view",))
    plan = dataclasses.replace(plan, nodes=(*plan.nodes[:-1], view, output), collectives=(reduce,))
    estimate = autotp.estimate(plan)
    # Still the GELU peak; at the end x, the Partial sum's all-reduced copy (held through the view) are live.
    assert estimate.activation_peak_bytes_per_rank == 160 * KIB, estimate.activation_peak_bytes_per_rank


def test_plan_without_shapes_has_no_activation_estimate() -> None:
    """tp=2, a format-v1 plan (no shapes): time still adds up, activation peak is None."""
    plan = megatron_mlp_plan()
    plan = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, dtype="", shape=()) for n in plan.nodes))
    estimate = autotp.estimate(plan)
    assert estimate.activation_peak_bytes_per_rank is None and estimate.memory_bytes_per_rank is None
    assert math.isclose(estimate.time_s, 16e-6)
    assert "activations  unknown" in str(estimate)


def test_estimate_hardware_must_be_the_plans() -> None:
    """tp=2: estimating on another profile than the plan's says to re-plan."""
    with pytest.raises(ValueError, match="re-plan with autotp.plan"):
        autotp.estimate(megatron_mlp_plan(), "pcie-gpu")
    assert autotp.estimate(megatron_mlp_plan(), "h100-sxm").memory_capacity_bytes == 80 * 2**30


def test_estimate_of_a_real_plan_matches_its_prediction() -> None:
    """tp=2, tiny Llama (2 layers) on meta: estimate == plan prediction; decoder layers grouped and identical."""
    model, args, kwargs = tiny_llama(device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(hardware="h100-sxm"))
    estimate = autotp.estimate(plan)
    assert math.isclose(estimate.time_s, plan.predicted_time_s, rel_tol=1e-12), (estimate.time_s, plan.predicted_time_s)
    assert math.isclose(sum(n.compute_s for n in estimate.nodes), plan.predicted_compute_s, rel_tol=1e-12)
    layer0, layer1 = estimate.layer("model.layers.0"), estimate.layer("model.layers.1")
    assert math.isclose(layer0.time_s, layer1.time_s, rel_tol=1e-9), (layer0, layer1)
    assert layer0.collectives >= 2, f"a split decoder layer has collectives, got {layer0}"
    assert estimate.activation_peak_bytes_per_rank and estimate.activation_peak_bytes_per_rank > 0
