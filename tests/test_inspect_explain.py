"""autotp.explain(plan, name), autotp.diff(plan, other), user constraints and the plan's JSON format
(unit tier, no process group).

All plans are made on the meta device for a tiny Llama (hidden 256, 8 heads, 4 kv heads, 2 layers)
over tp=4 unless a test says otherwise.
"""

from __future__ import annotations

import inspect
import json
import math
import re

import pytest
from inspect_helpers import tiny_plan

import autotp
from autotp import Replicate, Shard
from autotp.base.errors import PlanError, PlanMismatchError
from autotp.planning.plan import Plan


def test_nodes_record_their_edges_shapes_and_targets() -> None:
    """tp=4: every node names its producers; parameter placeholders carry their FQN and shape."""
    plan = tiny_plan()
    names = {n.name for n in plan.nodes}
    for node in plan.nodes:
        assert len(node.input_nodes) == len(node.inputs), f"{node.name}: {node.input_nodes} vs {node.inputs}"
        assert set(node.input_nodes) <= names, f"{node.name} reads unknown nodes {set(node.input_nodes) - names}"
    weights = {n.target: n for n in plan.nodes if n.target in plan.parameters}
    assert set(weights) == set(plan.parameters), "every parameter FQN should have a placeholder with that target"
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (256, 256) and q.dtype == "float32", f"q_proj.weight shape/dtype: {q.shape} {q.dtype}"
    assert q.output == plan.parameters[q.target]


def test_alternatives_are_sorted_and_priced() -> None:
    """tp=4: alternatives come cheapest first; a delta is its compute plus communication parts."""
    plan = tiny_plan()
    with_alts = [n for n in plan.nodes if n.alternatives]
    assert len(with_alts) > 50, f"expected most nodes to have alternatives, got {len(with_alts)}"
    for node in with_alts:
        deltas = [a.delta_s for a in node.alternatives if a.delta_s is not None]
        assert deltas == sorted(deltas), f"{node.name}: alternatives not sorted: {deltas}"
        for alt in node.alternatives:
            assert alt.strategy != f"{node.output}" or node.inputs, f"{node.name} lists its own choice"
            if alt.delta_s is not None:
                parts = alt.compute_delta_s + sum(v for _, v in alt.comm_delta_s)
                assert math.isclose(alt.delta_s, parts, rel_tol=1e-9, abs_tol=1e-15), (alt, parts)
            else:
                assert alt.note, f"{node.name}: an impossible alternative must say why: {alt}"


def _other_split(plan: Plan, fqn: str) -> str:
    return "S(0)" if plan.parameters[fqn] != "S(0)" else "S(1)"


def test_alternative_delta_bounds_the_replanned_cost() -> None:
    """tp=4: pinning both layers' down_proj weights to their other split and re-solving costs at least
    the optimum and at most the optimum plus the two alternatives' deltas (each priced with its
    neighbours fixed; the solver may also move the neighbours)."""
    base = tiny_plan()
    other = _other_split(base, "model.layers.0.mlp.down_proj.weight")
    deltas = []
    for layer in (0, 1):
        node = next(n for n in base.nodes if n.target == f"model.layers.{layer}.mlp.down_proj.weight")
        alt = next(a for a in node.alternatives if a.strategy == other)
        assert alt.delta_s is not None and alt.memory_delta_bytes <= 0, alt
        deltas.append(alt.delta_s)
    pinned = tiny_plan(constraints=(("model.layers.*.mlp.down_proj.weight", other),))
    tolerance = 1e-9
    assert pinned.predicted_time_s >= base.predicted_time_s - tolerance, (pinned.predicted_time_s, base.predicted_time_s)
    assert pinned.predicted_time_s <= base.predicted_time_s + sum(deltas) + tolerance, (
        f"re-solved {pinned.predicted_time_s} > base {base.predicted_time_s} + deltas {deltas}")


def test_explain_parameter_and_node() -> None:
    """tp=4: explain names the choice, its reader, and every alternative with its price or why not."""
    plan = tiny_plan()
    fqn = "model.layers.0.mlp.down_proj.weight"
    text = autotp.explain(plan, fqn)
    weight = next(n for n in plan.nodes if n.target == fqn)
    assert text.startswith(f"{fqn} (parameter) [256, 512]: chose {plan.parameters[fqn]}"), text
    assert "read by linear_6" in text, text
    assert text.count("\n  - ") == len(weight.alternatives) >= 1, text
    assert "replicating this would" in text, text
    assert "exceeds the memory budget" in text, "replicating a weight under the default budget should not fit"
    node_text = autotp.explain(plan, "linear_6")
    assert node_text.startswith("linear_6 (aten.linear.default in model.layers.0.mlp.down_proj)"), node_text
    for c in plan.collectives:
        if c.producer == "linear_6":
            assert f"after it: {'+'.join(c.steps)} {c.src}->{c.dst}" in node_text, node_text


def test_explain_unknown_name_suggests() -> None:
    """An unknown name raises KeyError with similar names."""
    with pytest.raises(KeyError, match="similar: .*down_proj"):
        autotp.explain(tiny_plan(), "model.layers.9.mlp.down_proj.weight")


REPORTS = {  # name -> its parameters as (name, kind), the shapes the Plan methods had
    "diff": (("plan", "POSITIONAL_OR_KEYWORD"), ("other", "POSITIONAL_OR_KEYWORD")),
    "estimate": (("plan", "POSITIONAL_OR_KEYWORD"), ("hardware", "POSITIONAL_OR_KEYWORD")),
    "explain": (("plan", "POSITIONAL_OR_KEYWORD"), ("name", "POSITIONAL_OR_KEYWORD")),
    "to_dot": (("plan", "POSITIONAL_OR_KEYWORD"), ("fold", "KEYWORD_ONLY"), ("max_depth", "KEYWORD_ONLY")),
    "to_html": (("plan", "POSITIONAL_OR_KEYWORD"), ("path", "POSITIONAL_OR_KEYWORD"), ("title", "KEYWORD_ONLY")),
    "to_parallelize_plan": (("plan", "POSITIONAL_OR_KEYWORD"), ("model", "POSITIONAL_OR_KEYWORD")),
    "to_svg": (("plan", "POSITIONAL_OR_KEYWORD"), ("path", "POSITIONAL_OR_KEYWORD"), ("fold", "KEYWORD_ONLY"),
               ("max_depth", "KEYWORD_ONLY"), ("timeout_s", "KEYWORD_ONLY")),
}


def test_reports_are_functions_of_a_plan() -> None:
    """No process group: each report is a function of autotp.inspect, the same object as autotp's and
    listed in both __all__; a Plan carries none of them (planning never imports a report), and
    print(plan) names the functions."""
    import autotp.inspect as reports

    assert sorted(reports.__all__) == sorted(REPORTS), f"expected {sorted(REPORTS)}, got {sorted(reports.__all__)}"
    for name, expected in REPORTS.items():
        function = getattr(reports, name)
        assert callable(function) and getattr(autotp, name) is function, f"autotp.{name} is not autotp.inspect.{name}"
        assert name in autotp.__all__, f"{name} missing from autotp.__all__"
        assert not hasattr(Plan, name), f"Plan.{name} exists; expected only autotp.{name}(plan, ...)"
        shape = tuple((p.name, p.kind.name) for p in inspect.signature(function).parameters.values())
        assert shape == expected, f"autotp.{name}: expected parameters {expected}, got {shape}"
    text = str(tiny_plan())
    for call in ("autotp.explain(plan, name)", "autotp.to_html(plan, path)", "autotp.diff(plan, other)"):
        assert call in text, f"expected {call!r} in the hint of print(plan), got:\n{text[-300:]}"


def test_diff_same_and_constrained() -> None:
    """tp=4: a plan has no diff with itself; pinning the down_proj weights to the other split shows in
    the diff, with the change in predicted time."""
    base = tiny_plan()
    assert not autotp.diff(base, base), str(autotp.diff(base, base))
    fqn = "model.layers.0.mlp.down_proj.weight"
    was, other = base.parameters[fqn], _other_split(base, fqn)
    pinned = tiny_plan(constraints=(("model.layers.*.mlp.down_proj.weight", other),))
    delta = autotp.diff(base, pinned)
    assert (fqn, was, other) in delta.parameters, delta.parameters
    assert math.isclose(delta.time_delta_s, pinned.predicted_time_s - base.predicted_time_s, abs_tol=1e-12)
    assert delta.time_delta_s >= -1e-12, "the unconstrained plan is optimal"
    text = str(delta)
    assert f"model.layers.1.mlp.down_proj.weight: {was} => {other}" in text, text
    assert "  linear_6: " in text, "the GEMM reading the weight changes strategy too"


def test_constraints_pin_parameters_and_nodes() -> None:
    """tp=4: fnmatch patterns over FQNs and node names; placement objects and text both accepted.
    Keeping weights whole needs room in the budget: with memory_budget=None, R is honoured too."""
    base = tiny_plan()
    other = _other_split(base, "model.layers.0.mlp.down_proj.weight")
    plan = tiny_plan(constraints=(("model.layers.*.mlp.down_proj.weight", other),))
    assert plan.parameters["model.layers.0.mlp.down_proj.weight"] == other
    assert plan.parameters["model.layers.1.mlp.down_proj.weight"] == other
    whole = tiny_plan(constraints=(("model.layers.*.mlp.down_proj.weight", "R"), ("linear_13", "R")), memory_budget=None)
    assert whole.parameters["model.layers.0.mlp.down_proj.weight"] == "R"
    assert whole.parameters["model.layers.1.mlp.down_proj.weight"] == "R"
    assert next(n for n in whole.nodes if n.name == "linear_13").output == "R"
    from autotp.planning.constraints import normalize_constraints

    assert normalize_constraints({"a": Replicate(), "b": Shard(1), "c": "S(0)"}) == {"a": "R", "b": "S(1)", "c": "S(0)"}


def test_constraint_errors_name_every_problem() -> None:
    """Patterns matching nothing and placements that are not candidates are reported together."""
    import models

    model, args, kwargs = models.tiny_llama(device="meta")
    with pytest.raises(PlanError) as info:
        autotp.plan(model, args, kwargs, world_size=4,
                    options=autotp.PlanOptions(constraints={"model.layers.*.mlp.nothing": "R", "lm_head.weight": "P"}))
    message = str(info.value)
    assert "'model.layers.*.mlp.nothing'" in message and "parameters look like: model.embed_tokens.weight" in message, message
    assert "lm_head.weight (pattern 'lm_head.weight') cannot be P; its candidates are R, S(0), S(1)" in message, message
    with pytest.raises(ValueError, match="not a placement"):
        autotp.plan(model, args, kwargs, world_size=4, options=autotp.PlanOptions(constraints={"lm_head.weight": "S(x)"}))


def test_check_plan_constraints() -> None:
    """compile(plan=..., constraints=...) refuses a plan that breaks the constraints."""
    from autotp.planning.constraints import check_plan_constraints

    plan = tiny_plan()
    actual = plan.parameters["lm_head.weight"]
    check_plan_constraints(plan, {"lm_head.weight": actual})
    wanted = "R" if actual != "R" else "S(0)"
    with pytest.raises(PlanMismatchError, match=re.escape(f"lm_head.weight is {actual} in the plan, "
                                                          f"constraint 'lm_head.weight' asks {wanted}")):
        check_plan_constraints(plan, {"lm_head.weight": wanted})


def test_json_round_trip_keeps_alternatives(tmp_path) -> None:
    """Format v2: save/load gives an equal plan, alternatives included."""
    plan = tiny_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert json.loads(path.read_text())["version"] == 2


def test_version_1_plans_still_load() -> None:
    """A format-v1 plan (no edges, shapes, alternatives) loads; explain says alternatives are missing."""
    data = json.loads(tiny_plan().to_json())
    data["version"] = 1
    for node in data["nodes"]:
        for key in ("input_nodes", "target", "shape", "dtype", "alternatives"):
            node.pop(key)
    old = Plan.from_json(json.dumps(data))
    assert old.version == 1 and old.decisions() == tiny_plan().decisions()
    assert "not recorded in format-v1 plans" in autotp.explain(old, "linear_6")
    data["version"] = 99
    with pytest.raises(PlanMismatchError, match="found version 99"):
        Plan.from_json(json.dumps(data))
