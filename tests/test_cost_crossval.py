"""Cross-validation by family of a calibrated profile's in-graph terms (``autotp.cost_model.crossval``).

Tier (a): pure functions on synthetic observations and a named profile; no process group.
"""

from __future__ import annotations

import dataclasses

import pytest

from autotp.cost_model import get_hardware
from autotp.cost_model.crossval import (
    TERMS,
    Observation,
    cross_validate,
    family_folds,
    fitted_numbers,
    subsets,
    without,
)
from autotp.cost_model.hardware import KNOWN_HARDWARE


def _calibrated_like():
    """cpu-gloo with every in-graph term set, as a calibration would leave them."""
    return dataclasses.replace(get_hardware("cpu-gloo"), model_call_s=3e-5,
                               op_fixed_s=(("convolution", 4e-5),), collective_wait_s=3e-4, call_sync_wait_s=1e-4,
                               call_sync_wait_per_compute=0.1, core_share=0.5,
                               memory_bandwidth_curve=((2**20, 40.0), (2**28, 10.0)))


def test_without_leaves_out_only_the_named_terms():
    """Removing a term zeroes its fields and nothing else; core_share is undone by alone(); unknown names raise."""
    profile = _calibrated_like()
    bare = without(profile, ["model_call", "op_fixed"])
    assert (bare.model_call_s, bare.op_fixed_s) == (0.0, ()), bare
    assert bare.collective_wait_s == profile.collective_wait_s and bare.core_share == profile.core_share
    whole_core = without(profile, ["core_share"])
    assert whole_core.core_share == 1.0
    assert whole_core.host_dispatch_s == pytest.approx(profile.host_dispatch_s * 0.5)
    with pytest.raises(ValueError, match="unknown term"):
        without(profile, ["model_calls"])


def test_subsets_and_folds():
    """Every subset of the terms once, every term kept first; each family in exactly one fold."""
    everything = subsets()
    assert len(everything) == 2 ** len(TERMS) and everything[0] == frozenset(), len(everything)
    assert len(set(everything)) == len(everything)
    folds = family_folds(["a", "b", "c", "d", "e"], 2)
    assert folds == (("a", "c", "e"), ("b", "d")), folds
    with pytest.raises(ValueError, match="k must be"):
        family_folds(["a", "b"], 3)


def _observations(needs_op_fixed: str) -> list[Observation]:
    """Four families at tp 1 and 2: leaving out model_call makes every prediction 20% high; leaving out
    op_fixed makes only ``needs_op_fixed`` 50% low; no other term changes anything."""
    rows = []
    for family in ("mlp", "llama", "gpt2", "cnn"):
        for world_size in (1, 2):
            predicted = {removed: 1.0 * (1.2 if "model_call" in removed else 1.0)
                         * (0.5 if family == needs_op_fixed and "op_fixed" in removed else 1.0)
                         for removed in subsets()}
            rows.append(Observation(family, world_size, 0, 1.0, predicted))
    return rows


def test_a_term_only_the_held_out_family_needs_shows_as_held_out_error():
    """A term that only one family needs is dropped by folds that hold that family out (fewest terms win ties),
    so that family's held-out error shows it while the fitted error stays 0."""
    report = cross_validate(_observations("cnn"), ["mlp", "llama", "gpt2", "cnn"], 4)
    held_out = report.held_out_errors()
    assert held_out[("cnn", 1)] == pytest.approx(-0.5) and held_out[("cnn", 2)] == pytest.approx(-0.5), held_out
    assert held_out[("mlp", 1)] == pytest.approx(0.0), held_out
    assert report.fitted_median(1) == pytest.approx(0.0) and report.held_out_median(1) == pytest.approx(0.0)
    cnn_fold = next(fold for fold in report.folds if fold.held_out == ("cnn",))
    assert cnn_fold.kept == ("model_call",), cnn_fold
    other = next(fold for fold in report.folds if fold.held_out == ("mlp",))
    assert other.kept == ("op_fixed", "model_call"), other


def test_cross_validate_needs_every_subset_priced():
    rows = [dataclasses.replace(o, predicted_s={frozenset(): 1.0}) for o in _observations("cnn")]
    with pytest.raises(ValueError, match="price every"):
        cross_validate(rows, ["mlp", "llama", "gpt2", "cnn"], 2)


def test_fitted_numbers_count_what_pricing_uses():
    """A named profile has no in-graph term (every datasheet profile: removing every term changes no count); a
    calibrated-like one counts each; removed terms count 0."""
    profile = _calibrated_like()
    counts = fitted_numbers(profile)
    assert counts["model_call_s"] == 1 and counts["op_fixed_s"] == 1 and counts["memory_bandwidth_curve"] == 2
    assert counts["core_share"] == 1 and counts["intra_node"] == 3, counts
    fewer = fitted_numbers(profile, ["model_call", "working_set_bandwidth"])
    assert sum(counts.values()) - sum(fewer.values()) == 3, (counts, fewer)
    assert fitted_numbers(get_hardware("cpu-gloo"))["core_share"] == 0
    for name, profile in KNOWN_HARDWARE.items():  # the datasheet profiles: no CPU-fitted term reaches their pricing
        in_graph = fitted_numbers(profile)
        every_term = fitted_numbers(profile, [term.name for term in TERMS])
        assert in_graph == every_term, f"{name} holds in-graph terms: " + ", ".join(
            field for field, count in in_graph.items() if count != every_term[field])
