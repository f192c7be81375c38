"""Tier (a): per-node passes computed once per structural key give what computing every node gives.

``build_strategy_graph`` and ``cost_strategy_graph`` enumerate and price each distinct node key
once (:mod:`autotp.passes.node_keys`); here every node is enumerated and priced on its own and
compared, on models whose layers repeat (where the keys are shared) and in training.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import tiny_gpt2, tiny_llama, tiny_mixtral

from autotp.capture.tracing import capture
from autotp.cost_model import get_hardware
from autotp.passes.backward import Training
from autotp.passes.costing import _node_compute_s, cost_strategy_graph
from autotp.passes.node_keys import node_key, node_keys
from autotp.passes.rules import RuleContext, block_counts, strategies_for
from autotp.passes.rules.experts import EXPERT_ROLE, mark_expert_roles
from autotp.passes.strategies import _static_splits_only, build_strategy_graph

BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "mixtral": tiny_mixtral}


@functools.cache
def _captured(name: str):
    model, args, kwargs = BUILDERS[name](layers=4, device="meta")
    return capture(model, args, kwargs)


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("training", [False, True])
def test_shared_keys_give_the_strategies_and_costs_of_each_node(name: str, world_size: int, training: bool) -> None:
    """tp=2 and tp=3 (uneven heads), 4 repeated layers: every node's strategies and seconds per strategy
    equal those enumerated and priced for that node alone."""
    captured = _captured(name)
    gm = captured.graph_module
    graph = build_strategy_graph(gm, world_size, {**captured.parameter_fqns(), **captured.state_fqns()},
                                 frozenset(captured.state))
    keys = node_keys(gm.graph.nodes)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    shared = len(calls) - len({keys[n] for n in calls})
    assert shared > len(calls) // 2, f"expected most of the {len(calls)} calls to share a key, {shared} did"
    ctx = RuleContext(world_size, block_counts(gm), False, mark_expert_roles(gm))
    for node in calls:
        alone = _static_splits_only(node, strategies_for(node, ctx))
        assert graph.strategies[node.name] == alone, f"{node.format_node()}: {graph.strategies[node.name]} != {alone}"
    hardware = get_hardware("cpu-gloo")
    train = Training.of(graph) if training else None
    costed = cost_strategy_graph(graph, hardware, train)
    for name_ in graph.order:
        alone = _node_compute_s(graph.nodes[name_], graph.strategies[name_], world_size, costed.hardware, train)
        assert costed.compute_s[name_] == alone, f"{name_}: {costed.compute_s[name_]} != {alone}"


def test_keys_tell_apart_what_the_rules_read() -> None:
    """The same op on other shapes, the same input twice against two inputs, other constants, a node's part in a
    mixture-of-experts block (which rules read from ``node.meta``): other keys."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    z = graph.placeholder("z")
    z.meta["val"] = torch.empty(8, 4, device="meta")
    nodes = {
        "x*x": graph.call_function(torch.ops.aten.mul.Tensor, (x, x)),
        "x*y": graph.call_function(torch.ops.aten.mul.Tensor, (x, y)),
        "y*x": graph.call_function(torch.ops.aten.mul.Tensor, (y, x)),
        "z*z": graph.call_function(torch.ops.aten.mul.Tensor, (z, z)),
        "x*2": graph.call_function(torch.ops.aten.mul.Tensor, (x, 2)),
        "x*2.0": graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)),
        "x*True": graph.call_function(torch.ops.aten.mul.Tensor, (x, True)),
        "x+y": graph.call_function(torch.ops.aten.add.Tensor, (x, y)),
    }
    for n in nodes.values():
        n.meta["val"] = torch.empty(4, 8, device="meta")
    nodes["z*z"].meta["val"] = torch.empty(8, 4, device="meta")
    nodes["x*y as experts"] = graph.call_function(torch.ops.aten.mul.Tensor, (x, y))
    nodes["x*y as experts"].meta.update(val=torch.empty(4, 8, device="meta"), **{EXPERT_ROLE: "batched"})
    keys = {label: node_key(n) for label, n in nodes.items()}
    assert keys["x*y"] == keys["y*x"], "two distinct inputs of equal values must share a key"
    others = [k for label, k in keys.items() if label != "y*x"]
    assert len(set(others)) == len(others), f"expected distinct keys, got {keys}"
    nodes["x*y"].meta["val"] = object()  # not a value the key can describe
    assert node_key(nodes["x*y"]) is None
