"""The ordinary Hugging Face calls on a tensor-parallel model: ``autotp.compile(model, example_inputs=(ids,))``
with no ``example_kwargs``, ``tp(ids)`` with or without ``use_cache=``, ``tp.generate(ids, max_new_tokens=N)``
after a plain compile, and the same calls after ``autotp.from_pretrained`` and ``autotp.load``.

The models keep HF's default ``config.use_cache=True`` (tests/models.py's builders turn it off): left to
itself, their forward returns a ``DynamicCache``. Tier (c) compares with the single-process model (logits
within tolerance, greedy tokens exactly); the unit tests check the request and cache-size rules alone.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import tiny_llama

import autotp
from autotp.adapters.hf_transformers import call_kwargs, takes_use_cache, traced_kwargs
from autotp.runtime.generation.generate import resolve_request
from autotp.runtime.generation.generation_on_demand import MIN_CACHE_LEN, cache_length

TOLERANCE = 1e-4
NEW_TOKENS = 8


def _llama(seq_len: int = 64, batch: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """tiny Llama (8 heads, 4 kv heads, max_position_embeddings = max(64, seq_len)) with HF's default
    use_cache=True, and its token ids (batch, 6)."""
    model, (ids,), _ = tiny_llama(batch=batch, seq_len=seq_len)
    model.config.use_cache = True
    model.generation_config.pad_token_id = 0  # no "setting pad_token_id" warning from HF generate
    return model, ids[:, :6]


def _logits_error(output: Any, expected: torch.Tensor) -> float:
    return (output.logits - expected).abs().max().item()


def _plain_calls(rank: int, world_size: int, trace_cache: str) -> dict[str, Any]:
    model, ids = _llama(seq_len=128)
    with torch.no_grad():
        reference = model(ids)
    hf_greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    long_ids = torch.randint(3, 1000, (2, 62), generator=torch.Generator().manual_seed(5))
    hf_long = model.generate(long_ids, attention_mask=torch.ones_like(long_ids), max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,), runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    outputs = {"plain": tp(ids), "use_cache=False": tp(ids, use_cache=False), "use_cache=True": tp(ids, use_cache=True),
               "use_cache=None": tp(ids, use_cache=None)}
    one_row = tp.generate(ids[:1], max_new_tokens=NEW_TOKENS)  # builds a 1-row cache of 64 slots
    first = tp.generation_on_demand.built
    first_size = (first.generation.layout.batch_size, first.generation.layout.max_cache_len)
    shared = sum(a is b for a in first.parameters() for b in tp.parameters())
    got = tp.generate(ids, max_new_tokens=NEW_TOKENS)  # 2 rows: built again
    second = tp.generation_on_demand.built
    again = tp.generate(ids[:1], max_new_tokens=NEW_TOKENS)  # fits: no new build
    kept = tp.generation_on_demand.built is second
    by_length = tp.generate(ids, max_length=6 + NEW_TOKENS)
    config = type(model.generation_config)(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    by_config = tp.generate(ids, generation_config=config, max_length=9)  # max_new_tokens (the config's) wins
    default = tp.generate(ids)  # the model's generation_config sets no length: 20 new tokens (HF's default)
    hf_default = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    longer = tp.generate(long_ids, max_new_tokens=4)  # 66 tokens: a 128-slot cache
    return {
        "types": {name: type(out).__name__ for name, out in outputs.items()},
        "reference_type": type(reference).__name__,
        "errors": {name: _logits_error(out, reference.logits) for name, out in outputs.items()},
        "caches": {name: out.past_key_values for name, out in outputs.items()},
        "greedy": (got.tolist(), hf_greedy.tolist()),
        "one_row": (one_row.tolist(), hf_greedy[:1].tolist()),
        "again": (again.tolist(), hf_greedy[:1].tolist()),
        "by_length": (by_length.tolist(), hf_greedy.tolist()),
        "by_config": (by_config.tolist(), hf_greedy.tolist()),
        "default": (default.tolist(), hf_default.tolist()),
        "longer": (longer.tolist(), hf_long.tolist()),
        "sizes": [first_size, (second.generation.layout.batch_size, second.generation.layout.max_cache_len),
                  (tp.generation_on_demand.built.generation.layout.batch_size,
                   tp.generation_on_demand.built.generation.layout.max_cache_len)],
        "kept": kept, "shared": shared,
    }


def test_plain_compile_calls_and_generates_like_hf(gloo, trace_cache: str) -> None:
    """tp=2, tiny Llama with use_cache=True in its config, compiled with example_inputs=(ids,) only: tp(ids) with
    use_cache left out, False, True or None gives HF's output type with the model's logits and no cache part;
    tp.generate builds its cache on first use (1 row x 64 slots), again for 2 rows and for 62 + 4 tokens (128
    slots), and gives HF's greedy tokens for max_new_tokens, max_length, a generation_config and the model's
    defaults; the generation graphs hold the forward module's weight shards where placed alike. The programs
    it traces go to the session's trace cache, from which the later tests of this file rebuild the same ones."""
    results = gloo.run(2, _plain_calls, trace_cache)
    for rank, result in enumerate(results):
        for name, error in result["errors"].items():
            assert error < TOLERANCE, f"rank {rank}, tp(ids) with {name}: max |tp - model| logits = {error}"
        assert set(result["types"].values()) == {result["reference_type"]}, (
            f"rank {rank}: output types {result['types']}, expected {result['reference_type']}")
        assert all(cache is None for cache in result["caches"].values()), f"rank {rank}: caches {result['caches']}"
        for case in ("greedy", "one_row", "again", "by_length", "by_config", "default", "longer"):
            got, expected = result[case]
            assert got == expected, (
                f"rank {rank}, {case}: tokens differ from HF generate:\n expected {expected}\n got {got}")
        assert result["sizes"] == [(1, MIN_CACHE_LEN), (2, MIN_CACHE_LEN), (2, 128)], (
            f"rank {rank}: caches built (rows, slots) {result['sizes']}, expected [(1, 64), (2, 64), (2, 128)]")
        assert result["kept"], f"rank {rank}: a request that fits the 2-row cache built another"
        assert result["shared"] > 0, f"rank {rank}: the generation graphs share no weight with the forward module"


def _save_and_load(rank: int, world_size: int, pretrained: str, saved: str) -> dict[str, Any]:
    model, ids = _llama()
    with torch.no_grad():
        reference = model(ids).logits
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if world_size == 2:
            tp = autotp.from_pretrained(pretrained, world_size=2, example_inputs=(ids,))
            results["from_pretrained"] = [_logits_error(tp(ids, **kwargs), reference)
                                          for kwargs in ({}, {"use_cache": False}, {"use_cache": True})]
            tp.save(saved)
            return results
        meta = tiny_llama(device="meta")[0]
        meta.config.use_cache = True
        tp = autotp.load(saved, meta, world_size=3, example_inputs=(ids,))
    results["load"] = [_logits_error(tp(ids, **kwargs), reference) for kwargs in ({}, {"use_cache": True})]
    return results


def test_from_pretrained_and_load_take_plain_calls(gloo, tmp_path: Path) -> None:
    """tp=2 from_pretrained of a checkpoint whose config has use_cache=True, then tp.save; tp=3 (uneven: 4 kv
    heads) autotp.load of that directory into a meta model with example_inputs=(ids,) only: tp(ids) with and
    without use_cache equals the model's logits (generate after them: tests/test_checkpoint_generation.py)."""
    model, _ = _llama()
    model.save_pretrained(tmp_path / "hf")
    pretrained = gloo.run(2, _save_and_load, str(tmp_path / "hf"), str(tmp_path / "saved"))
    for rank, result in enumerate(pretrained):
        errors = result["from_pretrained"]
        assert max(errors) < TOLERANCE, f"rank {rank}: from_pretrained errors {errors}"
    loaded = gloo.run(3, _save_and_load, str(tmp_path / "hf"), str(tmp_path / "saved"))
    for rank, result in enumerate(loaded):
        assert max(result["load"]) < TOLERANCE, f"rank {rank}: load errors {result['load']}"


def _forward_of_a_generation_compile(rank: int, world_size: int, pretrained: str, trace_cache: str) -> dict[str, Any]:
    model, ids = _llama(seq_len=128)
    other = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference, reference_other = model(ids).logits, model(other).logits
    hf_greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime = autotp.RuntimeOptions(trace_cache=trace_cache)
        tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=64, runtime=runtime)
        results["before"] = tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist()
        out = tp(ids)
        plain = tp.forward_on_demand.built
        results["shared"] = sum(a is b for a in plain.parameters() for b in tp.parameters())
        results["held"] = sum(1 for _ in plain.parameters())
        out_other = tp(other, use_cache=False)  # another batch and length: the same module
        results["kept"] = tp.forward_on_demand.built is plain
        results["after"] = tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist()
        meta = tiny_llama(device="meta", seq_len=128)[0]
        meta.config.use_cache = True
        from_files = autotp.compile(meta, example_inputs=(ids,), checkpoint=pretrained, max_cache_len=64,
                                    runtime=runtime)
        results["from_checkpoint"] = _logits_error(from_files(ids), reference)
    results["type"] = type(out).__name__
    results["errors"] = [_logits_error(out, reference), _logits_error(out_other, reference_other)]
    results["hf"] = hf_greedy.tolist()
    return results


def test_a_generation_compile_runs_the_models_forward_when_called_as_the_model(gloo, tmp_path: Path,
                                                                                 trace_cache: str) -> None:
    """tp=2, tiny Llama compiled with max_cache_len=64: tp(ids) compiles the plain forward at its first call (the
    model's output type and logits), which serves another batch and length without compiling again and holds the
    generation graphs' weight shards where placed alike; generate gives HF's greedy tokens before and after; a
    model on meta compiled from its checkpoint with max_cache_len does the same from the files. Both compiles go
    through the session's trace cache: the meta model's generation graphs are the real model's programs, rebuilt
    (tracing a meta model for generation: tests/test_checkpoint_generation.py)."""
    model, _ = _llama(seq_len=128)
    model.save_pretrained(tmp_path / "hf")
    for rank, result in enumerate(gloo.run(2, _forward_of_a_generation_compile, str(tmp_path / "hf"), trace_cache)):
        assert result["type"] == "CausalLMOutputWithPast", f"rank {rank}: {result['type']}"
        assert max(result["errors"]) < TOLERANCE, f"rank {rank}: max |tp - model| logits {result['errors']}"
        assert result["from_checkpoint"] < TOLERANCE, f"rank {rank}: from the checkpoint {result['from_checkpoint']}"
        assert result["kept"], f"rank {rank}: a second plain call compiled the forward again"
        assert 0 < result["shared"] <= result["held"], (
            f"rank {rank}: the forward shares {result['shared']} of its {result['held']} weight shards")
        assert result["before"] == result["hf"] and result["after"] == result["hf"], (
            f"rank {rank}: tokens differ from HF's greedy {result['hf']}: before {result['before']}, "
            f"after {result['after']}")


def _requests_differ(rank: int, world_size: int, trace_cache: str) -> dict[str, str]:
    import gc

    from autotp.base.errors import AgreementError

    model, ids = _llama(seq_len=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,), runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    messages = {}
    try:  # rank 0 asks for a 64-slot cache, rank 1 for 128: no rank may trace a graph the other does not
        tp.generate(ids, max_new_tokens=4 if rank == 0 else 60)
        messages["differ"] = "no error"
    except AgreementError as exc:
        messages["differ"] = str(exc)
    del model
    gc.collect()
    try:
        tp.generate(ids, max_new_tokens=4)
        messages["freed"] = "no error"
    except ValueError as exc:
        messages["freed"] = str(exc)
    messages["still_calls"] = str(type(tp(ids)).__name__)
    return messages


def test_generate_on_demand_agrees_and_needs_the_model(gloo, trace_cache: str) -> None:
    """tp=2, tiny Llama compiled plainly: ranks asking for different requests (64 vs 128 cache slots) get the
    same AgreementError before anything is traced; once the model is gone, generate says to keep it or to
    compile with max_cache_len, and tp(ids) still works (the plain compile rebuilds the program traced above)."""
    results = gloo.run(2, _requests_differ, trace_cache)
    for rank, messages in enumerate(results):
        assert "max_cache_len: rank 0 64; rank 1 128" in messages["differ"], f"rank {rank}: {messages['differ']!r}"
        assert "no longer exists" in messages["freed"] and "max_cache_len=N" in messages["freed"], (
            f"rank {rank}: {messages['freed']!r}")
        assert messages["still_calls"] == "CausalLMOutputWithPast", f"rank {rank}: {messages['still_calls']}"


def test_hf_models_are_traced_without_the_cache() -> None:
    """No process group: a HF model's example kwargs get use_cache=False (whatever they said), other modules'
    stay as given; a call's use_cache (left out, None, True, False) becomes the traced False."""
    model, _ = _llama()
    assert takes_use_cache(model), "LlamaForCausalLM takes use_cache"
    assert traced_kwargs(model, {}) == {"use_cache": False}
    assert traced_kwargs(model, {"use_cache": True, "attention_mask": 1}) == {"use_cache": False, "attention_mask": 1}
    linear = torch.nn.Linear(2, 2)
    assert not takes_use_cache(linear) and traced_kwargs(linear, {"a": 1}) == {"a": 1}
    for value in (None, True, False):
        assert call_kwargs({"use_cache": value}) == {"use_cache": False}, value
    assert call_kwargs({}) == {"use_cache": False}
    with pytest.raises(TypeError, match="use_cache must be"):
        call_kwargs({"use_cache": "yes"})


def test_request_settings_follow_hf_precedence() -> None:
    """No process group: max_new_tokens (the call's or the config's) wins over max_length, the call's values over
    the config's, a generation_config replaces the model's, HF's defaults fill the rest; no room for a new token
    is an error."""
    from transformers import GenerationConfig

    ids = torch.zeros(2, 6, dtype=torch.long)
    model_config = GenerationConfig(max_length=30, eos_token_id=2, top_k=10)
    given = {"max_new_tokens": None, "max_length": None}
    assert resolve_request(ids, given, None, model_config).max_new_tokens == 24
    assert resolve_request(ids, {**given, "max_length": 10}, None, model_config).max_new_tokens == 4
    assert resolve_request(ids, {"max_new_tokens": 3, "max_length": 10}, None, model_config).max_new_tokens == 3
    five_new = GenerationConfig(max_new_tokens=5)
    assert resolve_request(ids, {**given, "max_length": 10}, five_new, None).max_new_tokens == 5
    sampling = GenerationConfig(max_new_tokens=5, max_length=100, do_sample=True)
    request = resolve_request(ids, given, sampling, model_config)
    got = (request.max_new_tokens, request.do_sample, request.top_k, request.eos_token_id)
    assert got == (5, True, 50, None), request
    request = resolve_request(ids, {**given, "top_k": 7}, None, model_config)
    assert (request.top_k, request.eos_token_id, request.temperature) == (7, 2, 1.0), request
    assert resolve_request(ids, given, None, None).max_new_tokens == 20  # HF's default: 20 new tokens
    assert resolve_request(ids, given, None, GenerationConfig()).max_new_tokens == 20
    with pytest.raises(ValueError, match="max_length=6 .* leaves no new token after a prompt of 6"):
        resolve_request(ids, {**given, "max_length": 6}, None, model_config)


def test_cache_length_rounds_up_and_caps() -> None:
    """No process group: a power of two, at least 64, at most max_position_embeddings; more than that is an error."""
    cases = {(14, 2048): 64, (64, 2048): 64, (65, 2048): 128, (300, 2048): 512, (300, 400): 400, (14, None): 64,
             (40, 50): 50}
    for (needed, limit), expected in cases.items():
        got = cache_length(needed, limit)
        assert got == expected, f"cache_length({needed}, {limit}) = {got}, expected {expected}"
    with pytest.raises(ValueError, match="max_position_embeddings=64; pass a max_new_tokens 6 smaller"):
        cache_length(70, 64)
