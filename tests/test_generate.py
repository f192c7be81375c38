"""Text generation with a sharded KV cache: ``autotp.compile(..., max_cache_len=N)`` + ``tp.generate``.

Tier (c), real gloo processes: each rank compiles the same tiny random model and generates; the
tokens must equal HuggingFace's single-process ``model.generate`` exactly (greedy), and seeded
sampling must give the same tokens on every rank and in one process. Tiny configs, at most 8
new tokens; the prompt is 6 or 8 tokens.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from generation_models import tiny_deepseek_v3, tiny_gemma, tiny_gpt_oss, tiny_phi, tiny_recurrent
from models import tiny_bert, tiny_gpt2, tiny_llama, tiny_mistral, tiny_mixtral, tiny_qwen2

import autotp

pytestmark = pytest.mark.distributed

FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "mistral": tiny_mistral, "qwen2": tiny_qwen2,
            "gemma": tiny_gemma, "phi": tiny_phi, "mixtral": tiny_mixtral}
NEW_TOKENS = 8


def _model(family: str, prompt: int) -> tuple[torch.nn.Module, torch.Tensor]:
    model, (ids,), _ = FAMILIES[family](batch=2, seq_len=prompt)
    model.generation_config.pad_token_id = 0  # no "setting pad_token_id" warning from HF generate
    return model, ids


def _compile(model: torch.nn.Module, ids: torch.Tensor, chunk: int, max_cache_len: int,
             trace_cache: str | None = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.compile(model, example_inputs=(ids[:, :chunk],), max_cache_len=max_cache_len,
                              runtime=autotp.RuntimeOptions(trace_cache=trace_cache))


def _greedy(rank: int, world_size: int, family: str, chunk: int, prompt: int,
            trace_cache: str | None = None) -> dict[str, Any]:
    """Greedy tokens of ``family`` compiled for generation (through ``trace_cache`` where given: the same model and
    chunk at another world size rebuild the programs traced first) against HF's, and what the graphs did."""
    model, ids = _model(family, prompt)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    tp = _compile(model, ids, chunk, max_cache_len=32, trace_cache=trace_cache)
    graphs = [tp.graph_module] + [g.graph_module for g in (tp.generation.prefill, tp.generation.continuation)
                                  if g is not None]
    calls = [0]
    hooks = [g.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for g in graphs]
    codes = [g.code for g in graphs]
    got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
    for hook in hooks:
        hook.remove()
    return {
        "got": got.tolist(), "expected": expected.tolist(), "calls": calls[0],
        "same_graphs": [g.code for g in graphs] == codes,
        "cache_bytes": tp.cache_bytes(), "cache_placements": {k: v for k, v in tp.plan.parameters.items() if "cache" in k},
        # single process: layers x (keys, values) x batch 2 x 32 slots x kv heads x head dim x 4 bytes
        "full_cache_bytes": model.config.num_hidden_layers * 2 * 2 * 32 * _kv_width(model) * 4,
    }


def _kv_width(model: torch.nn.Module) -> int:
    """kv heads x head dim of one cache row slot (from the config)."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads * head_dim


def _check_greedy(results: list[dict[str, Any]], graph_calls: int) -> None:
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], (
            f"rank {rank}: tokens differ from HF generate(do_sample=False):\n expected {result['expected']}\n"
            f" got      {result['got']}")
        assert result["calls"] == graph_calls, f"rank {rank}: {result['calls']} graph calls, expected {graph_calls}"
        assert result["same_graphs"], f"rank {rank}: a graph changed during generate (re-traced or recompiled)"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_llama_greedy_matches_hf(gloo, world_size: int, trace_cache: str) -> None:
    """tp=2, 3 (uneven: 4 kv heads over 3 ranks), 4; tiny Llama (GQA 8/4 heads), batch 2, prompt 6, 8 new tokens.

    Prompts go 4 tokens per call at tp=2 and 3 (chunks at 0 through the prefill graph, which attends to the
    chunk only, and at 2 through the continuation graph, which rereads two tokens and attends to the cache;
    both attend with enable_gqa, at tp=3 over 4 kv heads split unevenly), one token per decode call at tp=4. Exactly one graph call per prompt
    chunk and per new token after the first; the cache is split by kv heads, ~1/ws per rank. The generation graphs
    go through the session's trace cache: tp=3 rebuilds the programs tp=2 traced (the same model and chunk).
    """
    chunk = 4 if world_size in (2, 3) else 1
    results = gloo.run(world_size, _greedy, "llama", chunk, 6, trace_cache)
    prompt_calls = 2 if chunk == 4 else 6
    _check_greedy(results, prompt_calls + NEW_TOKENS - 1)
    for rank, result in enumerate(results):
        assert set(result["cache_placements"].values()) == {"S(1)"}, f"rank {rank}: {result['cache_placements']}"
    full = results[0]["full_cache_bytes"]
    total = sum(r["cache_bytes"] for r in results)
    assert total == full, f"cache bytes summed over ranks {total} != single process {full}"
    largest, expected = max(r["cache_bytes"] for r in results), full * -(-4 // world_size) // 4  # 4 kv heads
    assert largest == expected, f"largest rank's cache {largest} bytes, expected {expected} (ceil(4/{world_size}) of 4 kv heads)"


@pytest.mark.parametrize("family,world_size", [("gpt2", 2), ("mistral", 3), ("qwen2", 3), ("gemma", 2), ("phi", 2),
                                               ("mixtral", 2)])
def test_family_greedy_matches_hf(gloo, family: str, world_size: int) -> None:
    """tp=2 or 3, GPT-2 (fused QKV, tied head), Mistral (sliding window 8 < 14 tokens), Qwen2 (2 kv heads over
    3 ranks), Gemma (MQA: 1 kv head, so the cache stays whole), Phi, Mixtral (MoE): greedy equals HF."""
    results = gloo.run(world_size, _greedy, family, 1, 6)
    _check_greedy(results, 6 + NEW_TOKENS - 1)


def _sample(rank: int, world_size: int, seed: int, trace_cache: str) -> dict[str, Any]:
    model, ids = _model("llama", 6)
    options = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "max_new_tokens": NEW_TOKENS}
    torch.manual_seed(seed)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    tp = _compile(model, ids, 1, max_cache_len=16, trace_cache=trace_cache)
    return {"got": tp.generate(ids, seed=seed, **options).tolist(), "expected": expected.tolist()}


def test_seeded_sampling_same_on_every_rank_and_as_one_process(gloo, trace_cache: str) -> None:
    """tp=2, tiny Llama, temperature 0.7, top-k 50, top-p 0.9, seed 3: every rank draws the tokens
    that HF generate draws in one process after torch.manual_seed(3). This test and the next two compile the same
    model with a 16-slot cache through the session's trace cache: the first traces, the others rebuild."""
    results = gloo.run(2, _sample, 3, trace_cache)
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], (
            f"rank {rank}: sampled tokens differ from one process:\n expected {result['expected']}\n got {result['got']}")


def _padding_and_eos(rank: int, world_size: int, trace_cache: str) -> dict[str, Any]:
    model, ids = _model("llama", 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is a 4-token prompt, left-padded
    ids = ids.masked_fill(mask == 0, 0)
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    eos = int(padded[0, 6 + 2])  # row 0 says it at its 3rd new token
    stopped = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=7)
    tp = _compile(model, ids, 4, max_cache_len=16, trace_cache=trace_cache)
    tokens: list[list[int]] = []

    class Streamer:
        def put(self, value: torch.Tensor) -> None:
            tokens.append(value.tolist())

        def end(self) -> None:
            tokens.append(["end"])

    return {
        "padded": (tp.generate(ids, mask, max_new_tokens=NEW_TOKENS).tolist(), padded.tolist()),
        "eos": (tp.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7,
                            streamer=Streamer()).tolist(), stopped.tolist()),
        "streamed": tokens,
        "one_row": (tp.generate(ids[:1], max_new_tokens=4).tolist(), padded[:1, :10].tolist()),
    }


def test_left_padding_eos_streamer_and_smaller_batch(gloo, trace_cache: str) -> None:
    """tp=2, tiny Llama, batch 2 with row 1 left-padded by 2: equals HF generate with the same mask;
    with an eos id it stops like HF (finished rows padded with pad_token_id); the streamer sees the
    prompt, each step's tokens, then end(); a 1-row call on the 2-row cache equals HF's row 0."""
    results = gloo.run(2, _padding_and_eos, trace_cache)
    for rank, result in enumerate(results):
        for case in ("padded", "eos", "one_row"):
            got, expected = result[case]
            assert got == expected, f"rank {rank}, {case}: expected {expected}\n got {got}"
        got_eos = result["eos"][0]
        expected_stream = [[row[:6] for row in got_eos]] + [[row[i] for row in got_eos] for i in range(6, len(got_eos[0]))]
        assert result["streamed"] == expected_stream + [["end"]], (
            f"rank {rank}: streamer got {result['streamed']}, expected {expected_stream + [['end']]}")


def _whole_model(rank: int, world_size: int, trace_cache: str) -> dict[str, Any]:
    model, ids = _model("llama", 6)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids[:, :4],), max_cache_len=16,
                            options=autotp.PlanOptions(constraints={"*": "R"}),
                            runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    graphs = [tp.graph_module, tp.generation.prefill.graph_module, tp.generation.continuation.graph_module]
    calls = [0]
    hooks = [g.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for g in graphs]
    streamed: list[Any] = []

    class Streamer:
        def put(self, value: torch.Tensor) -> None:
            streamed.append(value.tolist())

        def end(self) -> None:
            streamed.append("end")

    got = tp.generate(ids, max_new_tokens=NEW_TOKENS, streamer=Streamer())
    for hook in hooks:
        hook.remove()
    collectives = len(tp.generation.decode_plan.collectives) + len(tp.generation.prefill_plan.collectives)
    return {"got": got.tolist(), "expected": expected.tolist(), "calls": calls[0], "streamed": streamed,
            "collectives": collectives}


def test_a_whole_model_plan_runs_on_the_first_rank_only(gloo, trace_cache: str) -> None:
    """tp=2 gloo, tiny Llama with every weight pinned whole (no collective in either phase): rank 0 alone runs
    the graphs, and both ranks return HF's greedy tokens; rank 1's streamer gets the same calls afterwards."""
    results = gloo.run(2, _whole_model, trace_cache)
    assert [r["collectives"] for r in results] == [0, 0], f"the pinned plans issue collectives: {results}"
    assert results[0]["calls"] > 0 and results[1]["calls"] == 0, (
        f"graph calls by rank: {[r['calls'] for r in results]}, expected rank 0 only")
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], f"rank {rank}: {result['got']} != HF {result['expected']}"
    assert results[1]["streamed"] == results[0]["streamed"], (
        f"streamer calls differ: rank 0 {results[0]['streamed']}\nrank 1 {results[1]['streamed']}")
    assert results[0]["streamed"][-1] == "end" and len(results[0]["streamed"]) == NEW_TOKENS + 2, results[0]["streamed"]


def _prompt_together(rank: int, world_size: int) -> dict[str, Any]:
    model, ids = _model("llama", 48)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # every weight whole: decode (one token) has nothing to split, while the 48-token prefill splits its
        # tokens across the ranks on the cpu-gloo profile and gathers them (collectives in one phase only)
        tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=64,
                            options=autotp.PlanOptions(memory_budget=None, constraints={"*.weight": "R"}, hardware="cpu-gloo"))
    calls = {"decode": 0, "prefill": 0}
    for phase, graph in (("decode", tp.graph_module), ("prefill", tp.generation.prefill.graph_module)):
        graph.register_forward_pre_hook(lambda *_, phase=phase: calls.__setitem__(phase, calls[phase] + 1))
    got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
    return {"got": got.tolist(), "expected": expected.tolist(), "calls": calls,
            "collectives": (tp.generation.decode_plan.collective_counts(),
                            tp.generation.prefill_plan.collective_counts())}


def test_prompt_on_every_rank_then_the_first_rank_decodes_alone(gloo) -> None:
    """tp=2 gloo, tiny Llama with every weight whole, prompt 48 tokens in one prefill chunk: the prefill plan
    gathers (collectives), the decode plan has none. Both ranks run the prompt together, only rank 0 decodes,
    and both return HF's greedy tokens."""
    results = gloo.run(2, _prompt_together)
    decode, prefill = results[0]["collectives"]
    assert decode == {} and prefill, f"expected collectives in prefill only, got decode {decode}, prefill {prefill}"
    calls = [r["calls"] for r in results]
    assert calls == [{"decode": NEW_TOKENS - 1, "prefill": 1}, {"decode": 0, "prefill": 1}], (
        f"graph calls by rank: {calls}; expected the prompt on both ranks and {NEW_TOKENS - 1} decode calls on rank 0")
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], f"rank {rank}: {result['got']} != HF {result['expected']}"


def _errors(rank: int, world_size: int) -> dict[str, str]:
    model, ids = _model("llama", 6)
    tp = _compile(model, ids, 1, max_cache_len=10)
    calls = [0]
    tp.graph_module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    messages = {}
    cases = {
        "too_long": lambda: tp.generate(ids, max_new_tokens=5),
        "batch": lambda: tp.generate(torch.cat([ids, ids]), max_new_tokens=2),
        "sample_no_seed": lambda: tp.generate(ids, max_new_tokens=2, do_sample=True),
    }
    for name, call in cases.items():
        try:
            call()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)
    messages["calls"] = str(calls[0])
    bert, bert_args, _ = tiny_bert()
    try:
        autotp.compile(bert, example_inputs=bert_args, max_cache_len=16)
        messages["no_head"] = "no error"
    except TypeError as exc:
        messages["no_head"] = str(exc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = autotp.compile(bert, example_inputs=bert_args)  # not a causal LM: builds no generation graphs
    try:
        plain.generate(bert_args[0], max_new_tokens=2)
        messages["no_cache"] = "no error"
    except TypeError as exc:
        messages["no_cache"] = str(exc)
    return messages


def test_bad_generation_input(gloo) -> None:
    """tp=2, tiny Llama with a 10-slot cache for 2 rows: prompt 6 + 5 new tokens, 4 rows, sampling without
    a seed are ValueErrors naming the numbers, all raised before any graph call (tp(ids) runs the model's
    forward: tests/test_hf_calls.py); a model without an LM head
    (BertModel) and that model compiled without max_cache_len (no causal LM: no generation graphs on demand)
    are TypeErrors that say what to do. (A plain compile of a causal LM generates: tests/test_hf_calls.py.)"""
    messages = gloo.run(2, _errors)[0]
    assert "prompt (6 tokens) plus max_new_tokens=5" in messages["too_long"] and "max_cache_len=10" in messages["too_long"], messages
    assert "4 rows" in messages["batch"] and "built for 2" in messages["batch"], messages
    assert "seed=" in messages["sample_no_seed"], messages
    assert messages["calls"] == "0", f"graph calls before the errors: {messages['calls']}, expected 0"
    assert "not a HuggingFace causal language model" in messages["no_head"], messages
    assert "max_cache_len=N" in messages["no_cache"], messages


def _full_cache_bytes(model: torch.nn.Module, batch: int, max_cache_len: int) -> int:
    """Bytes of the whole KV cache in one process: the cache wrapper's buffers, shaped as the model writes them."""
    from autotp.capture.kv_cache import CachedCausalLM

    wrapper = CachedCausalLM(model, batch_size=batch, max_cache_len=max_cache_len)
    return sum(b.numel() * b.element_size() for name, b in wrapper.named_buffers() if name in wrapper.cache_buffer_names())


def _greedy_other_cache(rank: int, world_size: int, family: str, plain: bool,
                        constraints: dict[str, str] | None) -> dict[str, Any]:
    builder = {"deepseek_v3": tiny_deepseek_v3, "gpt_oss": tiny_gpt_oss}[family]
    model, (ids,), _ = builder(batch=2, seq_len=6)
    model.generation_config.pad_token_id = 0
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plain:  # the generation graphs are built at the first generate, the cache sized for the request
            tp = autotp.compile(model, example_inputs=(ids,))
            got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
            generation = tp.generation_on_demand.built
        else:
            tp = generation = autotp.compile(model, example_inputs=(ids[:, :4],), max_cache_len=32,
                                             options=autotp.PlanOptions(constraints=constraints))
            got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
    return {"got": got.tolist(), "expected": expected.tolist(), "cache_bytes": generation.cache_bytes(),
            "full_cache_bytes": _full_cache_bytes(model, 2, generation.generation.layout.max_cache_len),
            "cache_placements": {k: v for k, v in generation.plan.parameters.items() if "cache" in k}}


def _check_other_cache(results: list[dict[str, Any]], prompt: int) -> None:
    """Greedy tokens equal HF's on every rank, the case distinguishes (several distinct new tokens), and every
    rank's cache is below the whole one (each rank holds its block, not a copy)."""
    new = {t for row in results[0]["expected"] for t in row[prompt:]}
    assert len(new) > 1, f"the model generates {new} only: equal tokens would prove nothing"
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], (
            f"rank {rank}: tokens differ from HF generate(do_sample=False):\n expected {result['expected']}\n"
            f" got      {result['got']}")
        assert 0 < result["cache_bytes"] < result["full_cache_bytes"], (
            f"rank {rank}: cache of {result['cache_bytes']} bytes, expected a block below the whole "
            f"{result['full_cache_bytes']} (placements {result['cache_placements']})")


@pytest.mark.parametrize("world_size", [2, 3])
def test_deepseek_v3_latent_cache_greedy_matches_hf(gloo, world_size: int) -> None:
    """tp=2 and 3, tiny DeepSeek-V3 (multi-head latent attention: the cache holds the 48-dim latent and the 8 rope
    dims, one "head" each, not per-head keys and values; a MoE layer), batch 2, prompt 6, 8 new tokens.

    tp=2: a plain compile, the generation graphs built at the first generate; the planner splits the latent by
    its dim (kv_b_proj split by input features, an all-reduce after). tp=3: a generation compile whose latent
    cache is pinned split 16/16/16 (the cost model keeps it whole there, as vLLM keeps MLA's latent on every rank),
    prompts 4 tokens per call (prefill, then the continuation graph). Greedy equals HF; each rank's cache is a block."""
    plain = world_size == 2
    constraints = None if plain else {"key_cache_*": "S(3)"}
    results = gloo.run(world_size, _greedy_other_cache, "deepseek_v3", plain, constraints)
    _check_other_cache(results, 6)
    for rank, result in enumerate(results):
        latent = {k: v for k, v in result["cache_placements"].items() if k.startswith("key_cache")}
        assert set(latent.values()) == {"S(3)"}, f"rank {rank}: latent cache placements {latent}, expected S(3)"


def test_gpt_oss_sinks_and_sliding_window_greedy_matches_hf(gloo) -> None:
    """tp=2, tiny GPT-OSS (attention sinks; a sliding window of 4 on layer 0 < 14 tokens, full attention on layer 1;
    2 kv heads; MoE), plain compile, batch 2, prompt 6, 8 new tokens: greedy equals HF, the cache split by kv heads."""
    results = gloo.run(2, _greedy_other_cache, "gpt_oss", True, None)
    _check_other_cache(results, 6)
    for rank, result in enumerate(results):
        assert set(result["cache_placements"].values()) == {"S(1)"}, f"rank {rank}: {result['cache_placements']}"


def _state_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of the whole convolution and SSM states of a tiny Mamba: layers x batch x intermediate x
    (conv kernel + state size) x 4 (float32)."""
    config = model.config
    return config.num_hidden_layers * batch * config.intermediate_size * (config.conv_kernel + config.state_size) * 4


def _recurrent_greedy(rank: int, world_size: int, other_prompts: bool) -> dict[str, Any]:
    model, (ids,), _ = tiny_recurrent("mamba", batch=2, seq_len=6)
    model.generation_config.pad_token_id = 0  # no "setting pad_token_id" warning from HF generate
    with torch.no_grad():
        forward = model(ids, use_cache=False).logits

    def hf(prompt: torch.Tensor) -> list[list[int]]:
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              do_sample=False).tolist()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,))
        diff = (tp(ids).logits - forward).abs().max().item()
        got = tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist()
        built = tp.generation_on_demand.built
        result = {"diff": diff, "got": got, "expected": hf(ids), "cache_bytes": built.cache_bytes(),
                  "full_cache_bytes": _state_bytes(model, 2),
                  "states": {k: v for k, v in built.plan.parameters.items() if "_state_" in k},
                  "cache_placements": {k: v for k, v in built.plan.parameters.items() if "_state_" in k},
                  "in_proj": {k: v for k, v in built.plan.parameters.items() if k.endswith("in_proj.weight")},
                  "prefill_len": built.generation.layout.prefill_len}
        if other_prompts:
            longer = torch.cat([ids, ids[:, :3]], dim=1)  # 9 tokens: the first 6 through prefill, 3 through decode
            result["longer"] = (tp.generate(longer, max_new_tokens=NEW_TOKENS).tolist(), hf(longer))
            shorter = ids[:, :4]  # fewer than the prefill graph's 6: generate builds its graphs again, for 4
            result["shorter"] = (tp.generate(shorter, max_new_tokens=NEW_TOKENS).tolist(), hf(shorter))
            result["shorter_prefill_len"] = tp.generation_on_demand.built.generation.layout.prefill_len
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_mamba_generates_with_its_states_split_with_in_proj(gloo, world_size: int) -> None:
    """tp=2 and tp=3 (uneven: 128 channels as 43/43/42), tiny Mamba (a convolution state (batch, 128, 4) and an SSM
    state (batch, 128, 8) per layer, no KV cache), plain compile, batch 2, prompt 6, 8 new tokens: greedy equals HF's
    generate on every rank, the states are graph state split by channels (S(1)) where in_proj's output is split,
    each rank holds a block below the whole. At tp=2 also a 9-token prompt (prefill of 6, then 3 tokens one per
    decode call: no token applied to the state twice) and a 4-token one (the graphs built again for 4)."""
    results = gloo.run(world_size, _recurrent_greedy, world_size == 2)
    _check_other_cache(results, 6)
    for rank, result in enumerate(results):
        assert result["diff"] < 1e-4, f"rank {rank}: forward differs from the model's by {result['diff']:.3g}"
        assert set(result["states"].values()) == {"S(1)"} and len(result["states"]) == 4, (
            f"rank {rank}: expected the 4 states split by channels S(1), got {result['states']}")
        assert all(p.startswith("S(0)") for p in result["in_proj"].values()), (
            f"rank {rank}: expected in_proj split by output features with its states, got {result['in_proj']}")
        assert result["prefill_len"] == 6, f"rank {rank}: prefill graph of {result['prefill_len']} tokens, expected 6"
        for case in ("longer", "shorter"):
            if case in result:
                got, expected = result[case]
                assert got == expected, f"rank {rank}, {case} prompt: expected {expected}, got {got}"
        if "shorter_prefill_len" in result:
            assert result["shorter_prefill_len"] == 4, (
                f"rank {rank}: expected a prefill graph of 4 tokens for the shorter prompt, got "
                f"{result['shorter_prefill_len']}")


def _mamba2_greedy(rank: int, world_size: int) -> dict[str, Any]:
    model, (ids,), _ = tiny_recurrent("mamba2", batch=2, seq_len=6)
    model.generation_config.pad_token_id = 0  # no "setting pad_token_id" warning from HF generate
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,))
        got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
    built = tp.generation_on_demand.built
    config = model.config
    channels = config.num_heads * config.head_dim + 2 * config.n_groups * config.state_size  # x, B and C convolved
    whole = config.num_hidden_layers * 2 * (channels * config.conv_kernel
                                            + config.num_heads * config.head_dim * config.state_size) * 4
    return {"got": got.tolist(), "expected": expected.tolist(), "cache_bytes": built.cache_bytes(),
            "full_cache_bytes": whole,
            "cache_placements": {k: v for k, v in built.plan.parameters.items() if "_state_" in k}}


def test_mamba2_generates_with_its_states_as_graph_state(gloo) -> None:
    """tp=2, tiny Mamba2 (8 heads of 16, state size 8, one group: a convolution state over x, B and C and an SSM state
    (batch, 8, 16, 8) per layer), plain compile, batch 2, prompt 6, 8 new tokens: greedy equals HF's generate on
    every rank, and each rank holds a block of the states below the whole (the solver places them)."""
    results = gloo.run(2, _mamba2_greedy)
    _check_other_cache(results, 6)
