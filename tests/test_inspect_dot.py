"""autotp.to_dot(plan) / autotp.to_svg(plan): Graphviz drawings of a plan (unit tier, no process group).

Plans: tiny Llama (hidden 256, 8 heads, 4 kv heads, 2 layers) over tp=4 on the meta device,
and the same plan stacked to 80 identical layers.
"""

from __future__ import annotations

import re
import shutil

import pytest
from inspect_helpers import stacked_plan, tiny_plan

import autotp
from autotp.inspect.dot import GraphvizNotFoundError, placement_colours


def test_dot_has_modules_placements_and_collectives() -> None:
    """tp=4: clusters per module, weights coloured by placement, each collective a hexagon with bytes and time."""
    plan = tiny_plan()
    dot = autotp.to_dot(plan, fold=False)
    assert dot.startswith("digraph autotp_plan {") and dot.rstrip().endswith("}")
    assert "subgraph cluster_model_layers_0_self_attn {" in dot
    hexagons = re.findall(r'label="([^"]*)", shape=hexagon', dot)
    expected = sorted(f"{'+'.join(c.steps)} {c.src}->{c.dst}" for c in plan.collectives)
    assert sorted(h.split("\\n")[0] for h in hexagons) == expected, hexagons
    assert all(re.search(r"\\n[\d.]+ (B|KiB|MiB), [\d.]+ us$", h) for h in hexagons), hexagons
    q = plan.parameters["model.layers.0.self_attn.q_proj.weight"]
    line, fill = placement_colours(q)
    assert re.search(r'n_p_model_layers_0_self_attn_q_proj_weight \[label="weight\\n256x256  ' + re.escape(q) + '".*'
                     + f'fillcolor="{fill}", color="{line}"', dot), f"q_proj.weight should be drawn as {q}"
    assert dot.count("{") == dot.count("}")


def test_dot_folds_identical_layers_and_limits_depth() -> None:
    """80 identical layers are drawn once with their count; max_depth=3 draws attention and MLP as one box each."""
    plan = stacked_plan(tiny_plan(), 80)
    folded = autotp.to_dot(plan)
    assert "x80 identical: model.layers.0-79; first shown" in folded
    assert "n_linear_13__l40" not in folded and "n_linear_6 " in folded
    unfolded = autotp.to_dot(plan, fold=False)
    assert "n_linear_13__l40" in unfolded and len(unfolded) > 20 * len(folded) / 2
    shallow = autotp.to_dot(tiny_plan(), max_depth=3)
    assert "m_model_layers_0_self_attn [" in shallow and "m_model_layers_0_mlp [" in shallow, shallow[:2000]
    assert "n_linear_6" not in shallow and "m_model_layers_0_mlp -> c_" in shallow
    with pytest.raises(ValueError, match="max_depth"):
        autotp.to_dot(plan, max_depth=-1)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_svg_renders_with_dot(tmp_path) -> None:
    """With Graphviz installed, to_svg returns and writes an SVG document."""
    path = tmp_path / "plan.svg"
    svg = autotp.to_svg(tiny_plan(), path, max_depth=4)
    assert "<svg" in svg and path.read_text(encoding="utf-8") == svg


def test_svg_without_dot_says_what_to_install(monkeypatch) -> None:
    """Without Graphviz, to_svg raises a clear error naming the fix and the alternatives."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(GraphvizNotFoundError, match="install Graphviz|Install Graphviz") as info:
        autotp.to_svg(tiny_plan())
    assert "autotp.to_html(plan, path)" in str(info.value), str(info.value)
