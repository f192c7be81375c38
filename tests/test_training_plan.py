"""Training plans (issue 15, item 2): forward and backward priced together, training memory counted.

All planning only: no process group, tiny models (an MLP of hidden 32).
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.base.placements import Partial, Replicate, Shard
from autotp.base.reshard import ReshardKind, reshard_routes
from autotp.capture import capture
from autotp.passes.backward import Training, arriving_grad_placement, output_grad_placement
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.pricing import price_choice
from autotp.passes.resharding import RESHARD_TABLE
from autotp.passes.solver import solve
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan
from autotp.planning.planner import auto_memory_budget
from tests.models import tiny_mlp

HIDDEN, INTERMEDIATE, BATCH, SEQ = 32, 64, 2, 16
FP32 = 4


@pytest.fixture(scope="module")
def mlp():
    return tiny_mlp(hidden=HIDDEN, intermediate=INTERMEDIATE)


@pytest.fixture(scope="module")
def plans(mlp):
    """tp=2: the inference plan and the training plan of the same MLP (default "auto" budget)."""
    model, args, _ = mlp
    return autotp.plan(model, args, world_size=2), autotp.plan(model, args, world_size=2, training=True)


def test_training_plan_costs_more_and_counts_activations(plans):
    """tp=2, MLP Linear(32, 64) -> GELU -> Linear(64, 32): the training step is dearer than the
    forward, its backward has the adjoint collectives, and memory counts gradients, AdamW state and
    the activations kept for the backward, by hand."""
    inference, training = plans
    assert training.training and not inference.training
    assert training.predicted_time_s > inference.predicted_time_s, (
        f"expected a training step to cost more than a forward: {training.predicted_time_s} vs "
        f"{inference.predicted_time_s}")
    assert training.predicted_compute_s > 2 * inference.predicted_compute_s * 0.99, (
        f"expected backward compute ~>= forward: {training.predicted_compute_s} vs {inference.predicted_compute_s}")
    # Megatron's MLP: column- then row-parallel, one all-reduce each way
    assert training.parameters["0.weight"] == "S(0)" and training.parameters["2.weight"] == "S(1)", training.parameters
    assert training.collective_counts() == {"all_reduce": 1}, training.collective_counts()
    assert training.collective_counts(backward=True) == {"all_reduce": 1}, training.collective_counts(backward=True)
    # activations by hand: the input x (B, S, 32) is read whole by the first GEMM; GELU keeps its
    # input (B, S, 64) split on the last dim, the second GEMM keeps GELU's output, split alike
    expected = FP32 * (BATCH * SEQ * HIDDEN + 2 * BATCH * SEQ * INTERMEDIATE // 2)
    assert training.activation_bytes_per_rank == expected, (
        f"activation bytes per rank: expected {expected}, got {training.activation_bytes_per_rank}")
    weights = training.parameter_bytes_per_rank
    assert training.gradient_bytes_per_rank == weights, (training.gradient_bytes_per_rank, weights)
    assert training.optimizer_bytes_per_rank == 2 * weights, (
        f"AdamW keeps 2 fp32 values per fp32 weight: expected {2 * weights}, got {training.optimizer_bytes_per_rank}")
    text = str(training)
    assert text.startswith("autotp training plan: tp=2"), text.splitlines()[0]
    assert "predicted training step (forward + backward)" in text, text
    assert f"activations {expected / 1024:.2f} KiB" in text, text
    assert "same parameter placements as the inference plan" in text, text
    loaded = Plan.from_json(training.to_json())
    assert loaded == training, "a training plan must survive a JSON round trip unchanged"


def test_training_plan_differs_and_print_shows_it(mlp):
    """tp=2, MLP, memory_budget=60 KiB per rank: a forward keeps the weights whole (16 KiB, no
    collective), a training step cannot (weights + gradients + AdamW state + activations whole:
    ~85 KiB), so the training plan splits, and print(plan) names each parameter that differs."""
    model, args, _ = mlp
    budget = 60 * 1024
    inference = autotp.plan(model, args, world_size=2, memory_budget=budget)
    training = autotp.plan(model, args, world_size=2, memory_budget=budget, training=True)
    assert set(inference.parameters.values()) == {"R"}, f"expected a replicated forward: {inference.parameters}"
    held = (training.parameter_bytes_per_rank + training.gradient_bytes_per_rank + training.optimizer_bytes_per_rank
            + training.activation_bytes_per_rank)
    assert held <= budget, f"the training plan holds {held} bytes per rank, over the budget {budget}"
    differing = {fqn for fqn, _, _ in training.inference_differences}
    assert {"0.weight", "2.weight"} <= differing, f"expected both GEMM weights to differ, got {differing}"
    text = str(training)
    assert f"differs from the inference plan in {len(differing)} parameter(s)" in text, text
    for fqn, before, after in training.inference_differences:
        assert any(line.split()[:5] == [fqn, "inference", before, "training", after] for line in text.splitlines()), (
            f"print(plan) should show {fqn}: inference {before} -> training {after}:\n{text}")


def test_optimizer_states_option(mlp):
    """tp=2, MLP: optimizer_states=0 (plain SGD) holds no optimizer state; a bad value says what to pass."""
    model, args, _ = mlp
    sgd = autotp.plan(model, args, world_size=2, training=True, optimizer_states=0)
    assert sgd.optimizer_bytes_per_rank == 0, sgd.optimizer_bytes_per_rank
    with pytest.raises(ValueError, match="optimizer_states=2 for AdamW"):
        PlanOptions(world_size=2, training=True, optimizer_states=-1)


def test_solver_objective_is_the_training_price(mlp):
    """tp=2, MLP, the "auto" budget (weights split): the MILP's objective (forward + backward)
    equals price_choice of its answer."""
    model, args, _ = mlp
    captured = capture(model, args)
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    costed = cost_strategy_graph(graph, PlanOptions(world_size=2).hardware_profile, Training.of(graph))
    solution = solve(costed, memory_budget_bytes=auto_memory_budget(costed), count_activations=False)
    price = price_choice(costed, solution.choice)
    assert price.backward, "a training price has backward reshardings"
    assert price.total_s == pytest.approx(solution.objective_s, rel=1e-6), (price.total_s, solution.objective_s)


def test_adjoint_column_matches_the_gradient_placements():
    """No mesh: each forward step's row in RESHARD_TABLE names the step the gradient takes back,
    as the placement rules of passes/backward.py derive it (consumer splitting the work)."""
    cases = {  # forward src -> dst, the gradient the consumer returns
        ReshardKind.ALL_REDUCE: (Partial(), Replicate(), Replicate()),  # g: the next op is replicated
        ReshardKind.ALL_GATHER: (Shard(0), Replicate(), Partial()),  # sequence parallel -> reduce-scatter
        ReshardKind.REDUCE_SCATTER: (Partial(), Shard(0), Shard(0)),
        ReshardKind.ALL_TO_ALL: (Shard(0), Shard(1), Shard(1)),
        ReshardKind.SLICE: (Replicate(), Shard(0), Shard(0)),
        ReshardKind.ZERO: (Replicate(), Partial(), Replicate()),
    }
    for kind, (src, dst, grad) in cases.items():
        forward = reshard_routes(src, dst)[0]
        assert [s.kind for s in forward] == [kind], f"{src}->{dst}: expected one {kind} step, got {forward}"
        arriving = arriving_grad_placement(src, dst, grad)
        needed = output_grad_placement(src)
        back = [s.kind for s in reshard_routes(arriving, needed)[0]] if arriving != needed else []
        expected = RESHARD_TABLE[kind].adjoint
        assert back == ([expected] if expected else []), f"adjoint of {kind}: expected {expected}, got {back}"


def test_one_rank_training_plan_has_no_collectives():
    """tp=1: a training plan of one rank has no collective at all, forward or backward."""
    model = torch.nn.Linear(8, 8)
    plan = autotp.plan(model, (torch.randn(2, 8),), world_size=1, training=True)
    assert plan.collective_counts() == {} and plan.collective_counts(backward=True) == {}, plan.backward_collectives
