"""A measured router load (``autotp.measure_expert_load``, ``PlanOptions(expert_load=...)``) on real MoE models.

Tier (a)/(b), no process group: the load measured on the five MoE families transformers ships (random weights from
configs), checked against the router's own choice; the routing formulas against a Monte-Carlo draw (fixed seed);
the load matched to the blocks found in the graph; a skewed load raising the expert-placed form's predicted time
until the planner's pick flips from placed to split.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from models import tiny_mixtral
from zoo_models import ZOO

import autotp
from autotp.capture.tracing import capture
from autotp.cost_model import get_hardware
from autotp.cost_model.routing import (
    busiest_rank_rows,
    busiest_rank_rows_of_shares,
    expected_experts_hit,
    experts_hit_of_shares,
)
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.expert_load import BlockLoad, ExpertLoad, with_expert_load
from autotp.planning.experts import find_expert_blocks, planned_experts


def _mixtral(**kwargs: Any) -> tuple[torch.nn.Module, tuple, dict]:
    return tiny_mixtral(num_heads=4, num_kv_heads=2, hidden=64, intermediate=32, **kwargs)


def _batch(args: tuple, kwargs: dict) -> dict:
    return {"input_ids": args[0], **kwargs}


def _plan(model: torch.nn.Module, args: tuple, kwargs: dict, world_size: int, **options: Any) -> autotp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, args, kwargs, world_size=world_size, options=autotp.PlanOptions(**options))


def test_measured_rows_are_the_routers_choice() -> None:
    """Mixtral, 2 layers of top-2 of 4 experts, two batches: per layer the rows counted for each expert equal the
    bincount of the top-2 of the router logits the model itself returns (``output_router_logits``), and the top-k
    is 2."""
    model, args, kwargs = _mixtral()
    model.eval()
    second = (torch.randint(0, model.config.vocab_size, args[0].shape, generator=torch.Generator().manual_seed(5)),)
    load = autotp.measure_expert_load(model, [_batch(args, kwargs), _batch(second, kwargs)])
    assert load.batches == 2 and len(load.blocks) == 2, load
    expected = [torch.zeros(4, dtype=torch.long) for _ in range(2)]
    with torch.no_grad():
        for ids in (args[0], second[0]):
            logits = model(ids, use_cache=False, output_router_logits=True).router_logits
            for layer, layer_logits in enumerate(logits):
                expected[layer] += torch.bincount(layer_logits.topk(2, dim=-1).indices.flatten(), minlength=4)
    for block, counts in zip(load.blocks, expected):
        assert block.rows == tuple(counts.tolist()), (block.rows, counts.tolist())
        assert block.top_k == 2, block
    assert load.blocks[0].rows != load.blocks[1].rows, "the two layers route alike: the check would not tell them apart"


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_measured_on_every_family(name: str) -> None:
    """Qwen3-MoE, OLMoE, DeepSeek-V3 (group-limited routing, a dense first layer, a shared expert) and GPT-OSS,
    top-2 of 4: every routed block is counted once, with all of its tokens' rows and its top-k, and keyed by its
    gate/up and down expert weights."""
    model, args, kwargs = ZOO[name].build()
    model.eval()
    load = autotp.measure_expert_load(model, [_batch(args, kwargs)])
    tokens = args[0].numel()
    layers = 1 if name == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense (first_k_dense_replace=1)
    assert len(load.blocks) == layers, load
    for block in load.blocks:
        assert sum(block.rows) == 2 * tokens and block.top_k == 2 and len(block.rows) == 4, block
        assert len(block.weights) == 2 and all(".mlp.experts." in w for w in block.weights), block.weights
    again = ExpertLoad.from_json(load.to_json())
    assert again == load


def test_measuring_refuses_what_it_cannot_count() -> None:
    """No batch, weights on the meta device, and a model with no grouped GEMM over expert weights (Mixtral run by
    ``batched_mm``): each a ValueError that says what to do."""
    model, args, kwargs = _mixtral(layers=1)
    with pytest.raises(ValueError, match="at least one batch"):
        autotp.measure_expert_load(model, [])
    with pytest.raises(ValueError, match="meta device"):
        autotp.measure_expert_load(model.to("meta"), [_batch(args, kwargs)])
    batched, args, kwargs = _mixtral(layers=1, experts_implementation="batched_mm")
    with pytest.raises(ValueError, match="grouped_mm"):
        autotp.measure_expert_load(batched, [_batch(args, kwargs)])


def _gumbel_top_k(logits: torch.Tensor, tokens: int, top_k: int, trials: int, seed: int) -> torch.Tensor:
    """``(trials, tokens, top_k)`` distinct experts per token: the top-k of the logits plus Gumbel noise (a skewed
    router's draw without replacement)."""
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(trials, tokens, logits.numel(), generator=generator).clamp_min(1e-12)
    return (logits - torch.log(-torch.log(uniform))).topk(top_k, dim=-1).indices


FAVOURITES_FIRST = (2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5)
"""Router logits whose favourite experts sit on the first ranks: one rank is the busiest in every draw."""
INTERLEAVED = (1.5, -1.5, 1.0, -1.0, 1.5, -1.5, 1.0, -1.0)
"""Favourites spread over the ranks: the ranks' rows are alike on average, the busiest is the largest draw."""


@pytest.mark.parametrize("logits,tokens,ranks", [(FAVOURITES_FIRST, 64, 2), (FAVOURITES_FIRST, 64, 4),
                                                 (FAVOURITES_FIRST, 8, 4), (INTERLEAVED, 16, 2),
                                                 (INTERLEAVED, 16, 4)])
def test_routing_formulas_against_monte_carlo(logits: tuple[float, ...], tokens: int, ranks: int) -> None:
    """Top-2 of 8 experts drawn from skewed logits (Gumbel top-k, seed 0, 4000 draws of ``tokens`` tokens): with the
    shares measured from the draws, the experts hit and the busiest rank's rows (rank r holding experts 2r, 2r+1 at
    4 ranks, 4r..4r+3 at 2) are within 6% of the draws' means, where the uniform formulas miss by more."""
    experts, top_k, trials = 8, 2, 4000
    picks = _gumbel_top_k(torch.tensor(logits), tokens, top_k, trials, seed=0)  # (trials, tokens, k)
    counts = torch.nn.functional.one_hot(picks, experts).sum(dim=(1, 2))  # (trials, E): rows per expert
    shares = tuple((counts.sum(0) / counts.sum()).tolist())
    held = experts // ranks
    per_rank = counts.view(trials, ranks, held).sum(-1)  # (trials, ranks)
    drawn_busiest = per_rank.max(-1).values.double().mean().item()
    drawn_hit = (counts > 0).sum(-1).double().mean().item()
    predicted_busiest = busiest_rank_rows_of_shares(tokens, top_k, shares, [held] * ranks)
    predicted_hit = experts_hit_of_shares(tokens, top_k, shares)
    assert abs(predicted_busiest - drawn_busiest) <= 0.06 * drawn_busiest, (predicted_busiest, drawn_busiest)
    assert abs(predicted_hit - drawn_hit) <= 0.06 * drawn_hit, (predicted_hit, drawn_hit)
    uniform_busiest = busiest_rank_rows(tokens, top_k, experts, held, ranks)
    uniform_hit = expected_experts_hit(tokens, top_k, experts)
    assert (abs(uniform_busiest - drawn_busiest) > 0.06 * drawn_busiest
            or abs(uniform_hit - drawn_hit) > 0.06 * drawn_hit), (uniform_busiest, uniform_hit, "skew too weak")


def test_even_shares_give_the_uniform_formulas() -> None:
    """Equal shares over equal ranks: the measured-router formulas give the uniform router's numbers (Royston's
    table at 2, 4 and 8 ranks; experts hit exactly)."""
    for tokens, experts, ranks in [(1, 8, 2), (64, 8, 4), (64, 8, 8), (3, 16, 4)]:
        even = (1 / experts,) * experts
        held = experts // ranks
        uniform = busiest_rank_rows(tokens, 2, experts, held, ranks)
        measured = busiest_rank_rows_of_shares(tokens, 2, even, [held] * ranks)
        assert abs(measured - uniform) < 1e-3 * uniform, (tokens, experts, ranks, measured, uniform)
        assert abs(experts_hit_of_shares(tokens, 2, even) - expected_experts_hit(tokens, 2, experts)) < 1e-9


def test_load_matched_to_the_graph_and_refused_for_another_model(tmp_path: Any) -> None:
    """tp=2, Mixtral, 1 layer: the measured block is keyed by the expert weights the planner finds in the captured
    graph, and a load saved and passed by path reaches the block's two grouped GEMMs; an even load
    predicts what no load does (the uniform default, to rounding); a load of another model, or of another number of
    experts, is a PlanError that says to measure on this model."""
    model, args, kwargs = _mixtral(layers=1)
    load = autotp.measure_expert_load(model.eval(), [_batch(args, kwargs)])
    path = tmp_path / "load.json"
    load.save(path)
    options = autotp.PlanOptions(expert_load=str(path))
    assert options.expert_load == load
    captured = capture(model, args, kwargs)
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    found = [sorted(graph.parameters[w] for w in block.weights) for block in find_expert_blocks(graph)]
    assert [sorted(block.weights) for block in load.blocks] == found, (load.blocks, found)
    attached = with_expert_load(graph, options.expert_load)
    gemms = find_expert_blocks(graph)[0].gemms
    assert set(attached.expert_shares) == set(gemms) and attached.expert_shares[gemms[0]] == load.blocks[0].shares

    def plan(**options: Any) -> autotp.Plan:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autotp.plan_graph(captured, autotp.PlanOptions(world_size=2, **options))

    weights = load.blocks[0].weights
    even = ExpertLoad((BlockLoad(weights, (5, 5, 5, 5), 2),))
    with_even, default = plan(experts="placed", expert_load=even), plan(experts="placed")
    assert with_even.predicted_time_s == pytest.approx(default.predicted_time_s, rel=1e-9), (with_even, default)
    other = ExpertLoad((BlockLoad(("model.layers.9.block.w",), (1, 2, 3, 4), 2),))
    with pytest.raises(autotp.PlanError, match="names none of this model"):
        plan(expert_load=other)
    wider = ExpertLoad((BlockLoad(weights, (1,) * 8, 2),))
    with pytest.raises(autotp.PlanError, match="counts 8 experts"):
        plan(expert_load=wider)
    with pytest.raises(TypeError, match="ExpertLoad"):
        autotp.PlanOptions(expert_load={"rows": [1, 2]})


def test_skewed_load_flips_placed_to_split() -> None:
    """tp=4, one Mixtral layer of top-2 of 16 experts (hidden 512, 512 tokens), priced on the CPU profile with a
    host dispatch of 20 us a kernel, where the expert-placed form's fewer Python-loop GEMMs win under a uniform
    router: with three quarters of the rows routed to rank 0's four experts (9 rows to each of them for 1 to each
    other expert) the placed form's predicted time rises (that rank does three times the mean rows), the split
    form's does not move (every expert is still hit), and the planner picks split; the plan's text, ``explain`` and
    its JSON say the block was priced for the measured load (busiest expert 9 rows, the mean 3)."""
    model, args, kwargs = tiny_mixtral(num_heads=4, num_kv_heads=2, hidden=512, intermediate=512, layers=1,
                                       experts=16, batch=1, seq_len=512, device="meta")
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), host_dispatch_s=20e-6)
    prefix = "model.layers.0.mlp.experts."
    skewed = ExpertLoad((BlockLoad((prefix + "gate_up_proj", prefix + "down_proj"), (9,) * 4 + (1,) * 12, 2),))
    captured = capture(model, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uniform, skew = (autotp.plan_graph(captured, autotp.PlanOptions(world_size=4, hardware=hardware,
                                                                         memory_budget=None, expert_load=load))
                         for load in (None, skewed))
    before, after = dict(uniform.expert_form_times), dict(skew.expert_form_times)
    assert [b.form for b in planned_experts(uniform.nodes, 4)] == ["placed"], before  # the case can flip
    assert after["placed"] > before["placed"] * 1.05, (before, after)
    assert after["split"] == pytest.approx(before["split"], rel=1e-3), (before, after)
    assert [b.form for b in planned_experts(skew.nodes, 4)] == ["split"], after
    assert skew.expert_load_imbalance == (("model.layers.0.mlp.experts", 3.0),) and not uniform.expert_load_imbalance
    assert "busiest expert 3.00x the mean rows" in str(skew), str(skew)
    assert "load: priced for the measured router load" in autotp.explain(skew, "model.layers.0.mlp.experts")
    assert autotp.Plan.from_json(skew.to_json()).expert_load_imbalance == skew.expert_load_imbalance


def test_ranks_compare_the_load_they_plan_with() -> None:
    """No process group: the options every rank of a compile agrees on name the load (a hash of its JSON), so
    ranks that measured different loads fail their agreement by name; without a load the record is as before."""
    from autotp.runtime.agreement.exchanges import agreed_options

    weights = ("model.layers.0.mlp.experts.gate_up_proj",)
    one, other = (ExpertLoad((BlockLoad(weights, rows, 2),)) for rows in ((3, 1, 1, 1), (1, 3, 1, 1)))
    first, second = (agreed_options(autotp.PlanOptions(world_size=2, expert_load=load)) for load in (one, other))
    assert first["expert_load"] != second["expert_load"], (first, second)
    assert agreed_options(autotp.PlanOptions(world_size=2, expert_load=one))["expert_load"] == first["expert_load"]
    assert "expert_load" not in agreed_options(autotp.PlanOptions(world_size=2))
