"""Tier (a)/(b): PlanOptions validation, and plan_graph as the one planner behind plan() and the Megatron reference."""

from __future__ import annotations

import pytest
from models import tiny_mlp

import autotp
from autotp.capture.tracing import capture
from autotp.cli import main as cli
from autotp.cost_model import Hardware
from autotp.planning.megatron import pin_gemm_weights
from autotp.planning.options import PlanOptions


@pytest.mark.parametrize(("options", "message"), [
    ({"world_size": 0}, "world_size must be >= 1"),
    ({"world_size": 2.0}, "world_size must be an int"),
    ({"world_size": 2, "hardware": "h100"}, "unknown hardware 'h100'; known profiles"),
    ({"world_size": 2, "memory_budget": -1}, "memory_budget must be 'auto', None"),
    ({"world_size": 2, "memory_budget": "lots"}, "memory_budget must be 'auto', None"),
    ({"world_size": 2, "time_limit_s": 0}, "time_limit_s must be a positive number"),
    ({"world_size": 2, "constraints": {"*.weight": "S(x)"}}, "is not a placement"),
    ({"world_size": 2, "expert_load": "no/such/expert_load.json"}, "cannot read expert load"),
])
def test_bad_options_fail_where_built(options: dict, message: str) -> None:
    """No mesh: each bad option is a ValueError when PlanOptions is built, before any tracing."""
    with pytest.raises(ValueError) as info:
        PlanOptions(**options)
    assert message in str(info.value), f"expected {message!r} in the error, got: {info.value}"


def test_options_are_normalised_and_frozen() -> None:
    """No mesh: hardware is resolved to a profile, constraints to placement text; options cannot change."""
    options = PlanOptions(world_size=3, hardware="h100-sxm", memory_budget=1024,
                          constraints={"0.weight": autotp.Replicate()})
    assert isinstance(options.hardware, Hardware) and options.hardware.name == "h100-sxm", options.hardware
    assert options.memory_budget == 1024.0 and isinstance(options.memory_budget, float), options.memory_budget
    assert options.constraints == {"0.weight": "R"}, options.constraints
    with pytest.raises(AttributeError):
        options.world_size = 4  # type: ignore[misc]


def test_plan_graph_is_what_plan_returns() -> None:
    """tp=3, tiny MLP (uneven split of 1024 features): plan() and plan_graph() on the same graph agree."""
    model, args, _ = tiny_mlp(device="meta")
    via_plan = autotp.plan(model, args, world_size=3)
    captured = capture(model, tuple(a.to("meta") for a in args))
    via_graph = autotp.plan_graph(captured, PlanOptions(world_size=3))
    assert via_graph.parameters == via_plan.parameters, f"expected {via_plan.parameters}, got {via_graph.parameters}"
    assert via_graph.predicted_time_s == via_plan.predicted_time_s, (via_plan.predicted_time_s, via_graph.predicted_time_s)


def test_strategy_filter_narrows_the_choice() -> None:
    """tp=2, tiny MLP (no residual add, so the Megatron filter reads both GEMMs as column-parallel): the
    filter's pinning wins over the solver's own choice (column then row) for the second weight."""
    model, args, _ = tiny_mlp(device="meta")
    captured = capture(model, tuple(a.to("meta") for a in args))
    free = autotp.plan_graph(captured, PlanOptions(world_size=2))
    pinned = autotp.plan_graph(captured, PlanOptions(world_size=2, strategy_filter=pin_gemm_weights))
    got = {fqn: (free.parameters[fqn], pinned.parameters[fqn]) for fqn in ("0.weight", "2.weight")}
    expected = {"0.weight": ("S(0)", "S(0)"), "2.weight": ("S(1)", "S(0)")}
    assert got == expected, f"(free, pinned) placements: expected {expected}, got {got}"


def test_cli_rejects_a_bad_memory_budget_before_tracing(capsys) -> None:
    """No mesh: `autotp plan tiny-llama --memory-budget 0` exits 2 with what to pass, and traces nothing."""
    code = cli.main(["plan", "tiny-llama", "--world-size", "2", "--memory-budget", "0"])
    err = capsys.readouterr().err
    assert code == 2, f"expected exit code 2, got {code}; stderr:\n{err}"
    assert "memory_budget must be 'auto', None" in err, err
    assert "traced" not in err, f"tracing ran before the option was checked:\n{err}"


def test_strategy_filter_may_only_narrow() -> None:
    """tp=2, tiny MLP: a filter that leaves a node with no candidate is a PlanError naming the node."""
    import dataclasses

    from autotp.base.errors import PlanError

    def drop_all(graph):
        first = graph.order[0]
        return dataclasses.replace(graph, strategies={**graph.strategies, first: []})

    model, args, _ = tiny_mlp(device="meta")
    captured = capture(model, tuple(a.to("meta") for a in args))
    with pytest.raises(PlanError, match="must only narrow") as info:
        autotp.plan_graph(captured, PlanOptions(world_size=2, strategy_filter=drop_all))
    assert "no candidate strategy left" in str(info.value), str(info.value)
