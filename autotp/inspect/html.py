"""``autotp.to_html(plan, path)``: one self-contained, offline HTML page that draws a plan.

The page holds the plan as JSON plus the viewer's CSS and JavaScript inline (``assets/``); it
loads nothing from the network. What it shows (see ``assets/plan_view.js``):

- the graph grouped by module hierarchy (model -> layers -> attention / MLP -> ops), every
  group collapsible; runs of identical layers folded into one box that shows the first of them;
- every node coloured by the placement of its output, every edge by the placement of the
  tensor it carries; every collective the rewrite inserts as its own node with bytes and time;
- a totals panel: predicted time split into compute and communication, weights per rank
  against the whole model and the budget, collective counts, ops without a sharding rule;
- details on hover (tooltip) and click (side panel): a node's strategy, inputs, collectives
  and its alternatives with their cost differences; a group's totals.

The URL hash drives the view for links and tests: ``#select=<node or FQN>``,
``#find=<text>``, ``#view=expand|collapse|unfold``, ``#noscroll=1`` (select without scrolling). The page marks
``<html data-autotp-ready="1">`` when drawn and lists any script error in
``<pre id="autotp-errors">`` (headless tests read both).
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources

from autotp.adapters.torchao import part_label
from autotp.planning.blocks import block_runs, node_module, parameter_bytes_per_rank
from autotp.planning.plan import Plan

__all__ = ["plan_payload", "to_html"]

_ERROR_SINK = """
window.__autotpErrors = [];
function __autotpRecord(message) {
  window.__autotpErrors.push(String(message));
  document.documentElement.setAttribute("data-autotp-errors", String(window.__autotpErrors.length));
  var sink = document.getElementById("autotp-errors");
  if (sink) { sink.textContent = window.__autotpErrors.join("\\n"); sink.hidden = false; }
}
window.addEventListener("error", function (e) {
  __autotpRecord("error: " + e.message + " (" + e.filename + ":" + e.lineno + ")");
});
window.addEventListener("unhandledrejection", function (e) { __autotpRecord("unhandled rejection: " + e.reason); });
(function () {
  var original = console.error;
  console.error = function () {
    __autotpRecord("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
})();
"""


def _asset(name: str) -> str:
    return resources.files("autotp.inspect").joinpath("assets", name).read_text(encoding="utf-8")


def plan_payload(plan: Plan, title: str) -> dict:
    """The plan as the compact JSON the viewer reads (indices instead of names for edges)."""
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    nodes = []
    for n in plan.nodes:
        entry: dict = {
            "n": n.name, "op": n.op, "m": node_module(n), "i": list(n.inputs), "o": n.output, "c": n.compute_s,
            "a": [index[p] for p in n.input_nodes if p in index], "t": (part_label(n.target) if n.target else None) or n.target, "s": list(n.shape), "d": n.dtype,
            "f": n.fallback,
            "alt": [[a.strategy, a.delta_s, a.compute_delta_s, [list(kv) for kv in a.comm_delta_s], a.memory_delta_bytes, a.note]
                    for a in n.alternatives],
        }
        if len(entry["a"]) != len(entry["i"]):  # a format-v1 plan has no edges: draw nodes only
            entry["a"], entry["i"] = [], []
        if n.op == "placeholder" and n.target in plan.parameters:
            entry["w"] = parameter_bytes_per_rank(n, plan.world_size)
        nodes.append(entry)
    collectives = [
        {"p": index[c.producer], "src": c.src, "dst": c.dst, "steps": list(c.steps), "b": c.nbytes, "t": c.time_s,
         "c": [index[x] for x in c.consumers if x in index], "m": c.module}
        for c in plan.collectives if c.producer in index
    ]
    runs = [{"members": [b.name for b in run.blocks]} for run in block_runs(plan.nodes, plan.collectives) if run.count > 1]
    meta = {
        "title": title, "world_size": plan.world_size, "hardware": plan.hardware, "version": plan.version,
        "fingerprint": plan.fingerprint, "predicted_compute_s": plan.predicted_compute_s,
        "predicted_comm_s": plan.predicted_comm_s, "parameter_bytes_per_rank": plan.parameter_bytes_per_rank,
        "parameter_bytes_total": plan.parameter_bytes_total, "memory_budget_bytes": plan.memory_budget_bytes,
        "collective_counts": plan.collective_counts(), "fallback_ops": list(plan.fallback_ops),
        "plan_time_s": plan.plan_time_s, "solver_status": plan.solver_status,
    }
    return {"meta": meta, "nodes": nodes, "collectives": collectives, "runs": runs}


def _script_json(data: dict) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>`` can close it early)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def to_html(plan: Plan, path: str | os.PathLike | None = None, *, title: str | None = None) -> str:
    """The page's HTML text; also written to ``path`` (UTF-8) when given."""
    title = title or f"autotp plan, tp={plan.world_size}"
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{html.escape(title)}</title>
<script>{_ERROR_SINK}</script>
<style>{_asset("plan_view.css")}</style>
</head>
<body>
<div id="app">
  <aside id="sidebar"></aside>
  <main id="canvas"><div id="graph"></div></main>
  <aside id="details"><pre id="autotp-errors" hidden></pre><div id="details-body"></div></aside>
</div>
<div id="tooltip"></div>
<script type="application/json" id="autotp-plan-data">{_script_json(plan_payload(plan, title))}</script>
<script>{_asset("plan_view.js")}</script>
</body>
</html>
"""
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    return page
