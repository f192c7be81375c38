"""Training plans: forward and backward priced together, training memory counted.

All planning only: no process group, tiny models (an MLP of hidden 32).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autotp
from autotp.base.placements import Partial, Replicate, Shard
from autotp.base.reshard import ReshardKind, reshard_routes
from autotp.base.strategy import Strategy
from autotp.capture.tracing import capture
from autotp.passes.backward import Training, adjoint_steps, reads_through_f
from autotp.passes.costing import cost_strategy_graph
from autotp.passes.pricing import price_choice
from autotp.passes.solver import solve
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.options import PlanOptions
from autotp.planning.plan import Plan
from autotp.planning.planner import auto_memory_budget, plan_graph
from tests.models import tiny_mlp

HIDDEN, INTERMEDIATE, BATCH, SEQ = 32, 64, 2, 16
FP32 = 4


@pytest.fixture(scope="module")
def mlp():
    return tiny_mlp(hidden=HIDDEN, intermediate=INTERMEDIATE)


@pytest.fixture(scope="module")
def captured(mlp):
    """The MLP's graph, captured once for the tests that plan it several ways."""
    model, args, _ = mlp
    return capture(model, args)


@pytest.fixture(scope="module")
def plans(mlp, captured):
    """tp=2: the inference plan and the training plan of the same MLP (default "auto" budget)."""
    model, args, _ = mlp
    return plan_graph(captured, PlanOptions(world_size=2)), autotp.plan(model, args, world_size=2, options=autotp.PlanOptions(training=True))


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
    # backward: x needs no gradient (no f), the forward all-reduce's adjoint is the identity (g), and
    # the replicated second bias, added on rank 0 only (zero-fill), gets the whole gradient back: none
    assert training.collective_counts(backward=True) == {}, training.collective_counts(backward=True)
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
    estimate = autotp.estimate(training)
    assert estimate.time_s == pytest.approx(training.predicted_time_s), (estimate.time_s, training.predicted_time_s)
    assert "time per training step (forward + backward)" in estimate.summary(), estimate.summary()


def test_training_plan_differs_and_print_shows_it(captured):
    """tp=2, MLP, memory_budget=60 KiB per rank: a forward keeps the weights whole (16 KiB, no
    collective), a training step cannot (weights + gradients + AdamW state + activations whole:
    ~85 KiB), so the training plan splits, and print(plan) names each parameter that differs."""
    budget = 60 * 1024
    inference = plan_graph(captured, PlanOptions(world_size=2, memory_budget=budget))
    training = plan_graph(captured, PlanOptions(world_size=2, memory_budget=budget, training=True))
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


def test_optimizer_states_option(captured):
    """tp=2, MLP: optimizer_states=0 (plain SGD) holds no optimizer state; a bad value says what to pass."""
    sgd = plan_graph(captured, PlanOptions(world_size=2, training=True, optimizer_states=0))
    assert sgd.optimizer_bytes_per_rank == 0, sgd.optimizer_bytes_per_rank
    with pytest.raises(ValueError, match="optimizer_states=2 for AdamW"):
        PlanOptions(world_size=2, training=True, optimizer_states=-1)


def test_solver_objective_is_the_training_price():
    """tp=2, two MLPs in a row (Linear 32->64->32 twice), the "auto" budget: the MILP's objective
    (forward + backward) equals price_choice of its answer, and the second MLP's input, which
    needs a gradient, is read through Megatron's f: one all-reduce in the backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, INTERMEDIATE), torch.nn.GELU(), torch.nn.Linear(INTERMEDIATE, HIDDEN),
                                torch.nn.Linear(HIDDEN, INTERMEDIATE), torch.nn.GELU(), torch.nn.Linear(INTERMEDIATE, HIDDEN))
    captured = capture(model, (torch.randn(BATCH, SEQ, HIDDEN),))
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    costed = cost_strategy_graph(graph, PlanOptions(world_size=2).hardware_profile, Training.of(graph))
    solution = solve(costed, memory_budget_bytes=auto_memory_budget(costed), count_activations=False)
    price = price_choice(costed, solution.choice)
    assert price.total_s == pytest.approx(solution.objective_s, rel=1e-6), (price.total_s, solution.objective_s)
    back = [(r.producer, [s.kind for s in r.route]) for r in price.backward]
    assert back == [("linear_1", [ReshardKind.ALL_REDUCE])], f"expected f's all-reduce on linear_1's gradient, got {back}"


def test_adjoint_steps_follow_the_runtime_convention():
    """No mesh: the backward of each forward step, as passes/backward.py prices it (the runtime's
    gradient convention: all-reduce <-> identity, all-gather <-> slice, slice and reduce-scatter
    <-> all-gather, all-to-all <-> all-to-all), and Megatron's f for a replicated input of
    rank-divergent work only."""
    cases = {
        (Partial(), Replicate()): [],
        (Replicate(), Partial()): [],
        (Shard(0), Replicate()): [ReshardKind.SLICE],
        (Replicate(), Shard(1)): [ReshardKind.ALL_GATHER],
        (Partial(), Shard(0)): [ReshardKind.ALL_GATHER],
        (Shard(0), Shard(1)): [ReshardKind.ALL_TO_ALL],
    }
    for (src, dst), expected in cases.items():
        back = adjoint_steps(reshard_routes(src, dst)[0])
        assert [s.kind for s in back] == expected, f"adjoint of {src}->{dst}: expected {expected}, got {back}"
    a2a = adjoint_steps(reshard_routes(Shard(0), Shard(1))[0])[0]
    assert (a2a.dim, a2a.to_dim) == (1, 0), f"the all-to-all goes back S(1)->S(0), got {a2a}"
    column = Strategy((Replicate(), Shard(0)), Shard(2))  # x (R) @ W^T split by output features
    replicated = Strategy((Replicate(), Replicate()), Replicate())
    assert reads_through_f(column, 0) and not reads_through_f(column, 1), "f on the replicated input only"
    assert not reads_through_f(replicated, 0), "replicated work returns the whole gradient: no f"


def test_frozen_parameters_and_one_rank():
    """tp=1, Linear(8, 8) -> Linear(8, 8) with the first weight frozen: no collective forward or
    backward; the frozen weight holds no gradient and no optimizer state."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    plan = autotp.plan(model, (torch.randn(2, 8),), world_size=1, options=autotp.PlanOptions(training=True))
    assert plan.collective_counts() == {} and plan.collective_counts(backward=True) == {}, plan.backward_collectives
    trainable = FP32 * (8 + 8 * 8 + 8)  # both biases and the second weight
    assert plan.gradient_bytes_per_rank == trainable, f"gradients: expected {trainable}, got {plan.gradient_bytes_per_rank}"
    assert plan.optimizer_bytes_per_rank == 2 * trainable, (plan.optimizer_bytes_per_rank, 2 * trainable)


def test_activation_checkpointing_of_blocks_is_priced():
    """tp=2, two blocks Sequential(Linear(32, 64), GELU, Linear(64, 32)) under Megatron's plan: with
    activation_checkpointing="blocks" the plan keeps the two blocks' inputs (2 x 2*16*32 fp32, replicated)
    plus one block's own saved values (GELU's input and output, column-split: 2 x 2*16*32 fp32 per rank)
    instead of every block's (24 KiB -> 16 KiB, by hand), and the step costs the blocks' forward again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(HIDDEN, INTERMEDIATE), torch.nn.GELU(),
                                                      torch.nn.Linear(INTERMEDIATE, HIDDEN)) for _ in range(2)])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    plain = autotp.plan(model, (x,), world_size=2, options=autotp.PlanOptions(training=True))
    blocks = autotp.plan(model, (x,), world_size=2,
                         options=autotp.PlanOptions(training=True, activation_checkpointing="blocks"))
    megatron = {f"{i}.{j}.weight": p for i in (0, 1) for j, p in ((0, "S(0)"), (2, "S(1)"))}
    assert {k: blocks.parameters[k] for k in megatron} == megatron, f"not Megatron's plan: {dict(blocks.parameters)}"
    activation = BATCH * SEQ * HIDDEN * FP32  # one (2, 16, 32) fp32 tensor, or a (2, 16, 64) one split in two
    assert plain.activation_bytes_per_rank == 6 * activation, (
        f"without checkpointing: {plain.activation_bytes_per_rank} B kept, expected {6 * activation}")
    assert blocks.activation_bytes_per_rank == 4 * activation, (
        f"blocks checkpointed: {blocks.activation_bytes_per_rank} B kept, expected {4 * activation}")
    assert blocks.predicted_compute_s > plain.predicted_compute_s and blocks.predicted_comm_s > plain.predicted_comm_s, (
        f"recomputation not priced: compute {blocks.predicted_compute_s} vs {plain.predicted_compute_s}, "
        f"communication {blocks.predicted_comm_s} vs {plain.predicted_comm_s}")
    assert "blocks checkpointed" in str(blocks) and blocks.activation_checkpointing == "blocks"
    assert Plan.from_json(blocks.to_json()).activation_checkpointing == "blocks"
    with pytest.raises(ValueError, match="training=True"):
        autotp.plan(model, (x,), world_size=2, options=autotp.PlanOptions(activation_checkpointing="blocks"))


def test_split_dropout_plan_gathers_less():
    """tp=2, GPT-2 (2 layers, hidden 48, 4 heads) in training mode with dropout 0.1, captured for training
    (the dropouts kept): by default attention with dropout runs whole on every rank (its q/k/v gathered);
    dropout="split" (per-rank streams) keeps it split by heads: fewer all-gathers, a cheaper predicted step."""
    from tests.models import tiny_gpt2

    model, (ids,), _ = tiny_gpt2(num_heads=4, hidden=48, layers=2, vocab_size=96, seq_len=8)
    captured = capture(model.train(), (ids,), {"labels": ids}, training=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's ops without a rule run replicated in both plans
        plans = {d: plan_graph(captured, PlanOptions(world_size=2, training=True, dropout=d))
                 for d in ("replicated", "split")}
    gathers = {d: p.collective_counts().get("all_gather", 0) for d, p in plans.items()}
    assert gathers["split"] < gathers["replicated"], f"all-gathers per forward: {gathers}"
    assert plans["split"].predicted_time_s < plans["replicated"].predicted_time_s, (
        f"predicted step: split {plans['split'].predicted_time_s}, replicated {plans['replicated'].predicted_time_s}")
