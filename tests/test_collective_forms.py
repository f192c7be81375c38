"""The table of collective forms: every form has both halves, and its one cost prices alike on numbers and sympy.

Unit tier (no process group): profiles from ``KNOWN_HARDWARE`` with each form named in ``small_all_reduce``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import sympy
import torch

from autotp.cost_model import KNOWN_HARDWARE, LinkProfile, collective_time_s, link_collective_time_s
from autotp.cost_model.bandwidth import graph_profile
from autotp.cost_model.collective_forms import FORM_TABLE, NUMERIC, SYMBOLIC, CollectiveForm, runs_as
from autotp.cost_model.collectives import backend_time
from autotp.cost_model.symbolic import symbolic_collective_time_s
from autotp.runtime.collectives.inference_collectives import RUNTIME_FORMS

_SHARED = LinkProfile(name="shared-memory-test", bandwidth_gbps=7.5, latency_s=3e-6, base_latency_s=1e-5)


def _profile(form: CollectiveForm):
    """cpu-gloo with ``form`` as its inference all-reduce (and a shared-memory link and cold-call cost)."""
    return dataclasses.replace(KNOWN_HARDWARE["cpu-gloo"], small_all_reduce=form, shared_memory_link=_SHARED,
                               shared_memory_cold_call_s=2e-5, devices_per_node=4)


def test_every_form_has_its_cost_row_and_its_runtime_row_in_the_runtime_order() -> None:
    """Both tables hold every CollectiveForm, keyed alike; the runtime tries the backend's own form last."""
    assert set(FORM_TABLE) == set(CollectiveForm) == set(RUNTIME_FORMS), (
        f"forms {sorted(CollectiveForm)}, cost rows {sorted(FORM_TABLE)}, runtime rows {sorted(RUNTIME_FORMS)}")
    assert list(FORM_TABLE)[-1] is CollectiveForm.RING, f"the backend's form must come last, got {list(FORM_TABLE)}"
    for form, spec in FORM_TABLE.items():
        assert spec.form is form, f"row {form} names {spec.form}"
        assert CollectiveForm.from_name(str(form)) is form
    with pytest.raises(ValueError, match="valid forms: 'ring', 'one_shot'"):
        CollectiveForm.from_name("two_ring")


@pytest.mark.parametrize("form", list(CollectiveForm))
def test_each_form_prices_alike_on_numbers_and_on_expressions_both_sides_of_its_threshold(form) -> None:
    """tp=2, 3, 4 and 8 (over two nodes of 4), every collective kind, float32 and float16: the numeric price
    equals the symbolic one evaluated at the same bytes, below and above the form's byte threshold; and at 2 KiB
    the form's own cost differs from the backend's (so agreeing is not an accident of both being the ring)."""
    hardware = _profile(form)
    bytes_symbol = sympy.Symbol("n", positive=True, integer=True)
    distinguished = False
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for group_size in (2, 3, 4, 8):
            spans = group_size > hardware.devices_per_node
            for dtype in (torch.float32, torch.float16):
                expr = symbolic_collective_time_s(kind, bytes_symbol, group_size, hardware, spans_nodes=spans,
                                                  dtype=dtype)
                for nbytes in (2048, 256 * 1024, 256 * 1024 + 4, 1 << 24):
                    numeric = collective_time_s(kind, nbytes, group_size, hardware, spans_nodes=spans, dtype=dtype)
                    symbolic = float(expr.xreplace({bytes_symbol: nbytes}))
                    assert math.isclose(numeric, symbolic, rel_tol=1e-12), (
                        f"{form} {kind} p={group_size} {dtype} {nbytes} B: numeric {numeric!r}, symbolic {symbolic!r}")
                spec = runs_as(hardware.small_all_reduce, spans_nodes=spans)
                if spec.terms is not None and spec.takes(kind, group_size, 2048, dtype):
                    link = spec.link(hardware.link(spans_nodes=spans), lambda field: getattr(hardware, field))
                    own = spec.own_time(kind, 2048, group_size, link, NUMERIC)
                    ring = backend_time(kind, 2048, group_size, hardware, spans_nodes=spans, algorithm="ring",
                                        arith=NUMERIC)
                    distinguished |= own != ring
    assert distinguished or form is CollectiveForm.RING, f"{form}: no case where its own cost differs from the ring's"


def test_a_form_threshold_stays_in_the_symbolic_price_as_a_piecewise() -> None:
    """tp=4, one-shot profile: the symbolic all-reduce is a Piecewise on the bytes at 256 KiB, whose two branches
    are the row's own cost and the backend's ring."""
    hardware = _profile(CollectiveForm.ONE_SHOT)
    n = sympy.Symbol("n", positive=True)
    spec = FORM_TABLE[CollectiveForm.ONE_SHOT]
    price = spec.time("all_reduce", n, 4, None, group_link=hardware.intra_node, links=lambda field: None,
                      arith=SYMBOLIC,
                      backend=lambda: backend_time("all_reduce", n, 4, hardware, spans_nodes=False, algorithm="ring",
                                                   arith=SYMBOLIC))
    assert isinstance(price, sympy.Piecewise), f"expected a Piecewise, got {price}"
    (own, below), (ring, _) = price.args
    assert below == (n <= spec.max_bytes), f"threshold {below}, expected n <= {spec.max_bytes}"
    assert own != ring, f"both branches are {own}"


def test_training_graphs_take_only_forms_that_run_in_training() -> None:
    """Every inference form: a training graph's profile prices the backend's own collectives."""
    for form, spec in FORM_TABLE.items():
        priced = graph_profile(_profile(form), 1e6, training=True).small_all_reduce
        expected = form if spec.in_training else CollectiveForm.RING
        assert priced == expected, f"{form}: a training graph prices {priced}, expected {expected}"


def test_a_profile_holds_its_form_typed_and_the_explicit_link_price_names_unknown_links() -> None:
    """cpu-gloo given the one-shot form by name holds the enum (equal to the name, and so in JSON); a link that no
    form is priced on is refused by name, where a form's own link prices its calls."""
    profile = dataclasses.replace(KNOWN_HARDWARE["cpu-gloo"], small_all_reduce="shared_memory",
                                  shared_memory_link=_SHARED)
    assert profile.small_all_reduce is CollectiveForm.SHARED_MEMORY, f"got {profile.small_all_reduce!r}"
    assert '"small_all_reduce": "shared_memory"' in profile.to_json(), "the JSON keeps the form's name"
    link = profile.intra_node
    with pytest.raises(TypeError, match="unknown links \\['shared_memory_lnk'\\]"):
        link_collective_time_s("all_reduce", 2048, 4, link, shared_memory_lnk=_SHARED)
    ring = link_collective_time_s("all_reduce", 2048, 4, link)
    shared = link_collective_time_s("all_reduce", 2048, 4, link, small_all_reduce=CollectiveForm.SHARED_MEMORY,
                                    shared_memory_link=_SHARED)
    assert shared != ring, f"the shared-memory link should price the call, got the ring's {ring}"
    assert math.isclose(shared, _SHARED.base_latency_s + 3 * _SHARED.latency_s + 5 * 2048 / _SHARED.bandwidth_bytes_per_s,
                        rel_tol=1e-12), f"shared-memory all-reduce at tp=4: {shared}"
