"""Tier (a): one pricing function, one shard size, one notion of block — each agrees with its users."""

from __future__ import annotations

import math

import pytest
import torch
from models import tiny_mlp

from autotp.base.module_paths import block_name, block_of
from autotp.base.placements import BlockShard, Partial, Replicate, Shard
from autotp.capture.tracing import capture
from autotp.cost_model import get_hardware
from autotp.cost_model.symbolic import BATCH, SEQ
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.pricing import price_choice
from autotp.passes.solver import evaluate_choice, solve
from autotp.passes.strategies import build_strategy_graph
from autotp.passes.tying import tie_identical_blocks
from autotp.passes.uneven import Partitions, largest_shard_nbytes
from autotp.planning.alternatives import node_alternatives, strategy_text
from autotp.planning.options import PlanOptions
from autotp.planning.planner import plan_graph


def _costed_mlp(world_size: int):
    model, args, _ = tiny_mlp(device="meta")
    captured = capture(model, tuple(a.to("meta") for a in args))
    graph = build_strategy_graph(captured.graph_module, world_size, captured.parameter_fqns())
    return captured, cost_strategy_graph(graph, get_hardware("h100-sxm"))


def test_plan_milp_and_evaluate_choice_price_alike() -> None:
    """tp=3, tiny MLP (uneven 1024/3): the MILP objective, evaluate_choice and the plan's predicted time agree."""
    captured, costed = _costed_mlp(3)
    solution = solve(costed, memory_budget_bytes=None)
    price = price_choice(costed, solution.choice)
    plan = plan_graph(captured, PlanOptions(world_size=3, memory_budget=None))
    assert price.blocked == "", f"the solver's choice is priced as impossible: {price.blocked}"
    assert evaluate_choice(costed, solution.choice) == price.total_s
    assert price.total_s == pytest.approx(solution.objective_s, rel=1e-9), (price.total_s, solution.objective_s)
    assert (plan.predicted_compute_s, plan.predicted_comm_s) == (price.compute_s, price.comm_s), (
        f"plan {plan.predicted_compute_s, plan.predicted_comm_s} vs price {price.compute_s, price.comm_s}")
    assert len(plan.collectives) == len(price.reshardings), (plan.collectives, price.reshardings)


def test_alternative_delta_is_the_change_in_price() -> None:
    """tp=2, tiny MLP: an alternative that changes one node only costs exactly the price difference of the choices."""
    _, costed = _costed_mlp(2)
    solution = solve(costed, memory_budget_bytes=None)
    base = price_choice(costed, solution.choice).total_s
    checked = 0
    for name, alternatives in node_alternatives(costed, solution.choice).items():
        texts = [strategy_text(s) for s in costed.graph.strategies[name]]
        for alt in alternatives:
            if alt.note or alt.delta_s is None:
                continue  # a weight moved along with the node, or the change is impossible
            changed = dict(solution.choice, **{name: texts.index(alt.strategy)})
            expected = price_choice(costed, changed).total_s - base
            assert alt.delta_s == pytest.approx(expected, rel=1e-9, abs=1e-15), (
                f"{name} as {alt.strategy}: alternative says {alt.delta_s}, price difference {expected}")
            checked += 1
    assert checked >= 3, f"expected several single-node alternatives to compare, found {checked}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_largest_shard_is_the_largest_cut_of_a_lone_split(world_size: int) -> None:
    """tp=1..8, every size 1..17: for a tensor alone in its split, the helper's bytes are the largest rank's cut."""
    for size in range(1, 18):
        parts = Partitions(world_size)
        parts.add(("w", 0, 1), size)
        largest = max(parts.sizes("w", 0))
        got = largest_shard_nbytes((size, 3), 2, Shard(0), world_size)
        assert got == largest * 3 * 2, f"size {size} over {world_size}: expected {largest * 6} bytes, got {got}"


def test_largest_shard_of_each_placement() -> None:
    """tp=3: R and P hold all, S(d) ceil(size / 3) of dim d, S(d)x2 ceil(size / 2 / 3) of each block; empty dims 0."""
    shape, item = (8, 12), 4
    cases = {Replicate(): 8 * 12 * 4, Partial(): 8 * 12 * 4, Shard(0): 3 * 12 * 4, Shard(1): 8 * 4 * 4,
             BlockShard(1, 2): 8 * 2 * 2 * 4}
    for placement, expected in cases.items():
        got = largest_shard_nbytes(shape, item, placement, 3)
        assert got == expected, f"{placement}: expected {expected}, got {got}"
    assert largest_shard_nbytes((0, 4), 4, Shard(0), 3) == 0
    assert largest_shard_nbytes((), 4, Replicate(), 3) == 4


def test_largest_shard_of_a_symbolic_shape_follows_the_integer_rule() -> None:
    """tp=3, shape (batch, seq, 12) with sympy sizes: every placement's expression, evaluated at
    sizes that split evenly and unevenly, equals the integer rule at those sizes."""
    placements = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2), BlockShard(2, 2)]
    for placement in placements:
        expression = largest_shard_nbytes((BATCH, SEQ, 12), 2, placement, 3)
        for batch, seq in [(1, 1), (2, 7), (3, 9), (5, 100)]:
            got = int(expression.subs({BATCH: batch, SEQ: seq}))
            expected = largest_shard_nbytes((batch, seq, 12), 2, placement, 3)
            assert got == expected, f"{placement} at batch={batch} seq={seq}: expected {expected}, got {got} ({expression})"


def test_block_of_module_paths() -> None:
    """No mesh: the block is the path up to its first integer segment, for any container name."""
    cases = {
        "model.layers.3.mlp.up_proj": (("model.layers", 3), "model.layers.3"),
        "transformer.h.11.attn.c_attn.weight": (("transformer.h", 11), "transformer.h.11"),
        "0.weight": (("", 0), "0"),
        "a.1b.2.c": (("a.1b", 2), "a.1b.2"),
        "lm_head": (None, None),
        "": (None, None),
    }
    for path, expected in cases.items():
        got = (block_of(path), block_name(path))
        assert got == expected, f"{path!r}: expected {expected}, got {got}"


def test_children_of_a_top_level_sequential_are_tied() -> None:
    """tp=2, Sequential of three identical Linear+ReLU pairs: layers 2 and 4 use layer 0's decisions."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(m for _ in range(3) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())))
    captured = capture(model, (torch.empty(4, 64, device="meta"),))
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    rep = tie_identical_blocks(graph)
    by_fqn = {fqn: name for name, fqn in graph.parameters.items()}
    got = {fqn: rep[by_fqn[fqn]] for fqn in ("2.weight", "4.weight")}
    expected = {fqn: by_fqn["0.weight"] for fqn in got}
    assert got == expected, f"expected both tied to {by_fqn['0.weight']}, got {got}"
    assert math.isfinite(solve(cost_strategy_graph(graph, get_hardware("h100-sxm")), memory_budget_bytes=None,
                               tie=rep).objective_s)


def test_a_resharding_is_priced_once_per_shape_as_the_route_prices_it() -> None:
    """tp=3, tiny MLP: the costed graph's price and route of every producer's output from each placement its
    strategies produce to each its readers' strategies take are :func:`reshard_route`'s and :func:`route_time_s`'s, and two
    producers of the same shape and dtype (the first linear's output and the GELU's) share one priced entry."""
    from autotp.passes.costing import reshard_route, route_time_s

    _, costed = _costed_mlp(3)
    graph = costed.graph
    taken: dict[str, set] = {}  # producer -> the placements its readers' strategies take it in
    for edge in graph.edges:
        taken.setdefault(edge.producer, set()).update(s.inputs[edge.slot] for s in graph.strategies[edge.consumer])
    asked = 0
    for name, places in taken.items():
        value = graph.nodes[name].meta.get("val")
        for src in {s.output for s in graph.strategies[name]}:
            for dst in places:
                route = reshard_route(src, dst, value, graph.world_size, costed.hardware)
                assert costed.reshard_route(name, src, dst) == route, (name, src, dst)
                assert costed.reshard_s(name, src, dst) == route_time_s(route, value, graph.world_size, costed.hardware)
                asked += 1
    assert 0 < len(costed._routes) < asked, f"{len(costed._routes)} priced entries for {asked} asks"
    shapes = [costed._value_keys[name] for name in graph.order if name in costed._value_keys]
    assert len(set(shapes)) < len(shapes), f"no two producers share a shape: {shapes}"
