"""Tracing on meta gives the real model's graph.

Tier (b): capture only, no process group. A model built on the ``meta`` device is traced as if
its tensors lived on the CPU, so its graph (node names, ops, shapes: the plan's fingerprint) is the
one the real model gives, and a plan made on meta applies to the real weights.
"""

from __future__ import annotations

import pytest
from models import BUILDERS, tiny_llama

import autotp
from autotp.capture.tracing import capture
from autotp.planning.checks import check_plan_applies
from autotp.planning.plan import graph_fingerprint

ONE_LAYER = {"llama", "gpt2", "bert", "mistral", "qwen2", "mixtral"}  # builders with a `layers` option


@pytest.mark.slow  # two traces of each of the nine families: about 20 s of CPU; the plan test below stays fast
@pytest.mark.parametrize("name", list(BUILDERS))
def test_meta_and_real_trace_give_the_same_graph(name: str) -> None:
    """No process group: every zoo family, real weights vs the same config on meta (inputs real, then on meta)."""
    options = {"layers": 1} if name in ONE_LAYER else {}
    model, args, kwargs = BUILDERS[name](**options)
    meta_model, _, _ = BUILDERS[name](device="meta", **options)
    real = graph_fingerprint(capture(model, args, kwargs).graph_module)
    on_meta = graph_fingerprint(capture(meta_model, args, kwargs).graph_module)
    assert on_meta == real, f"{name}: fingerprint on meta {on_meta}, real {real}"
    meta_args = tuple(a.to("meta") for a in args)
    all_meta = graph_fingerprint(capture(meta_model, meta_args, kwargs).graph_module)
    assert all_meta == real, f"{name} with meta inputs: fingerprint {all_meta}, real {real}"


def test_plan_made_on_meta_applies_to_real_model() -> None:
    """tp=4, Llama with 8 heads / 4 kv heads: autotp.plan on meta, checked against the real model's graph."""
    meta_model, args, kwargs = tiny_llama(layers=1, device="meta")
    plan = autotp.plan(meta_model, args, kwargs, world_size=4)
    model, _, _ = tiny_llama(layers=1)
    check_plan_applies(plan, capture(model, args, kwargs), 4)  # raises PlanMismatchError on any difference
