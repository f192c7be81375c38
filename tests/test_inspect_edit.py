"""Saved and hand-edited plans: loading checks them, autotp.compile(plan=...) applies them.

Tiny Llama (hidden 256, 8 heads, 4 kv heads, 2 layers), planned on the CPU model for tp=2; the
edit keeps lm_head whole (weight R, its GEMM replicated) instead of vocab-parallel.
"""

from __future__ import annotations

import json

import pytest
from inspect_helpers import local_shape, tiny_plan

from autotp.base.errors import PlanMismatchError
from autotp.planning.plan import Plan


def _edit_lm_head_replicated(text: str) -> str:
    """What a user would do in an editor: lm_head.weight R, and its linear (R, R) -> R."""
    data = json.loads(text)
    data["parameters"]["lm_head.weight"] = "R"
    weight = next(n for n in data["nodes"] if n.get("target") == "lm_head.weight")
    weight["output"] = "R"
    reader = next(n for n in data["nodes"] if weight["name"] in n.get("input_nodes", []))
    reader["inputs"], reader["output"] = ["R", "R"], "R"
    return json.dumps(data, indent=1)


def _captured():
    import models

    from autotp.capture.tracing import capture

    model, args, kwargs = models.tiny_llama()
    return capture(model, args, kwargs)


def test_edited_plan_passes_the_checks() -> None:
    """tp=2: the consistent hand edit is accepted by the checks compile runs."""
    from autotp.planning.checks import check_plan_applies

    edited = Plan.from_json(_edit_lm_head_replicated(tiny_plan("llama", 2, device="cpu").to_json()))
    check_plan_applies(edited, _captured(), 2)


def test_inconsistent_edits_are_named() -> None:
    """tp=2: editing only `parameters`, or giving a GEMM a strategy its rule does not offer, is refused
    with every problem named and the valid strategies listed."""
    from autotp.planning.checks import check_plan_applies

    data = json.loads(tiny_plan("llama", 2, device="cpu").to_json())
    up = "model.layers.0.mlp.up_proj.weight"
    wrong = "S(1)" if data["parameters"][up] != "S(1)" else "S(0)"
    data["parameters"][up] = wrong
    gemm = next(n for n in data["nodes"] if n["name"] == "linear_6")
    gemm["inputs"], gemm["output"] = ["R", "R"], "S(0)"  # a linear never splits its output on dim 0
    with pytest.raises(PlanMismatchError) as info:
        check_plan_applies(Plan.from_json(json.dumps(data)), _captured(), 2)
    message = str(info.value)
    assert f"parameter {up}: 'parameters' says '{wrong}' but its node" in message, message
    assert "node linear_6 (aten.linear.default): (R, R) -> S(0) is not a strategy" in message, message
    assert "valid: (R, R) -> R" in message, message
    data["nodes"][0]["output"] = "S(x)"
    with pytest.raises(PlanMismatchError, match="cannot parse placement 'S\\(x\\)'"):
        Plan.from_json(json.dumps(data), source="edited.json")


def _apply_edited(rank: int, world_size: int, text: str) -> dict[str, object]:
    import models
    import torch

    import autotp

    model, args, kwargs = models.tiny_llama()
    with torch.no_grad():
        reference = model(*args, **kwargs).logits
        tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs, plan=Plan.from_json(text))
        logits = tp(*args, **kwargs).logits
    return {"diff": (logits - reference).abs().max().item(), "lm_head": tuple(tp.local_state()["lm_head.weight"].shape),
            "q_proj": tuple(tp.local_state()["model.layers.0.self_attn.q_proj.weight"].shape)}


def test_compile_applies_a_hand_edited_plan_on_gloo(gloo, tmp_path) -> None:
    """tp=2 on gloo: the edited plan, saved and reloaded, runs: lm_head whole on every rank, attention still
    split, logits equal to the single-device model."""
    original = tiny_plan("llama", 2, device="cpu")
    path = tmp_path / "edited.json"
    path.write_text(_edit_lm_head_replicated(original.to_json()))
    edited = Plan.load(path)
    assert edited.parameters["lm_head.weight"] == "R"
    q_expected = local_shape((256, 256), edited.parameters["model.layers.0.self_attn.q_proj.weight"], 2)
    for rank, result in enumerate(gloo.run(2, _apply_edited, edited.to_json())):
        assert result["diff"] < 1e-4, f"rank {rank}: max |logit difference| {result['diff']:.3e} (expected < 1e-4)"
        assert result["lm_head"] == (1000, 256), f"rank {rank}: lm_head.weight should be whole, is {result['lm_head']}"
        assert result["q_proj"] == q_expected, f"rank {rank}: q_proj.weight {result['q_proj']}, plan says {q_expected}"
