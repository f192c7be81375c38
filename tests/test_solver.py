"""Tier (a): the MILP solver is exact — its optimum equals brute-force enumeration on small graphs."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from autotp.base.errors import PlanError
from autotp.capture.tracing import capture
from autotp.cost_model import get_hardware
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.pricing import price_choice
from autotp.passes.solver import evaluate_choice, min_parameter_bytes, solve
from autotp.passes.strategies import build_strategy_graph


class TwoLayerMLP(torch.nn.Module):
    def __init__(self, hidden: int = 256, inner: int = 1024) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _costed(world_size: int, hardware: str, tokens: int):
    captured = capture(TwoLayerMLP(), (torch.randn(tokens, 256),))
    graph = build_strategy_graph(captured.graph_module, world_size, captured.parameter_fqns())
    assert len(graph.order) <= 12, f"brute force needs a small graph, got {len(graph.order)} nodes"
    return cost_strategy_graph(graph, get_hardware(hardware))


def _brute_force(costed, budget: float | None) -> float:
    names = costed.graph.order
    best = float("inf")
    for combo in itertools.product(*(range(len(costed.graph.strategies[n])) for n in names)):
        choice = dict(zip(names, combo))
        if budget is not None:
            used = sum(costed.memory_bytes[n][choice[n]] for n in costed.memory_bytes)
            if used > budget:
                continue
        cost = evaluate_choice(costed, choice)
        if cost is not None:
            best = min(best, cost)
    return best


@pytest.mark.parametrize("world_size,hardware,tokens,budget_fraction", [
    (2, "h100-sxm", 4096, None),
    (4, "pcie-gpu", 1, None),
    (3, "h100-sxm", 64, 0.5),
    (4, "a100-sxm", 512, 0.3),
])
def test_milp_optimum_equals_brute_force(world_size: int, hardware: str, tokens: int, budget_fraction) -> None:
    """tp=2..4, MLP of 7 nodes: MILP objective == min over every combination of strategies."""
    costed = _costed(world_size, hardware, tokens)
    total = sum(per[0] for per in costed.memory_bytes.values())
    budget = None if budget_fraction is None else total * budget_fraction
    solution = solve(costed, memory_budget_bytes=budget)
    expected = _brute_force(costed, budget)
    got = evaluate_choice(costed, solution.choice)
    assert got is not None, "solver returned an invalid choice"
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12), f"MILP {got} vs brute force {expected}"
    assert solution.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("per_compute,sync_s,tokens,range_s", [
    (0.2, 0.0, 4096, 0.0), (0.5, 1e-5, 2048, 0.0), (0.8, 1e-5, 512, 0.0), (0.8, 1e-5, 512, 1e-6),
    (1.5, 0.0, 2048, 1e-4)])
def test_milp_prices_the_wait_per_second_of_compute_like_brute_force(per_compute: float, sync_s: float,
                                                                     tokens: int, range_s: float) -> None:
    """tp=2, MLP of 7 nodes, cpu-gloo with a call sync wait of ``sync_s`` plus ``per_compute`` s per s of compute
    (a product of "any collective" and the compute, one column per strategy), that compute counted up to
    ``range_s`` where set (one more column, the bound's price): MILP objective == brute force. At 4096
    and 2048 tokens the best plan splits and pays the wait; at 512 it keeps the MLP whole, where a solver
    blind to the per-compute term splits it."""
    captured = capture(TwoLayerMLP(), (torch.randn(tokens, 256),))
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), call_sync_wait_s=sync_s,
                                   call_sync_wait_per_compute=per_compute, call_sync_wait_compute_range_s=range_s)
    costed = cost_strategy_graph(graph, hardware)
    solution = solve(costed, memory_budget_bytes=None)
    expected = _brute_force(costed, None)
    assert evaluate_choice(costed, solution.choice) == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert solution.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("tokens,fraction", [(64, 0.5), (512, 0.1), (2048, 0.1), (2048, 0.5), (2048, 0.9)])
def test_milp_prices_compute_beyond_the_core_share_range_like_brute_force(tokens: int, fraction: float) -> None:
    """tp=2, MLP of 7 nodes, cpu-gloo at a core share of 0.25 up to a range of compute (``fraction`` of the plan's
    compute without a range) and the fair 0.5 beyond, with the wait per second of compute too (both hold the
    minimum of two lines with one column per strategy): MILP objective == brute force. At 2048 tokens the range
    moves the plan (the whole MLP's compute costs less beyond the range), so its price reaches the decision."""
    captured = capture(TwoLayerMLP(), (torch.randn(tokens, 256),))
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    base = dataclasses.replace(get_hardware("cpu-gloo"), call_sync_wait_s=1e-5, call_sync_wait_per_compute=0.5)
    unbounded = cost_strategy_graph(graph, base)
    before = solve(unbounded, memory_budget_bytes=None)
    range_s = fraction * price_choice(unbounded, before.choice).compute_s
    costed = cost_strategy_graph(graph, dataclasses.replace(base, core_share=0.25, fair_core_share=0.5,
                                                            core_share_range_s=range_s))
    solution = solve(costed, memory_budget_bytes=None)
    expected = _brute_force(costed, None)
    assert evaluate_choice(costed, solution.choice) == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert solution.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert expected < before.objective_s  # the compute beyond the range is cheaper at the fair share
    assert (solution.choice != before.choice) == (tokens == 2048)


def test_solver_is_deterministic() -> None:
    """tp=4: the same model and settings give the same choice twice."""
    a = solve(_costed(4, "h100-sxm", 256), memory_budget_bytes=None)
    b = solve(_costed(4, "h100-sxm", 256), memory_budget_bytes=None)
    assert a.choice == b.choice


def test_infeasible_budget_names_the_minimum() -> None:
    """tp=2: a budget below the fully split parameter bytes is refused with the bytes that would fit."""
    costed = _costed(2, "h100-sxm", 16)
    floor = min_parameter_bytes(costed)
    with pytest.raises(PlanError, match="MiB"):
        solve(costed, memory_budget_bytes=floor - 1)
