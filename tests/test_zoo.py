"""The wide zoo (tests/zoo_models.py) on real gloo ranks, called as a user calls autotp: its own tier.

Every model at world sizes 2 and 3 (4 heads split 2/1/1; Swin's 2 heads at 3 ranks leave one rank without a
head): ``autotp.compile(model, example_inputs=...)`` with every default, ``tp(*args)`` equal to the
single-process model on every rank with its weights really split, and for a causal LM ``tp.generate(ids,
max_new_tokens=6)`` token for token equal to ``model.generate`` (or, for a state that is not a KV cache, refused
with ``UnsupportedModelError``). ``python -m pytest -m zoo`` runs the tier;
``python benchmarks/zoo.py --wide`` prints the same runs as the table of docs/benchmarks/zoo.md.
"""

from __future__ import annotations

import math

import pytest
from zoo_models import REFUSED, ZOO
from zoo_run import TOLERANCE, run_zoo_model

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_equals_the_original(gloo, name: str, world_size: int) -> None:
    """tp=2 and tp=3, defaults, uneven heads at 3: outputs (and greedy tokens of a causal LM) equal the
    single-process model's on every rank, and every rank holds a part, not all, of the split weights; a family whose
    state is not a KV cache is refused with UnsupportedModelError on every rank."""
    results = gloo.run(world_size, run_zoo_model, name, timeout_s=600)
    for r in results:
        assert r["failure"] is None, f"{name} at tp={world_size}, rank {r['rank']}: {r['failure']}\n{r.get('traceback', '')}"
        assert r["error"] <= TOLERANCE, f"{name} at tp={world_size}, rank {r['rank']}: max abs error {r['error']:.3g}"
        assert not math.isnan(r["split_share"]) and r["split_share"] < 1, \
            f"{name} at tp={world_size}, rank {r['rank']}: no weight is split (share {r['split_share']})"
    if ZOO[name].generation is None:
        return
    if ZOO[name].generation == REFUSED:  # a state that is not a KV cache: refused on every rank, naming the model
        for r in results:
            assert (r["generation_failure"] or "").startswith("UnsupportedModelError"), \
                f"{name} at tp={world_size}, rank {r['rank']}: expected UnsupportedModelError, got {r['generation_failure']}"
        return
    for r in results:
        assert r["generation_failure"] is None, \
            f"{name} at tp={world_size}, rank {r['rank']}: generate raised {r['generation_failure']}\n{r.get('traceback', '')}"
        assert r["tokens_equal"], f"{name} at tp={world_size}, rank {r['rank']}: tokens differ from model.generate"
    assert results[0]["distinct_tokens"] > 1, f"{name}: the reference generates one token only; the case cannot tell"
