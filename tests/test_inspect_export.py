"""autotp.to_parallelize_plan(plan): the equivalent torch.distributed.tensor.parallel plan.

Unit tier: which modules get which style, what is reported as inexpressible. Gloo tier: the
exported plan applied with ``parallelize_module`` on a real 2-rank gloo group (a 1-D CPU
DeviceMesh) gives the same outputs as autotp's own rewrite and as the single-device model.
"""

from __future__ import annotations

import pytest
from inspect_helpers import MEGATRON_LLAMA, tiny_plan
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autotp
from autotp.planning.plan import Plan


def _layouts(style: object) -> tuple[object, object]:
    return style.input_layouts[0], style.output_layouts[0]  # type: ignore[attr-defined]


def test_llama_tp4_is_the_megatron_plan() -> None:
    """tp=4 tiny Llama, weights pinned to the Megatron layout: q/k/v/gate/up column-parallel, o/down
    row-parallel reduced to replicated, lm_head and embedding column-parallel gathered; nothing left out."""
    export = autotp.to_parallelize_plan(tiny_plan("llama", 4, constraints=MEGATRON_LLAMA))
    assert export.complete, str(export)
    styles = export.plan
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        style = styles[f"model.layers.1.{name}"]
        assert isinstance(style, ColwiseParallel) and _layouts(style) == (Replicate(), Shard(-1)), (name, style)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        style = styles[f"model.layers.0.{name}"]
        assert isinstance(style, RowwiseParallel) and _layouts(style) == (Shard(-1), Replicate()), (name, style)
    assert _layouts(styles["lm_head"]) == (Replicate(), Replicate())
    assert isinstance(styles["model.embed_tokens"], ColwiseParallel)
    assert "model.norm" not in styles and "model.layers.0.input_layernorm" not in styles
    assert "'model.layers.0.mlp.down_proj': RowwiseParallel(" in str(export)


def test_uneven_split_and_gpt2_are_reported() -> None:
    """tp=3 splits the MLP's 1024 hidden units unevenly (DTensor would cut differently); GPT-2's fused
    Conv1D c_attn (an addmm, not nn.Linear) has no style. Both are listed, not silently dropped."""
    uneven = autotp.to_parallelize_plan(tiny_plan("mlp", 3))
    assert not uneven.complete
    assert any("split unevenly over 3 ranks" in line for line in uneven.unexpressed), uneven.unexpressed
    gpt2 = autotp.to_parallelize_plan(tiny_plan("gpt2", 2))
    assert any("c_attn" in line for line in gpt2.unexpressed), gpt2.unexpressed


def test_model_types_are_checked() -> None:
    """With the model given, a styled module that is not nn.Linear/nn.Embedding is reported."""
    import models
    import torch

    model, _, _ = models.tiny_mlp(device="meta")
    model[2] = torch.nn.Identity()
    export = autotp.to_parallelize_plan(tiny_plan("mlp", 2), model)
    assert "'2': RowwiseParallel" not in str(export)
    assert any(line.startswith("2: a Identity") for line in export.unexpressed), export.unexpressed


_PINNED = {"llama": MEGATRON_LLAMA, "mlp": (("0.weight", "S(0)"), ("2.weight", "S(1)"))}


def _compare_on_ranks(rank: int, world_size: int, name: str, plan_json: str) -> dict[str, float]:
    """Both ways of making the model tensor-parallel, against the single-device output."""
    import models
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    import autotp

    def out(value: object) -> torch.Tensor:
        return value.logits if hasattr(value, "logits") else value  # type: ignore[attr-defined,return-value]

    plan = Plan.from_json(plan_json)
    model, args, kwargs = models.BUILDERS[name]()
    with torch.no_grad():
        reference = out(model(*args, **kwargs))
        ours = out(autotp.compile(model, example_inputs=args, example_kwargs=kwargs, plan=plan)(*args, **kwargs))
    export = autotp.to_parallelize_plan(plan, model)
    assert export.complete, str(export)
    fresh, _, _ = models.BUILDERS[name]()  # same seed: same weights
    mesh = DeviceMesh("cpu", list(range(world_size)))
    parallelize_module(fresh, mesh, export.plan)
    with torch.no_grad():
        theirs = out(fresh(*args, **kwargs))
    return {"autotp": (ours - reference).abs().max().item(), "parallelize_module": (theirs - reference).abs().max().item(),
            "between": (ours - theirs).abs().max().item()}


@pytest.mark.parametrize("name", ["llama", "mlp"])
def test_parallelize_module_matches_autotp_on_gloo(gloo, name: str) -> None:
    """tp=2 on gloo, weights pinned to the Megatron layout: parallelize_module with the exported plan ==
    autotp.compile(plan=...) == one device."""
    plan = tiny_plan(name, 2, device="cpu", constraints=_PINNED[name])
    results = gloo.run(2, _compare_on_ranks, name, plan.to_json())
    for rank, diffs in enumerate(results):
        for key, value in diffs.items():
            assert value < 1e-4, f"rank {rank} {name}: max |{key} difference| = {value:.3e} (expected < 1e-4)"
