"""Tier (a)/(b): the Megatron-style reference plan, and autotp's plan never costs more than it."""

from __future__ import annotations

import warnings

import pytest
from inspect_helpers import tiny_plan
from models import BUILDERS, tiny_llama

from autotp.capture.tracing import capture
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.megatron import megatron_plan, megatron_roles


def test_megatron_roles_on_llama() -> None:
    """tp=2: q/k/v/gate/up are column-parallel, o/down row-parallel, lm head column-parallel (found by structure)."""
    model, args, kwargs = tiny_llama(device="meta")
    captured = capture(model, tuple(a.to("meta") for a in args), kwargs)
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    roles = {graph.parameters[w]: role for w, (role, _, _) in megatron_roles(graph).items()}
    layer = "model.layers.0."
    expected = {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
                "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
    for module, role in expected.items():
        assert roles[f"{layer}{module}.weight"] == role, f"{module}: expected {role}, got {roles[f'{layer}{module}.weight']}"
    assert roles["lm_head.weight"] == "column"


@pytest.mark.slow  # 6 full plans plus 6 reference plans (~20 s): runs in CI, not in the fast tier
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("hardware", ["h100-sxm", "pcie-gpu"])
def test_autotp_plan_costs_no_more_than_megatron(name: str, hardware: str) -> None:
    """tp=4: under one cost model and one memory budget, autotp's optimum <= the Megatron-style plan."""
    ours = tiny_plan(name, 4, hardware=hardware)  # the default budget, as megatron_plan's
    model, args, kwargs = BUILDERS[name](device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = megatron_plan(model, args, kwargs, world_size=4, hardware=hardware)
    assert ours.predicted_time_s <= reference.predicted_time_s * (1 + 1e-9), (
        f"autotp {ours.predicted_time_s:.6g} s > Megatron {reference.predicted_time_s:.6g} s")
    assert reference.collective_counts().get("all_reduce", 0) >= 4, reference.collective_counts()
