"""Tier (c), property-based: random models compiled at tp=2 and tp=3 on gloo equal the original.

The models (``tests/fuzz_models.py``) compose linear, matmul, elementwise ops, reductions,
reshape/permute, softmax, norms, concat/split, residual adds and attention at random, awkward
sizes (hidden 6 or 10 over 3 ranks, one token). hypothesis draws only the *spec* (plain data);
each rank builds the model from it, so nothing but the spec is pickled.

Tolerance: 1e-4, relative to the output's magnitude where it exceeds 1 (a random stack of
layers can grow values to ~10): a split contraction sums float32 partial products in another
order (a few ulps, ~1e-7 relative per sum), which grows through a few layers to ~1e-6; any
real error (a wrong shard, a double-counted sum, a missing bias) moves outputs by ~1e-2.

CI runs a bounded number of examples (``max_examples`` per world size, no shrinking, so a
failure costs no extra minutes; the failing spec is printed and replays with
``fuzz_models.build``). ``benchmarks/fuzz.py`` runs hundreds more.
"""

from __future__ import annotations

import pytest
from fuzz_models import TOLERANCE, Spec, check_spec, specs
from hypothesis import HealthCheck, Phase, given, settings

EXAMPLES_PER_WORLD_SIZE = 10


@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=EXAMPLES_PER_WORLD_SIZE, deadline=None, database=None, derandomize=False,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow],
          print_blob=True)
@given(spec=specs())
def test_random_model_matches_single_process(gloo, world_size: int, spec: Spec) -> None:
    """tp=2 and tp=3 (uneven whenever hidden or heads do not divide): every rank returns the original outputs."""
    results = gloo.run(world_size, check_spec, spec, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank} crashed: {result['error']}\nspec: {spec}"
        assert result["max_error"] <= TOLERANCE, (
            f"rank {rank}: max error {result['max_error']:.3g} > {TOLERANCE}\nspec: {spec}"
        )
        assert result["collectives"] == results[0]["collectives"], "every rank issues the same collectives"
