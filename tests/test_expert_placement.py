"""Experts placed whole on ranks (``PlanOptions(experts="placed")``), reached by all-to-all
(``experts="dispatched"``) and split, on real MoE models.

Tier (a)/(b): MoE blocks found from the graph, each form forced, the plan's text, refusals, the dispatched form's
placements and prices. Tier (c), real gloo process groups: forward logits equal the single-process model's
(tolerance 1e-4, as tests/test_equivalence.py) and greedy ``generate`` equals ``model.generate`` with each form
forced; the all-to-all grouped GEMM against a product row by row.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from models import tiny_mixtral
from zoo_models import LOOPED_MOE, MORE_MOE, ZOO

import autotp
from autotp.capture.tracing import capture
from autotp.passes.strategies import build_strategy_graph
from autotp.planning.experts import find_expert_blocks, planned_experts
from autotp.planning.options import moved_to_options
from autotp.planning.planner import plan_graph

TOLERANCE = 1e-4


def _mixtral(**kwargs: Any) -> tuple[torch.nn.Module, tuple, dict]:
    return tiny_mixtral(num_heads=4, num_kv_heads=2, hidden=64, intermediate=32, **kwargs)


BUILDERS = {"mixtral": _mixtral, **{name: ZOO[name].build
                                    for name in ("qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "llama4_text",
                                                 "jamba")}}


def _plan(model: torch.nn.Module, args: tuple, kwargs: dict, world_size: int, form: str) -> autotp.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs,
                           options=autotp.PlanOptions(experts=form))


def test_blocks_found_from_the_graph() -> None:
    """Mixtral, 2 layers of top-2 of 4 experts: one block per layer, its two grouped GEMMs routed by the layer's
    top-k and reading the 3-D gate/up and down weights."""
    model, args, kwargs = _mixtral()
    captured = capture(model, args, kwargs)
    graph = build_strategy_graph(captured.graph_module, 2, captured.parameter_fqns())
    blocks = find_expert_blocks(graph)
    assert [b.module for b in blocks] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], blocks
    for block in blocks:
        assert len(block.gemms) == 2 and block.experts == 4, block
        fqns = sorted(graph.parameters[w] for w in block.weights)
        assert [f.rsplit(".", 1)[-1] for f in fqns] == ["down_proj", "gate_up_proj"], fqns


@pytest.mark.parametrize("form,weight", [("placed", "S(0)"), ("split", None)])
def test_each_form_forced(form: str, weight: str | None) -> None:
    """tp=3, Mixtral (4 experts: 2/1/1 per rank when placed): every block takes the forced form, the plan says so,
    and ``explain`` of the block names it."""
    model, args, kwargs = _mixtral(layers=1)
    plan = _plan(model, args, kwargs, 3, form)
    blocks = planned_experts(plan.nodes, plan.world_size)
    assert [b.form for b in blocks] == [form], blocks
    placements = {fqn: p for fqn, p in plan.parameters.items() if ".experts." in fqn}
    if weight is not None:
        assert set(placements.values()) == {weight}, placements
        assert blocks[0].per_rank == (2, 1, 1), blocks
    else:
        assert "S(0)" not in placements.values(), placements
    assert f"experts {form}" in str(plan), str(plan)
    explained = autotp.explain(plan, "model.layers.0.mlp.experts")
    assert f"experts {form}" in explained, explained


@pytest.mark.slow  # a capture and two plans of a 2-layer Llama-4 text: about 18 s of CPU
def test_batched_experts_found_and_forced() -> None:
    """tp=3, Llama-4 text (experts as one ``bmm`` over every token, 4 experts: 2/1/1 per rank when placed, 2 layers):
    one block per layer, its two batched GEMMs routed by that layer's own top-k (not the layer before's, reached
    along the residual stream); each form forced, the plan and ``explain`` say it, and in either form no collective
    but a local slice is issued inside the experts (placed: no gather of the experts' outputs, the down GEMM's
    output is padded to a Partial sum that the block's one all-reduce combines)."""
    model, args, kwargs = BUILDERS["llama4_text"]()
    captured = capture(model, args, kwargs)
    graph = build_strategy_graph(captured.graph_module, 3, captured.parameter_fqns())
    blocks = find_expert_blocks(graph)
    modules = [f"model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert [b.module for b in blocks] == modules, blocks
    assert len({b.router for b in blocks}) == 2 and all(b.batched and b.experts == 4 for b in blocks), blocks
    for block in blocks:
        assert [graph.nodes[g].target for g in block.gemms] == [torch.ops.aten.bmm.default] * 2, block
        router_module = list(graph.nodes[block.router].meta["nn_module_stack"].values())[-1][0]
        assert router_module.startswith(block.module.rsplit(".", 1)[0] + "."), (block.module, router_module)
    for form in ("placed", "split"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_graph(captured, autotp.PlanOptions(world_size=3, experts=form))  # the capture above, once
        planned = planned_experts(plan.nodes, plan.world_size)
        assert [(b.module, b.form) for b in planned] == [(m, form) for m in modules], planned
        weights = {fqn: p for fqn, p in plan.parameters.items() if ".experts." in fqn}
        assert (set(weights.values()) == {"S(0)"}) == (form == "placed"), weights
        assert f"experts {form}" in str(plan), str(plan)
        explained = autotp.explain(plan, modules[0])
        assert f"experts {form}" in explained, explained
        if form == "placed":
            assert planned[0].per_rank == (2, 1, 1), planned
            assert "every token through its own experts" in explained, explained
        inside = [(c.producer, [str(step) for step in c.steps]) for c in plan.collectives
                  if c.module.startswith(tuple(modules)) and any(str(step) != "slice" for step in c.steps)]
        assert not inside, f"experts {form}: collectives inside the experts {inside}"


@pytest.mark.slow  # two captures and plans of a 2-layer GPT-OSS: about 40 s on a loaded 2-core machine
def test_expert_biases_need_no_extra_collective() -> None:
    """tp=2, GPT-OSS (a bias per expert after each grouped GEMM, a gate that is not zero at zero), experts placed:
    no collective between the router and the gate/up GEMM's bias (the bias is looked up on its expert's rank,
    ``P(experts)``; the gate runs on ``L(experts)`` rows) and one all-reduce per block, as with experts split
    (where one all-gather of the interleaved gate/up output comes on top)."""
    model, args, kwargs = BUILDERS["gpt_oss"]()
    for form in ("placed", "split"):
        plan = _plan(model, args, kwargs, 2, form)
        blocks = planned_experts(plan.nodes, plan.world_size)
        assert [b.form for b in blocks] == [form, form], blocks
        for block in blocks:
            inside = [(c.producer, "+".join(map(str, c.steps))) for c in plan.collectives
                      if c.module == block.module and any(str(step) != "slice" for step in c.steps)]
            reduced = [kinds for _, kinds in inside if "all_reduce" in kinds]
            assert len(reduced) <= 1, f"experts {form}, {block.module}: {inside}"
            if form == "placed":
                assert [kinds for _, kinds in inside] in (["all_reduce"], []), f"{block.module}: {inside}"
        decisions = {n.name: n for n in plan.nodes}
        if form == "placed":
            gemms = [decisions[name] for block in blocks for name in block.gemms]
            assert {g.inputs[0] for g in gemms[1::2]} == {"L(experts)"}, [(g.name, g.inputs) for g in gemms]


def test_placed_experts_refused_for_training() -> None:
    """``experts="placed"`` with ``training=True``: a ValueError that says what to pass instead; a training plan
    with ``experts="auto"`` (tp=2, Mixtral) never places experts: no ``P(experts)`` anywhere."""
    with pytest.raises(ValueError, match="experts='split'"):
        autotp.PlanOptions(experts="placed", training=True)
    with pytest.raises(ValueError, match="experts must be one of"):
        autotp.PlanOptions(experts="whole")
    with warnings.catch_warnings():  # the old spelling compile(..., training=True) beside options= placing experts
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="experts='split'"):
            moved_to_options("compile", autotp.PlanOptions(experts="placed"), {"training": True}, taken=("training",))
    model, args, kwargs = _mixtral(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, world_size=2, example_inputs=args, example_kwargs=kwargs,
                           options=autotp.PlanOptions(training=True))
    assert "placed" not in [b.form for b in planned_experts(plan.nodes, 2)], planned_experts(plan.nodes, 2)
    assert not [n.name for n in plan.nodes if "P(experts)" in (n.output, *n.inputs)]


def _forward_forms(rank: int, world_size: int, names: list[str], trace_cache: str) -> dict[str, dict[str, Any]]:
    """Each model compiled with each form, through ``trace_cache`` (the tests' shared directory): the second form,
    and the same model at another world size, rebuild the program traced first (the same program: a trace depends
    on the model and inputs, not on the form or the world size)."""
    results = {}
    for name in names:
        model, args, kwargs = {**BUILDERS, **MORE_MOE}[name]()
        with torch.no_grad():
            expected = model(*args, **kwargs).logits
        for form in ("placed", "split"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                    options=autotp.PlanOptions(experts=form),
                                    runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
            got = tp(*args, **kwargs).logits
            forms = [b.form for b in planned_experts(tp.plan.nodes, world_size)]
            results[f"{name}/{form}"] = {"diff": (got - expected).abs().max().item(), "forms": forms,
                                         "counts": tp.collective_counts(), "scale": expected.abs().max().item()}
    return results


def _check_forward(results: list[dict[str, dict[str, Any]]], world_size: int) -> None:
    for rank, result in enumerate(results):
        for case, got in result.items():
            form = case.split("/")[1]
            assert got["diff"] <= TOLERANCE, f"{case} tp={world_size} rank {rank}: max abs diff {got['diff']:.3g}"
            assert got["forms"] and set(got["forms"]) == {form}, f"{case}: blocks took {got['forms']}"
            assert got["counts"] == results[0][case]["counts"], f"{case}: rank {rank} issues other collectives"


@pytest.mark.parametrize("world_size,names", [(2, ["mixtral", "qwen3_moe", "olmoe", "llama4_text"]),
                                              (3, ["mixtral", "olmoe"]), (4, ["qwen3_moe"])])
def test_forward_equals_single_process(gloo, world_size: int, names: list[str], trace_cache: str) -> None:
    """tp=2, 3 (4 experts: 2/1/1) and 4 (one expert per rank): Mixtral, Qwen3-MoE, OLMoE, Llama-4 text (experts as
    a batched product over every token), experts placed and experts split: logits equal the single-process
    model's on every rank."""
    _check_forward(gloo.run(world_size, _forward_forms, names, trace_cache), world_size)


@pytest.mark.zoo  # the rest of the families and world sizes: minutes of compiles, in the wide-zoo tier beside the zoo
@pytest.mark.parametrize("world_size,names", [(2, ["deepseek_v3"]), (2, ["gpt_oss"]), (3, ["qwen3_moe"]),
                                              (3, ["deepseek_v3"]), (3, ["gpt_oss"]), (3, ["llama4_text"]),
                                              (4, ["mixtral", "olmoe"]), (4, ["deepseek_v3"]), (4, ["gpt_oss"]),
                                              (4, ["llama4_text"])])
def test_forward_equals_single_process_wider(gloo, world_size: int, names: list[str], trace_cache: str) -> None:
    """tp=2..4, the rest of the matrix: DeepSeek-V3 (shared expert planned as a dense MLP, grouped routing),
    GPT-OSS (expert biases looked up on their experts' ranks, the gate on ``L(experts)`` rows), both at 2, 3 (4
    experts: 2/1/1) and 4 (one expert per rank), Llama-4 text at 3 and 4, and the families above at the other world
    sizes; both forms. Each compile of the
    larger zoo models takes about a minute on a loaded 2-core machine, hence the longer timeout."""
    _check_forward(gloo.run(world_size, _forward_forms, names, trace_cache, timeout_s=1500), world_size)


@pytest.mark.zoo  # one family a test: a minute or more of compiles each on a loaded 2-core machine
@pytest.mark.parametrize("name", [*MORE_MOE, "jamba"])
def test_more_families_forward_equals_single_process(gloo, name: str, trace_cache: str) -> None:
    """tp=2, the other MoE families transformers ships (tests/zoo_models.py ``MORE_MOE``: Qwen2-MoE and GLM-4-MoE
    with shared experts, MiniMax beside linear attention, DeepSeek-V2 and GLM-4-MoE-lite with latent
    attention, Phi-MoE's sparse-mixer router (two ``max``, no ``topk``), Granite-MoE, ...; and Jamba, experts every
    other layer of a Mamba hybrid), experts placed and experts split: logits equal the single-process model's on
    every rank, every block in the forced form."""
    results = gloo.run(2, _forward_forms, [name], trace_cache, timeout_s=900)
    for case, got in results[0].items():
        assert got["scale"] > 10 * TOLERANCE, f"{case}: logits too small to compare ({got['scale']:.3g})"
    _check_forward(results, 2)


@pytest.mark.zoo  # with the others of the MoE families
@pytest.mark.slow  # two traces of a 2-layer model each: about 20 s on a loaded 2-core machine
@pytest.mark.parametrize("name,line", [("dbrx", r"modeling_dbrx\.py.*for expert_idx in expert_hit"),
                                       ("jetmoe", r"modeling_jetmoe\.py.*inputs\.split\(expert_size")])
def test_looped_experts_refused(name: str, line: str) -> None:
    """No mesh, DBRX (a Python loop over the experts the router hit) and JetMoE (rows per expert counted on the host,
    then split): each form asked for is refused with a CaptureError naming the model's line and the fix, never a plan
    at sizes that hold for the example batch only."""
    model, args, kwargs = LOOPED_MOE[name]()
    for form in ("placed", "split"):
        with pytest.raises(autotp.CaptureError, match=f"(?s){line}.*(grouped GEMM|torch.where)"):
            _plan(model, args, kwargs, 2, form)


def _greedy(rank: int, world_size: int, name: str, form: str) -> dict[str, Any]:
    model, (ids,), _ = BUILDERS[name]()
    model.generation_config.pad_token_id = 0
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids[:, :1],), max_cache_len=32,  # dispatched: tokens split, static
                            options=autotp.PlanOptions(experts=form, dynamic=form != "dispatched"))
    forms = {b.form for b in planned_experts(tp.plan.nodes, world_size)}
    return {"got": tp.generate(ids, max_new_tokens=6).tolist(), "expected": expected.tolist(), "forms": forms}


@pytest.mark.parametrize("world_size,name,form", [(2, "mixtral", "placed"), (3, "qwen3_moe", "placed"),
                                                  (2, "olmoe", "split"), (2, "llama4_text", "placed"),
                                                  (3, "qwen3_moe", "dispatched")])
def test_greedy_generate_equals_hf(gloo, world_size: int, name: str, form: str) -> None:
    """tp=2 and 3, prefill and decode graphs with the forced form: greedy tokens equal ``model.generate``'s.
    Llama-4 text: batched experts placed, one token per expert batch at decode. Experts dispatched at tp=3: a
    decode step of 2 tokens leaves one rank without a token (it still takes part in every all-to-all, with
    nothing to send)."""
    for rank, result in enumerate(gloo.run(world_size, _greedy, name, form)):
        assert result["forms"] == {form}, f"rank {rank}: blocks took {result['forms']}"
        assert result["got"] == result["expected"], (
            f"rank {rank}: tokens differ\n expected {result['expected']}\n got {result['got']}")


@pytest.mark.zoo  # the rest of the generate matrix: each a prefill and a decode compile of a zoo model
@pytest.mark.parametrize("world_size,name,form", [(2, "mixtral", "split"), (2, "qwen3_moe", "split"),
                                                  (3, "olmoe", "placed"), (2, "deepseek_v3", "placed"),
                                                  (3, "deepseek_v3", "split"), (3, "gpt_oss", "placed"),
                                                  (2, "gpt_oss", "split"), (3, "llama4_text", "split")])
def test_greedy_generate_equals_hf_wider(gloo, world_size: int, name: str, form: str) -> None:
    """tp=2 and 3 (4 experts: 2/1/1 when placed), the cells of the family x form matrix the test above leaves:
    Mixtral, Qwen3-MoE and Llama-4 text split, OLMoE placed, DeepSeek-V3 (latent cache, a shared expert, a dense
    first layer) and GPT-OSS (expert biases, attention sinks) in both forms: greedy tokens equal
    ``model.generate``'s, and the reference generates more than one token (the case can tell)."""
    results = gloo.run(world_size, _greedy, name, form, timeout_s=900)
    new_tokens = {token for row in results[0]["expected"] for token in row[-6:]}  # _greedy's max_new_tokens
    assert len(new_tokens) > 1, f"{name}: the reference generates one token only {results[0]['expected']}"
    for rank, result in enumerate(results):
        assert result["forms"] == {form}, f"{name} rank {rank}: blocks took {result['forms']}"
        assert result["got"] == result["expected"], (
            f"{name} {form} tp={world_size} rank {rank}: tokens differ\n expected {result['expected']}\n got {result['got']}")


def test_routed_load_formulas() -> None:
    """One token, top-2 of 8 experts over 2 ranks of 4: the busier rank gets 1 + 3/7 rows exactly (both experts
    on one rank with probability 3/7), the normal approximation within 0.1; many tokens: the mean share; all
    experts hit once tokens are many, two of them for one token."""
    from autotp.cost_model.routing import busiest_rank_rows, expected_experts_hit

    one_token = busiest_rank_rows(1, 2, 8, 4, 2)
    assert abs(one_token - (1 + 3 / 7)) < 0.1, one_token
    assert busiest_rank_rows(1, 2, 8, 2, 4) <= 2.0  # never more than min(k, held) per token
    many = busiest_rank_rows(4096, 2, 8, 4, 2)
    assert 4096 <= many < 4096 * 1.05, many
    assert expected_experts_hit(1, 2, 8) == 2.0
    assert abs(expected_experts_hit(512, 2, 8) - 8.0) < 1e-9


def test_expert_partial_resharding() -> None:
    """``P(experts)`` reduces like a Partial (all-reduce, reduce-scatter), reads as a Partial for nothing, and
    nothing but an expert-placed op makes it; ``L(experts)`` is ``P(experts)`` or ``R`` for nothing, and nothing
    else turns into it or out of it; their texts round-trip."""
    from autotp.base.placements import ExpertLocal, ExpertPartial, Partial, Replicate, Shard, placement_from_str
    from autotp.base.reshard import reshard_possible, reshard_steps

    local = ExpertLocal()
    assert placement_from_str(str(local)) == local
    assert reshard_steps(ExpertPartial(), local) == () and reshard_steps(Replicate(), local) == ()
    for other in (Partial(), Shard(0), Shard(1)):
        assert not reshard_possible(other, local), other
    for other in (Replicate(), Partial(), ExpertPartial(), Shard(0)):
        assert not reshard_possible(local, other), other
        with pytest.raises(ValueError, match="only an expert-placed op reads"):
            reshard_steps(local, other)

    ep = ExpertPartial()
    assert placement_from_str(str(ep)) == ep
    assert [str(s.kind) for s in reshard_steps(ep, Replicate())] == ["all_reduce"]
    assert [str(s.kind) for s in reshard_steps(ep, Shard(0))] == ["reduce_scatter"]
    assert reshard_steps(ep, Partial()) == ()
    for src in (Partial(), Replicate(), Shard(0)):
        assert not reshard_possible(src, ep)
        with pytest.raises(ValueError, match="only an expert-placed op"):
            reshard_steps(src, ep)


def test_auto_records_both_forms_and_round_trips() -> None:
    """tp=2, Mixtral, ``experts="auto"``: the plan records the predicted time with every block placed and with every
    block split, its form is the cheaper one, ``print(plan)`` gives both, and the JSON form keeps them."""
    model, args, kwargs = _mixtral(layers=1)
    plan = _plan(model, args, kwargs, 2, "auto")
    times = dict(plan.expert_form_times)
    assert set(times) == {"placed", "split"}, plan.expert_form_times
    form = planned_experts(plan.nodes, plan.world_size)[0].form
    assert times[form] == min(times.values()) and times[form] == plan.predicted_time_s, (form, times)
    assert "with experts" in str(plan), str(plan)
    again = autotp.Plan.from_json(plan.to_json())
    assert again.expert_form_times == plan.expert_form_times
    assert [b.form for b in planned_experts(again.nodes, 2)] == [form]


def test_mixed_block_reads_as_mixed() -> None:
    """tp=2, a block whose two grouped GEMMs the solver put in different forms (the gate/up GEMM placed, the down GEMM
    split by its output columns, as ``experts="auto"`` picks for 128 small experts at a 512-token prefill on the CPU
    profile): the plan's text and ``explain`` call it mixed and give the one-form plans' times, never "replicated"
    or "forced"."""
    from autotp.planning.decisions import NodeDecision
    from autotp.planning.experts import expert_lines, explain_experts

    module = "model.layers.0.mlp.experts"
    op = "transformers.grouped_mm_fallback.default"
    nodes = [NodeDecision("x", "placeholder", (), "R", 0.0, input_nodes=(), shape=(64, 32)),
             NodeDecision("offs", "placeholder", (), "R", 0.0, shape=(4,)),
             NodeDecision("w_in", "placeholder", (), "S(0)", 0.0, target=f"{module}.gate_up_proj", shape=(4, 32, 16)),
             NodeDecision("w_out", "placeholder", (), "S(2)", 0.0, target=f"{module}.down_proj", shape=(4, 8, 32)),
             NodeDecision("gate_up", op, ("L(experts)", "S(0)", "R"), "P(experts)", 0.0, module,
                          input_nodes=("x", "w_in", "offs"), shape=(64, 16)),
             NodeDecision("down", op, ("R", "S(2)", "R"), "S(1)", 0.0, module, input_nodes=("gate_up", "w_out", "offs"),
                          shape=(64, 32))]
    times = (("placed", 0.052), ("split", 0.0523))
    [block] = planned_experts(nodes, 2)
    assert block.form == "mixed" and block.experts == 4, block
    text = "\n".join(expert_lines(nodes, 2, times))
    explained = "\n".join(explain_experts(nodes, 2, module, times) or [])
    for got in (text, explained):
        assert "experts mixed" in got and "mixes the forms" in got and "experts placed 52.000 ms" in got, got
        assert "replicated" not in got and "forced" not in got, got


def _dispatched_forward(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each model with ``experts="dispatched"`` (static shapes, so the token dim may be split): the logits' largest
    difference from the single-process model, the blocks' forms, the dispatched grouped GEMMs in the rank-local graph
    (whether each sends rows out and back) and the collectives."""
    results = {}
    for name in names:
        model, args, kwargs = BUILDERS[name]()
        with torch.no_grad():
            expected = model(*args, **kwargs).logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs,
                                options=autotp.PlanOptions(experts="dispatched", dynamic=False))
        got = tp(*args, **kwargs).logits
        calls = [node.args[6:8] for node in tp.graph_module.graph.nodes
                 if node.target is torch.ops.autotp.dispatched_grouped_mm.default]
        results[name] = {"diff": (got - expected).abs().max().item(), "scale": expected.abs().max().item(),
                         "forms": [b.form for b in planned_experts(tp.plan.nodes, world_size)],
                         "calls": calls, "counts": tp.collective_counts(), "plan": str(tp.plan),
                         "explained": autotp.explain(tp.plan, "model.layers.0.mlp.experts")}
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dispatched_forward_equals_single_process(gloo, world_size: int) -> None:
    """tp=2, 3 (4 experts: 2/1/1 per rank, tokens 11/11/10 of Mixtral's 32 and 6/5/5 of Qwen3-MoE's 16) and 4:
    Mixtral and Qwen3-MoE with ``experts="dispatched"``: each rank routes its own tokens, one all-to-all sends the
    rows to their experts' ranks and one brings the results back (a dispatch-only grouped GEMM, then a combine-only
    one), and the logits equal the single-process model's on every rank."""
    names = ["mixtral", "qwen3_moe"]
    results = gloo.run(world_size, _dispatched_forward, names, timeout_s=900)
    for rank, result in enumerate(results):
        for name, got in result.items():
            case = f"{name} tp={world_size} rank {rank}"
            assert got["scale"] > 10 * TOLERANCE, f"{case}: logits too small to compare ({got['scale']:.3g})"
            assert got["diff"] <= TOLERANCE, f"{case}: max abs diff {got['diff']:.3g}"
            assert got["forms"] and set(got["forms"]) == {"dispatched"}, f"{case}: blocks took {got['forms']}"
            blocks = len(got["forms"])
            assert got["calls"] == [(True, False), (False, True)] * blocks, (
                f"{case}: expected one dispatch and one combine per block, got (dispatch, combine) {got['calls']}")
            assert got["counts"] == results[0][name]["counts"], f"{case}: rank {rank} issues other collectives"
            assert "experts dispatched (all-to-all)" in got["plan"], got["plan"]
            assert "all-to-all" in got["explained"] and "S(routed)" in got["explained"], got["explained"]


def test_dispatched_form_planned_and_refused() -> None:
    """tp=3, Mixtral, static shapes: ``experts="dispatched"`` plans every block with its tokens split (the sort and
    the router's weighting on each rank's own rows, ``S(local)``; the middle of the expert MLP on the rows sent to the
    rank, ``S(routed)``; the un-sorted rows back in token order, ``S(0)``), the plan's JSON form keeps it, and the
    grouped GEMMs price one all-gather of counts and the all-to-alls. With a dynamic token dim (the default) it is
    refused with a message naming ``dynamic=False``; with ``training=True`` as the placed form is."""
    from autotp.base.placements import LocalRows, RoutedRows
    from autotp.base.reshard import reshard_possible
    from autotp.cost_model.hardware import get_hardware
    from autotp.passes.costing import op_collectives_s
    from autotp.passes.rules.experts import is_dispatched
    from autotp.planning.experts import strategy_form

    model, args, kwargs = _mixtral(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, world_size=3, example_inputs=args, example_kwargs=kwargs,
                           options=autotp.PlanOptions(experts="dispatched", dynamic=False))
    blocks = planned_experts(plan.nodes, plan.world_size)
    assert [(b.form, b.per_rank) for b in blocks] == [("dispatched", (2, 1, 1))], blocks
    by_op = {n.name: n for n in plan.nodes}
    gemms = [by_op[name] for name in blocks[0].gemms]
    assert [(g.inputs, g.output) for g in gemms] == [
        (("S(local)", "S(0)", "P"), "S(routed)"), (("S(routed)", "S(0)", "P"), "S(local)")], gemms
    assert not any("P(experts)" in (n.output, *n.inputs) for n in plan.nodes)
    again = autotp.Plan.from_json(plan.to_json())
    assert [b.form for b in planned_experts(again.nodes, 3)] == ["dispatched"]
    assert "experts dispatched" in str(plan) and "all-to-all" in autotp.explain(plan, "model.layers.0.mlp.experts")

    for local in (LocalRows(), RoutedRows()):
        assert reshard_possible(local, local)
        for other in (autotp.base.placements.Replicate(), autotp.base.placements.Shard(0),
                      autotp.base.placements.Partial()):
            assert not reshard_possible(local, other) and not reshard_possible(other, local), (local, other)

    captured = capture(model, args, kwargs, dynamic=False)
    graph = build_strategy_graph(captured.graph_module, 3, captured.parameter_fqns(), place_experts=True)
    hardware = get_hardware("h100-sxm")
    for name in find_expert_blocks(graph)[0].gemms:
        node = graph.nodes[name]
        forms = {strategy_form(s): s for s in graph.strategies[name]}
        assert {"placed", "dispatched", "split"} <= set(forms), graph.strategies[name]
        dispatched = [s for s in graph.strategies[name] if is_dispatched(s)]
        times = [op_collectives_s(node, s, 3, hardware) for s in dispatched]
        assert all(t > 0 for t in times), times  # the counts' all-gather and the all-to-alls are priced
        assert op_collectives_s(node, forms["placed"], 3, hardware) == 0.0

    with pytest.raises(autotp.PlanError, match="dynamic=False"):
        _plan(model, args, kwargs, 2, "dispatched")
    with pytest.raises(ValueError, match="experts='split'"):
        autotp.PlanOptions(experts="dispatched", training=True)


def _dispatched_op(rank: int, world_size: int, fused: bool) -> dict[str, float]:
    """``autotp::dispatched_grouped_mm`` on every rank's own rows (5 experts, uneven over the ranks; each rank a
    different number of rows; expert 3 gets none), against the product of each row with its expert's weight."""
    import torch.distributed as dist

    from autotp.passes.rules.experts import dispatched_grouped_mm

    experts, width, inner = 5, 16, 8
    generator = torch.Generator().manual_seed(0)
    w_in = torch.randn(experts, width, inner, generator=generator)
    w_out = torch.randn(experts, inner, width, generator=generator)
    own = torch.Generator().manual_seed(100 + rank)
    rows = 3 + 2 * rank
    ids = torch.tensor([0, 1, 2, 4])[torch.randint(0, 4, (rows,), generator=own)].sort().values
    x = torch.randn(rows, width, generator=own)
    offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
    counts = [experts // world_size + (1 if r < experts % world_size else 0) for r in range(world_size)]
    first = sum(counts[:rank])
    mine_in, mine_out = w_in[first:first + counts[rank]], w_out[first:first + counts[rank]]
    group = dist.group.WORLD.group_name
    # one round trip per GEMM, and the pair that sends once and brings back once
    single = dispatched_grouped_mm(x, mine_in, offs, counts, rank, group, True, True, fused)
    sent = dispatched_grouped_mm(x, mine_in, offs, counts, rank, group, True, False, fused)
    back = dispatched_grouped_mm(torch.nn.functional.silu(sent), mine_out, offs, counts, rank, group, False, True, fused)
    expected_single = torch.stack([x[i] @ w_in[e] for i, e in enumerate(ids.tolist())])
    expected_pair = torch.stack([torch.nn.functional.silu(x[i] @ w_in[e]) @ w_out[e] for i, e in enumerate(ids.tolist())])
    return {"single": (single - expected_single).abs().max().item(), "pair": (back - expected_pair).abs().max().item(),
            "received": float(sent.shape[0]), "own": float(rows)}


@pytest.mark.parametrize("world_size,fused", [(2, False), (3, True)])
def test_dispatched_grouped_mm_op(gloo, world_size: int, fused: bool) -> None:
    """tp=2 (experts 3/2) and 3 (experts 2/2/1), a loop of matrix products and one ``_grouped_mm`` kernel: every
    rank's rows come back multiplied by their own experts, through one all-to-all each way; the rows a rank
    received differ from its own (rows really moved)."""
    results = gloo.run(world_size, _dispatched_op, fused)
    for rank, got in enumerate(results):
        assert got["single"] <= TOLERANCE and got["pair"] <= TOLERANCE, f"rank {rank}: {got}"
    assert any(got["received"] != got["own"] for got in results), results


@pytest.mark.zoo  # with the rest of the expert-placement matrix
@pytest.mark.slow  # GPT-OSS is captured and planned twice: about half a minute on a loaded 2-core machine
def test_dispatched_refused_where_a_block_is_not_token_local() -> None:
    """tp=2, GPT-OSS, static shapes: its experts add a per-expert bias to each grouped GEMM's rows (gathered by
    expert id), which autotp does not run on a rank's own tokens, so ``experts="dispatched"`` is refused before
    solving, naming the ops; the placed form of the same graph is planned."""
    model, args, kwargs = BUILDERS["gpt_oss"]()
    options = autotp.PlanOptions(experts="dispatched", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(autotp.PlanError, match=r"take none: add_\d+ \(aten\.add\.Tensor\)"):
            autotp.plan(model, world_size=2, example_inputs=args, example_kwargs=kwargs, options=options)
        plan = autotp.plan(model, world_size=2, example_inputs=args, example_kwargs=kwargs,
                           options=autotp.PlanOptions(experts="placed", dynamic=False))
    assert {b.form for b in planned_experts(plan.nodes, 2)} == {"placed"}
