"""Tests of the tiny test models (tests/models.py), tier (a): no process group, plus one gloo check."""

from __future__ import annotations

import pytest
import torch
from models import BUILDERS, tiny_llama


def _state_checksum(model: torch.nn.Module) -> float:
    return float(sum(t.double().abs().sum().item() for t in model.state_dict().values()))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_builder_is_deterministic_and_runs(name: str) -> None:
    """No parallelism: two builds have equal weights and inputs, forward runs, caller's RNG untouched."""
    rng_before = torch.get_rng_state()
    model_a, args_a, kwargs_a = BUILDERS[name]()
    model_b, args_b, kwargs_b = BUILDERS[name]()
    assert torch.equal(torch.get_rng_state(), rng_before), "builders must not consume the global RNG"
    assert not model_a.training, "builders return models in eval mode"
    state_b = model_b.state_dict()
    for key, value in model_a.state_dict().items():
        assert torch.equal(value, state_b[key]), f"{name}: parameter {key} differs between two builds"
    assert all(torch.equal(a, b) for a, b in zip(args_a, args_b)), f"{name}: example inputs differ"
    assert kwargs_a == kwargs_b
    with torch.no_grad():
        out = model_a(*args_a, **kwargs_a)
    first = out if isinstance(out, torch.Tensor) else out[0]
    assert first.shape[0] == 2, f"{name}: expected batch 2 in the first output, got {tuple(first.shape)}"
    if name != "cnn":
        assert first.shape[:2] == (2, 16), f"{name}: expected (batch 2, seq 16, ...), got {tuple(first.shape)}"
    assert torch.isfinite(first).all(), f"{name}: non-finite output"


@pytest.mark.parametrize("name", list(BUILDERS))
def test_builder_on_meta_device(name: str) -> None:
    """No parallelism: device='meta' builds without storage (for planning tests)."""
    model, _, _ = BUILDERS[name](device="meta")
    assert all(p.is_meta for p in model.parameters()), f"{name}: some parameters are not on meta"


def test_llama_is_grouped_query() -> None:
    """No parallelism: the default Llama has 8 query heads sharing 4 key/value heads."""
    model, _, kwargs = tiny_llama()
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (256, 128), "expected GQA 8 q / 4 kv heads"
    assert model.config._attn_implementation == "sdpa" and kwargs == {"use_cache": False}


def _llama_fingerprint(rank: int, world_size: int) -> tuple[float, float]:
    model, args, kwargs = tiny_llama()
    with torch.no_grad():
        logits = model(*args, **kwargs).logits
    return _state_checksum(model), float(logits.double().sum().item())


def test_every_rank_builds_the_same_llama(gloo) -> None:
    """tp=2, real gloo processes: both ranks build identical weights and get identical logits."""
    results = gloo.run(2, _llama_fingerprint)
    assert results[0] == results[1], f"ranks disagree: rank 0 {results[0]}, rank 1 {results[1]}"
    assert results[0] == _llama_fingerprint(0, 1), "workers and the test process disagree"
