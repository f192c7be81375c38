"""autotp.to_html(plan, path): the page's data, that it is self-contained, and that it runs in real headless Chromium.

Plans: a tiny Llama (hidden 256, 8 heads, 4 kv heads, 2 layers) over tp=4, planned on the meta
device, and the same plan stacked to 80 layers (``inspect_helpers.stacked_plan``) for folding.
The Chromium tests skip when no Chromium is installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import html
import json
import math
import re

import chromium
import pytest
from inspect_helpers import MEGATRON_LLAMA, local_shape, stacked_plan, tiny_plan

import autotp
from autotp.inspect.html import plan_payload
from autotp.planning.blocks import block_runs

needs_chromium = pytest.mark.skipif(chromium.chromium_binary() is None,
                                    reason="Chromium is not installed (apt-get install chromium)")


def _embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="autotp-plan-data">(.*?)</script>', page, re.DOTALL)
    assert match, "the page should embed the plan as JSON"
    return json.loads(match.group(1))


def test_payload_has_every_node_edge_and_collective() -> None:
    """tp=4: the embedded data names every node, indexes every edge and collective correctly."""
    plan = tiny_plan()
    data = plan_payload(plan, "t")
    assert [n["n"] for n in data["nodes"]] == [n.name for n in plan.nodes]
    for entry, node in zip(data["nodes"], plan.nodes):
        assert [data["nodes"][i]["n"] for i in entry["a"]] == list(node.input_nodes), node.name
        assert len(entry["alt"]) == len(node.alternatives)
    assert len(data["collectives"]) == len(plan.collectives)
    for entry, c in zip(data["collectives"], plan.collectives):
        assert data["nodes"][entry["p"]]["n"] == c.producer
        assert [data["nodes"][i]["n"] for i in entry["c"]] == list(c.consumers)
    weights = {e["t"]: e["w"] for e in data["nodes"] if "w" in e}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert weights[q] == 4 * math.prod(local_shape((256, 256), plan.parameters[q], 4)), weights
    assert sum(weights.values()) == plan.parameter_bytes_per_rank, (sum(weights.values()), plan.parameter_bytes_per_rank)


def test_identical_layers_fold_into_one_run() -> None:
    """80 stacked layers: the text and the page see one run of 80 identical layers."""
    plan = stacked_plan(tiny_plan(), 80)
    runs = [r for r in block_runs(plan.nodes, plan.collectives) if r.count > 1]
    assert [(r.label, r.count) for r in runs] == [("model.layers.0-79", 80)]
    data = plan_payload(plan, "t")
    assert data["runs"] == [{"members": [f"model.layers.{i}" for i in range(80)]}]
    text = plan.summary()
    assert "model.layers.0-79             80" in text, text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_page_is_self_contained(tmp_path) -> None:
    """The page loads nothing: no external src/href, a CSP that forbids the network, data escaped."""
    path = tmp_path / "plan.html"
    page = autotp.to_html(tiny_plan(), path, title="</script><b>x")
    assert path.read_text(encoding="utf-8") == page
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page), "no external resources"
    assert "default-src 'none'" in page
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}, f"only the SVG namespace may appear, found {urls}"
    assert f"<title>{html.escape('</script><b>x')}</title>" in page
    assert _embedded(page)["meta"]["title"] == "</script><b>x"


def _ready(run: chromium.ChromiumRun) -> dict[str, str]:
    match = re.search(r"<html([^>]*)>", run.dom)
    assert match, f"no <html> in the dumped DOM (rc {run.returncode}):\n{run.stderr[-2000:]}"
    attrs = dict(re.findall(r'(data-[\w-]+)="([^"]*)"', match.group(1)))
    errors = re.search(r'<pre id="autotp-errors"[^>]*>(.*?)</pre>', run.dom, re.DOTALL)
    assert errors is not None and not errors.group(1).strip(), f"script errors: {errors and errors.group(1)}"
    assert not run.console_errors(), f"console errors: {run.console_errors()}"
    assert attrs.get("data-autotp-ready") == "1", f"page did not finish drawing: {attrs}\n{run.stderr[-2000:]}"
    return attrs


@needs_chromium
@pytest.mark.slow  # starts a headless browser (~3 s each): runs in CI, not in the fast tier
def test_chromium_loads_without_errors_and_shows_details(tmp_path) -> None:
    """tp=4 tiny Llama: everything expanded, and a selected weight with its alternatives."""
    path = tmp_path / "plan.html"
    autotp.to_html(tiny_plan(), path, title="tiny Llama")
    expanded = _ready(chromium.dump_dom(path, "view=expand&view=unfold"))
    assert int(expanded["data-autotp-visible"]) > 150, expanded
    selected = chromium.dump_dom(path, "select=model.layers.0.mlp.down_proj.weight")
    _ready(selected)
    details = selected.dom[selected.dom.index('id="details-body"'):]
    assert "model.layers.0.mlp.down_proj.weight" in details and "alternatives" in details.lower(), details[:2000]
    assert "exceeds the memory budget" in details, details[:3000]


@needs_chromium
@pytest.mark.slow  # starts a headless browser (~3 s each): runs in CI, not in the fast tier
def test_chromium_80_layers_stay_usable(tmp_path) -> None:
    """80 stacked layers: folded by default (few boxes drawn), and unfolding all of them still draws."""
    path = tmp_path / "plan80.html"
    autotp.to_html(stacked_plan(tiny_plan(), 80), path)
    run = chromium.dump_dom(path)
    folded = _ready(run)
    assert int(folded["data-autotp-visible"]) < 60, folded
    assert "layers.0\u201379  \u00d780 identical" in html.unescape(run.dom), "the fold's label should be drawn"
    unfolded = _ready(chromium.dump_dom(path, "view=unfold&find=linear_6__l40", budget_ms=15000))
    assert int(unfolded["data-autotp-visible"]) > 80, unfolded


@needs_chromium
@pytest.mark.slow  # starts a headless browser (~3 s each): runs in CI, not in the fast tier
def test_chromium_screenshot_shows_the_graph(tmp_path) -> None:
    """Megatron-pinned tp=4 plan: a screenshot of the default view is not blank and shows the colour of
    the column-parallel projections' outputs (split on their last dim, S(2))."""
    path, png = tmp_path / "plan.html", tmp_path / "plan.png"
    autotp.to_html(tiny_plan(constraints=MEGATRON_LLAMA), path)
    run = chromium.screenshot(path, png, window=(1400, 900))
    assert not run.console_errors(), run.console_errors()
    assert png.exists() and png.stat().st_size > 20_000, f"no screenshot (rc {run.returncode}): {run.stderr[-1500:]}"
    pil = pytest.importorskip("PIL.Image")
    image = pil.open(png).convert("RGB")
    colours = {colour for _, colour in image.resize((350, 225)).getcolors(maxcolors=1 << 20)}
    assert len(colours) > 200, f"the screenshot looks blank: {len(colours)} colours"
    purple = (156, 54, 181)  # S(2): the q/k/v projections' outputs
    near = [c for c in colours if sum(abs(a - b) for a, b in zip(c, purple)) < 60]
    assert near, "no S(2)-coloured pixels: the graph did not draw"
