"""The KV cache as graph state, without processes: the cache wrapper, its capture and its plan, sampling.

Tier (a)/(b): single process, tiny Llama (1 layer where enough), no process group.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from generation_models import (
    RECURRENT_GENERATES,
    RECURRENT_STATE,
    tiny_deepseek_v3,
    tiny_gemma,
    tiny_phi,
    tiny_recurrent,
)
from models import tiny_gpt2, tiny_llama, tiny_mistral, tiny_mixtral, tiny_qwen2

import autotp
from autotp.capture.kv_cache import CachedCausalLM
from autotp.capture.tracing import capture, inputs_on_model_device
from autotp.runtime.generation.generate import next_tokens


def _assert_cached_logits_match(model: torch.nn.Module, wrapper: CachedCausalLM, ids: torch.Tensor) -> None:
    """A 5-token prefill then one decode step through the 8-slot cache give the logits of the whole 6 tokens."""
    mask = torch.zeros(2, 8, dtype=torch.long)
    mask[:, :6] = 1
    positions = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits  # (2, 6, vocab)
        prefill = wrapper(ids[:, :5], positions[:, :5], torch.arange(5), mask)
        decode = wrapper(ids[:, 5:], positions[:, 5:], torch.tensor([5]), mask)
    diff = max((prefill - expected[:, :5]).abs().max().item(), (decode - expected[:, 5:]).abs().max().item())
    assert diff < 1e-4, f"max abs diff {diff:.3g} between cached and whole-sequence logits, expected < 1e-4"


def test_cache_wrapper_matches_the_model() -> None:
    """tp=1, tiny Llama, batch 2: a 5-token prefill then one decode step through the 8-slot cache give
    the logits of the model run on the whole 6-token sequence."""
    model, (ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=64, intermediate=128, batch=2, seq_len=6,
                                  layers=1)
    wrapper = CachedCausalLM(model, batch_size=2, max_cache_len=8)
    _assert_cached_logits_match(model, wrapper, ids)


def test_cache_is_shaped_as_the_model_writes_it() -> None:
    """tp=1, tiny DeepSeek-V3 (multi-head latent attention), batch 2: the cache is shaped as the release writes it,
    keys and values of their own sizes, never the config's one head_dim: transformers 5.24 caches the 48-dim latent
    and the 8 rope dims (one "head" each), earlier releases 4 heads of keys (16 + 8 dims) and of values (32 dims).
    A 5-token prefill then a decode step give the whole sequence's logits."""
    model, (ids,), _ = tiny_deepseek_v3(batch=2, seq_len=6)
    wrapper = CachedCausalLM(model, batch_size=2, max_cache_len=8)
    shapes = {name: tuple(b.shape) for name, b in wrapper.named_buffers() if name in wrapper.cache_buffer_names()}
    layouts = [{f"{kind}_cache_{i}": (2, heads, 8, dim) for i in range(2) for kind, dim in (("key", k), ("value", v))}
               for heads, k, v in ((1, 48, 8), (4, 24, 32))]  # the latent, then keys and values per head
    assert shapes in layouts, f"cache shapes {shapes}, expected one of {layouts}"
    _assert_cached_logits_match(model, wrapper, ids)


@pytest.mark.parametrize("family", [f for f in RECURRENT_STATE if f not in RECURRENT_GENERATES])
def test_a_recurrent_state_is_refused_naming_the_family(family: str) -> None:
    """No process group, the hybrids Jamba, Qwen3-Next, Falcon-H1, RecurrentGemma: planning
    generation raises UnsupportedModelError naming the model class and its convolution / recurrent state, and
    saying that the forward compiles, before anything is traced (not a release error, not a tracing hint)."""
    model, (ids,), _ = tiny_recurrent(family, batch=1, seq_len=4)
    with pytest.raises(autotp.UnsupportedModelError) as caught:
        autotp.plan(model, (ids,), world_size=2, max_cache_len=16)
    message = str(caught.value)
    for part in (type(model).__name__, "recurrent", "autotp.compile(model, example_inputs=(ids,))"):
        assert part in message, f"expected {part!r} in: {message}"


def test_mamba_states_are_graph_state_split_with_in_proj() -> None:
    """No process group, tp=2 planned, tiny Mamba (2 layers, 128 channels, conv kernel 4, state size 8), batch 2: the
    wrapper holds a convolution state (2, 128, 4) and an SSM state (2, 128, 8) per layer and no KV cache; its first
    chunk (6 tokens) then one decode call give the model's whole-sequence logits; the decode plan splits every
    state by channels (S(1)) with in_proj's output (S(0)), and the plan counts them as state."""
    model, (ids,), _ = tiny_recurrent("mamba", batch=2, seq_len=7)
    wrapper = CachedCausalLM(model, batch_size=2, max_cache_len=16)
    shapes = {name: tuple(buffer.shape) for name, buffer in wrapper.named_buffers()}
    expected_shapes = {**{f"conv_state_{i}": (2, 128, 4) for i in range(2)},
                       **{f"ssm_state_{i}": (2, 128, 8) for i in range(2)}}
    assert shapes == expected_shapes, f"expected buffers {expected_shapes}, got {shapes}"
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[:, :7] = 1
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits  # (2, 7, vocab)
        with wrapper.first_chunk():
            prefill = wrapper(ids[:, :6], positions[:, :6], torch.arange(6), mask)
        decode = wrapper(ids[:, 6:], positions[:, 6:], torch.tensor([6]), mask)
    diff = max((prefill - expected[:, :6]).abs().max().item(), (decode - expected[:, 6:]).abs().max().item())
    assert diff < 1e-4, f"max abs diff {diff:.3g} between stepped and whole-sequence logits, expected < 1e-4"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, (ids[:, :6],), world_size=2, max_cache_len=16)
    states = {k: v for k, v in plan.parameters.items() if "_state_" in k}
    assert states == dict.fromkeys(expected_shapes, "S(1)"), f"expected every state S(1), got {states}"
    in_proj = {k: v for k, v in plan.parameters.items() if k.endswith("in_proj.weight")}
    assert all(p.startswith("S(0)") for p in in_proj.values()), f"expected in_proj split by outputs, got {in_proj}"


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma", "gpt2", "phi", "qwen2", "mixtral"])
def test_first_chunk_attends_to_the_prompt_only_and_fills_the_cache_alike(family: str) -> None:
    """tp=1, batch 2 (row 1 left-padded by 3), 12-slot cache, prompt of 10 (Mistral: sliding window 8 < 10): a
    call in ``first_chunk()`` gives the logits and writes the cache of a call reading every slot, eager and as
    a captured graph; the captured graph's attention reads no cache buffer (10 keys, not 12)."""
    build = {"llama": tiny_llama, "mistral": tiny_mistral, "gemma": tiny_gemma, "gpt2": tiny_gpt2, "phi": tiny_phi,
             "qwen2": tiny_qwen2, "mixtral": tiny_mixtral}[family]
    model, (ids,), _ = build(batch=2, seq_len=10, layers=1)
    wrapper = CachedCausalLM(model, batch_size=2, max_cache_len=12)
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[:, :10] = 1
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, :10]
    inputs = (ids, positions, torch.arange(10), mask)
    caches = {name: buffer for name, buffer in wrapper.named_buffers() if "cache" in name}

    def run(first: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for buffer in caches.values():
            buffer.normal_()  # stale slots from an earlier request: masked either way
        with torch.no_grad():
            if first:
                with wrapper.first_chunk():
                    logits = wrapper(*inputs)
            else:
                logits = wrapper(*inputs)
        return logits, {name: buffer[:, :, :10].clone() for name, buffer in caches.items()}

    (whole, whole_cache), (first, first_cache) = run(False), run(True)
    diff = (whole - first).abs().max().item()
    assert diff < 1e-4, f"{family}: first-chunk logits differ from the whole-cache call by {diff:.3g}"
    for name in caches:
        assert torch.allclose(whole_cache[name], first_cache[name], atol=1e-5), f"{family}: {name} written differently"
    with wrapper.first_chunk():
        captured = capture(wrapper, wrapper.example_inputs(10), dynamic=False)
    assert wrapper.reads_cache, "first_chunk() must end with the block"
    attention = [n for n in captured.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    keys = {tuple(n.args[1].meta["val"].shape)[2] for n in attention}
    assert keys == {10}, f"{family}: attention over {keys} keys in the first-chunk graph, expected the prompt's 10"


def test_capture_keeps_cache_updates_as_state_and_the_planner_splits_heads() -> None:
    """tp=2 (autotp.plan with max_cache_len, meta device, no processes), tiny Llama 2 layers, hidden 64, 4 heads / 2 kv heads: the four cache
    buffers are state (not refused as buffer updates), the graph returns only the logits, and the plan
    splits every cache by kv heads (dim 1) with its index_copy update alike."""
    model, (ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=64, intermediate=128, batch=1, seq_len=4,
                                  device="meta")
    wrapper = CachedCausalLM(model, batch_size=1, max_cache_len=16)
    captured = capture(wrapper, inputs_on_model_device(model, wrapper.example_inputs(1)), dynamic=False)
    fqns = sorted(captured.state_fqns().values())
    assert fqns == ["key_cache_0", "key_cache_1", "value_cache_0", "value_cache_1"], fqns
    output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    assert len(output.args[0]) == 1, f"graph outputs {output.args[0]}, expected the logits only"
    plan = autotp.plan(model, (ids,), world_size=2, max_cache_len=16)
    placements = {fqn: plan.parameters[fqn] for fqn in fqns}
    assert set(placements.values()) == {"S(1)"}, f"cache placements {placements}, expected S(1) (kv heads)"
    updates = {n.name: (n.inputs, n.output) for n in plan.nodes if n.op == "aten.index_copy.default"}
    assert set(updates.values()) == {(("S(1)", "R", "S(1)"), "S(1)")}, updates


def test_fewer_kv_heads_than_ranks_replicates_kv_projections() -> None:
    """tp=2 (autotp.plan, default budget, no processes), tiny Gemma 2 layers, hidden 64, 4 heads / 1 kv head
    (MQA): k/v projections and the cache stay whole (kv heads replicated, as vLLM does), so each layer has
    2 all-reduces (after o_proj and down_proj), not 4; 2 kv heads: no exception over 2 ranks, k/v over 4."""
    from autotp.planning.kv_heads import kv_projection_parameters

    model, (ids,), _ = tiny_gemma(hidden=64, intermediate=128, batch=1, seq_len=4)
    plan = autotp.plan(model, (ids,), world_size=2, max_cache_len=16)
    kv = {fqn: text for fqn, text in plan.parameters.items() if "k_proj" in fqn or "v_proj" in fqn or "cache" in fqn}
    assert set(kv.values()) == {"R"}, f"k/v projections and caches {kv}, expected all R"
    per_layer = [sum(step == "all_reduce" for c in plan.collectives if f".layers.{i}" in c.module for step in c.steps)
                 for i in (0, 1)]
    assert per_layer == [2, 2], f"all-reduces per layer {per_layer}, expected [2, 2] (after o_proj and down_proj)"
    llama, (llama_ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=64, intermediate=128, layers=1, batch=1,
                                          seq_len=4)
    captured = capture(llama, (llama_ids,), {"use_cache": False}, dynamic=False)
    kept = kv_projection_parameters(captured.graph_module, 2, set(captured.parameter_fqns()))
    assert not kept, f"2 kv heads over 2 ranks split evenly; expected no whole k/v allowance, got {sorted(kept)}"
    fqns = captured.parameter_fqns()
    kept = sorted(fqns[n] for n in kv_projection_parameters(captured.graph_module, 4, set(fqns)))
    expected = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    assert kept == expected, f"2 kv heads over 4 ranks: whole allowance for {kept}, expected {expected}"


@pytest.fixture
def fake_tp2():
    """A fake process group of 2 ranks (this process is rank 0): compile plans and rewrites without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_phase_weights_choose_one_placement_for_prefill_and_decode(fake_tp2) -> None:
    """tp=2 (fake process group), tiny Llama 1 layer, hidden 256, batch 8, prefill 64 tokens, memory_budget=None
    on h100-sxm: alone, prefill splits the KV cache by batch and decode keeps it whole. With
    expected_new_tokens=0 the prefill-placed pair is kept (decode pinned to it); with 10000 the decode-placed
    one; both graphs of the kept pair share every placement, and print(tp.generation) shows the weights."""
    from autotp.planning.phases import weigh_phases

    model, (ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=256, intermediate=512, layers=1, batch=8,
                                  seq_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=64,
                            options=autotp.PlanOptions(memory_budget=None, expected_new_tokens=0))
    weighting = tp.generation.weighting
    by = {c.placed_by: c for c in weighting.candidates}
    assert by["decode"].decode.parameters["key_cache_0"] == "R", by["decode"].decode.parameters
    assert by["prefill"].prefill.parameters["key_cache_0"] == "S(0)", by["prefill"].prefill.parameters
    assert weighting.chosen is by["prefill"], f"expected_new_tokens=0 kept the pair placed by {weighting.chosen.placed_by}"
    assert tp.plan is by["prefill"].decode and tp.generation.prefill_plan is by["prefill"].prefill
    assert tp.plan.parameters == tp.generation.prefill_plan.parameters, "the two graphs must share every placement"
    many = weigh_phases(list(weighting.candidates), 10_000)
    assert many.chosen is by["decode"], f"expected_new_tokens=10000 kept the pair placed by {many.chosen.placed_by}"
    text = str(tp.generation)
    for expected in ("phase weights: prefill x1 + decode x0", "chosen placed by prefill", "placed by decode",
                     "== decode (1 token per row; placements pinned to prefill's)"):
        assert expected in text, f"{expected!r} not in print(tp.generation):\n{text[:1500]}"
    with pytest.raises(ValueError, match="expected_new_tokens must be an int >= 0"):
        autotp.compile(model, example_inputs=(ids,), max_cache_len=64,
                       options=autotp.PlanOptions(expected_new_tokens=-1))


@pytest.mark.slow  # plans both phases of a generation twice: about 9 s on 2 cores
def test_a_phase_the_first_rank_runs_alone_is_priced_at_a_whole_core(fake_tp2) -> None:
    """tp=2 (fake process group), tiny Llama 1 layer, hidden 256, batch 4, prefill 32, memory_budget=None, a CPU
    profile (host_is_device) with a fast link whose rates carry a core share of 0.5 (two ranks busy on one
    core): priced at that share both phases split (the decode- and prefill-placed candidates have
    collectives), but a plan without collectives runs on the first rank alone at a whole core
    (first_rank_alone), so the whole candidate, priced on Hardware.alone(), is kept: no collective in either
    phase. With memory_budget='auto' every weight must split, so there is no whole candidate."""
    from autotp.cost_model import LinkProfile, get_hardware
    from autotp.planning.phases import AlonePhases, first_rank_alone

    link = LinkProfile("fast-synthetic", bandwidth_gbps=100.0, latency_s=1e-6)
    cpu = get_hardware("cpu-gloo")
    busy = dataclasses.replace(cpu, peak_tflops={d: t / 2 for d, t in cpu.peak_tflops.items()}, kernel_floor_s=1e-6,
                               memory_bandwidth_gbps=cpu.memory_bandwidth_gbps / 2, intra_node=link, inter_node=link,
                               core_share=0.5)
    model, (ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=256, intermediate=512, layers=1, batch=4,
                                  seq_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=64,
                            options=autotp.PlanOptions(memory_budget=None, hardware=busy))
    by = {c.placed_by: c for c in tp.generation.weighting.candidates}
    assert set(by) == {"decode", "prefill", "whole"}, f"candidates {sorted(by)}"
    for placed_by in ("decode", "prefill"):
        split = by[placed_by]
        assert split.decode.collectives and split.prefill.collectives, (
            f"placed by {placed_by} at a core share of 0.5: expected both phases split, got decode "
            f"{split.decode.collective_counts()}, prefill {split.prefill.collective_counts()}")
    assert tp.generation.weighting.chosen is by["whole"], str(tp.generation.weighting)
    assert not tp.plan.collectives and not tp.generation.prefill_plan.collectives, (
        tp.plan.collective_counts(), tp.generation.prefill_plan.collective_counts())
    assert set(tp.plan.parameters.values()) == {"R"}, tp.plan.parameters
    assert by["whole"].request_s(128) < min(by[p].request_s(128) for p in ("decode", "prefill"))
    assert first_rank_alone(world_size=2, ranks_share_host=True, decode_collectives=False,
                            prefill_collectives=False) == AlonePhases(decode=True, prefill=True)
    assert first_rank_alone(world_size=2, ranks_share_host=True, decode_collectives=False,
                            prefill_collectives=True) == AlonePhases(decode=True, prefill=False)
    for world_size, shared, decode_collectives in ((1, True, False), (2, False, False), (2, True, True)):
        assert first_rank_alone(world_size=world_size, ranks_share_host=shared, decode_collectives=decode_collectives,
                                prefill_collectives=False) == AlonePhases(decode=False, prefill=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budgeted = autotp.compile(model, example_inputs=(ids,), max_cache_len=64, options=autotp.PlanOptions(hardware=busy))
    assert [c.placed_by for c in budgeted.generation.weighting.candidates] == ["decode", "prefill"], (
        str(budgeted.generation.weighting))


@pytest.mark.slow  # plans both phases of a generation three times: about 10 s on 2 cores
def test_the_phases_weigh_what_each_call_pays_beyond_its_plan(fake_tp2) -> None:
    """tp=2 (fake process group), tiny Llama 1 layer, hidden 256, batch 4, prefill 32, memory_budget=None, a CPU
    profile with a fast link at a core share of 0.9: split, a decode step is predicted below the whole plan's at a
    whole core, so the decode-placed candidate is kept. With a loss of 100 us per call for ranks taking turns on
    shared cores (``Hardware.core_share_call_s``), which every call of the split plans pays and the first rank
    alone does not, the whole candidate is kept; each candidate's request holds its calls' terms."""
    from autotp.cost_model import LinkProfile, get_hardware
    from autotp.cost_model.runtime import graph_host_s

    link = LinkProfile("fast-synthetic", bandwidth_gbps=100.0, latency_s=1e-6)
    cpu = get_hardware("cpu-gloo")
    model, (ids,), _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=256, intermediate=512, layers=1, batch=4,
                                  seq_len=32)
    chosen = {}
    for loss_s in (0.0, 100e-6):
        busy = dataclasses.replace(cpu, peak_tflops={d: t * 0.9 for d, t in cpu.peak_tflops.items()},
                                   kernel_floor_s=1e-6, memory_bandwidth_gbps=cpu.memory_bandwidth_gbps * 0.9,
                                   intra_node=link, inter_node=link, core_share=0.9, core_share_call_s=loss_s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=64,
                                options=autotp.PlanOptions(memory_budget=None, hardware=busy))
        weighting = tp.generation.weighting
        by = {c.placed_by: c for c in weighting.candidates}
        assert set(by) == {"decode", "prefill", "whole"}, str(weighting)
        for candidate in weighting.candidates:
            call_s = graph_host_s(busy.alone() if candidate.placed_by == "whole" else busy)
            assert candidate.decode_call_s == candidate.prefill_call_s == pytest.approx(call_s), str(weighting)
            assert candidate.request_s(128) == pytest.approx(
                candidate.prefill.predicted_time_s + 128 * candidate.decode.predicted_time_s + 129 * call_s)
        chosen[loss_s] = weighting.chosen.placed_by
    assert chosen == {0.0: "decode", 100e-6: "whole"}, chosen


def test_sampling_follows_hf_warpers() -> None:
    """tp=1: temperature 0.7, top-k 5, top-p 0.8 keep the tokens HF's warpers keep, and the draw with a
    seeded generator equals torch.multinomial on HF's probabilities with the same seed."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    scores = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.8)):
        scores = warper(None, scores)
    expected = torch.multinomial(scores.softmax(-1), 1, generator=torch.Generator().manual_seed(4)).squeeze(1)
    got = next_tokens(logits, do_sample=True, temperature=0.7, top_k=5, top_p=0.8,
                      generator=torch.Generator().manual_seed(4))
    assert torch.equal(got, expected), f"sampled {got.tolist()}, HF warpers give {expected.tolist()}"
    greedy = next_tokens(logits, do_sample=False, temperature=1.0, top_k=None, top_p=None, generator=None)
    assert torch.equal(greedy, logits.argmax(-1)), f"greedy {greedy.tolist()} != argmax {logits.argmax(-1).tolist()}"


class _ScaledLinear(torch.nn.Module):
    """A linear layer and a buffer that scales its output (a parameter and a buffer as graph inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_forward_reads_the_live_parameters_and_buffers(fake_tp2) -> None:
    """tp=2 (fake process group), a linear layer and a scale buffer, memory_budget=None (no collective): forward
    reads each graph input from the module's live dicts, so a buffer that .to() replaces and a parameter assigned
    in place are what the next call uses."""
    import autotp

    torch.manual_seed(0)
    model, x = _ScaledLinear(), torch.randn(3, 8)
    tp = autotp.compile(model, world_size=2, example_inputs=(x,),
                        options=autotp.PlanOptions(memory_budget=None, hardware="cpu-gloo"))
    assert not tp.plan.collective_counts(), f"expected a plan without collectives, got {tp.plan.collective_counts()}"
    with torch.no_grad():
        torch.testing.assert_close(tp(x), model(x))
        tp.to(torch.float64)  # replaces the buffer tensor in _buffers, and each parameter's data
        for buffer in tp.buffers():
            buffer.fill_(3.0)  # on the new tensor: the old one, held anywhere, still says 2
        model.scale = torch.full((8,), 3.0)  # not in place: the old tensor may be the one tp was built with
        out = tp(x.double())
        assert out.dtype == torch.float64, f"expected float64 after .to(torch.float64), got {out.dtype}"
        torch.testing.assert_close(out, model.double()(x.double()))
        for param in tp.parameters():
            param.zero_()
        assert torch.count_nonzero(tp(x.double())) == 0, "expected zeros after zeroing every parameter in place"


def test_shared_shard_check_expects_the_shards_apply_plan_slices(fake_tp2) -> None:
    """tp=2 (fake process group), tiny Llama 2 layers, 4 heads / 2 kv heads, a CPU profile slow enough that the
    plan splits the cache: for the prefill graph planned with the
    decode plan's placements, the shard shapes the check derives without slicing (``local_shape``) equal those
    ``apply_plan`` slices, on both ranks, so the graph takes the decode graph's tensors; a tensor of another
    shape is refused with PlanError naming it."""
    from autotp.base.errors import PlanError
    from autotp.planning.options import PlanOptions
    from autotp.runtime.collectives.hosts import local_host
    from autotp.runtime.execution.applying import apply_plan, plan_or_check, rank_local_graph
    from autotp.runtime.generation.compile_for_generation import _pinned_to, _shared_inputs

    model, _, _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=64, intermediate=128, batch=2, seq_len=4, layers=2)
    wrapper = CachedCausalLM(model, batch_size=2, max_cache_len=16, last_logits_only=True)
    decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False)
    with wrapper.first_chunk():
        prefill = capture(wrapper, wrapper.example_inputs(4), dynamic=False)
    from autotp.cost_model import get_hardware

    slow = dataclasses.replace(get_hardware("cpu-gloo"), peak_tflops={"float32": 1e-5}, memory_bandwidth_gbps=0.01)
    options = PlanOptions(world_size=2, hardware=slow, memory_budget=None)  # slow enough that splitting pays
    decode_plan = plan_or_check(decode, None, options, group=None, rank=0)
    prefill_plan = plan_or_check(prefill, None, _pinned_to(decode_plan, options), group=None, rank=0)
    assert decode_plan.parameters["key_cache_0"] != "R", decode_plan.parameters
    for rank in (0, 1):
        _, values, _ = apply_plan(decode, decode_plan, group=None, rank=rank, host=local_host())
        _, prefill_values, _ = apply_plan(prefill, prefill_plan, group=None, rank=rank, host=local_host())
        _, parts = rank_local_graph(prefill, prefill_plan, group=None, rank=rank, host=local_host())
        inputs = _shared_inputs(prefill, prefill_plan, parts, rank, decode, values, "prefill")
        for slot, key in zip(prefill.inputs, inputs):
            if slot.kind != "user":
                assert values[key].shape == prefill_values[slot.name].shape, (rank, slot.target)
    wrong = dict(values)
    cache = next(key for key in wrong if "key_cache" in str(dict((s.name, s.target) for s in decode.inputs)[key]))
    wrong[cache] = torch.zeros(1)
    with pytest.raises(PlanError, match="key_cache_0: the prefill plan's shard"):
        _shared_inputs(prefill, prefill_plan, parts, 1, decode, wrong, "prefill")


def test_a_recurrent_state_refuses_a_prompt_shorter_than_its_prefill_graph() -> None:
    """No process group, a layout with a recurrent state and a prefill graph of 6 tokens (tp=2): a 4-token prompt is
    refused with a ValueError saying to compile with shorter example ids (only the prefill graph starts the state
    empty; a decode call would read the previous request's state); a KV-cache layout takes it token by token."""
    from autotp.capture.kv_cache import CacheLayout
    from autotp.runtime.generation.generate import check_request

    recurrent = CacheLayout(batch_size=2, max_cache_len=32, prefill_len=6, vocab_size=1000, recurrent=True)
    prompt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError) as caught:
        check_request(recurrent, 2, prompt, None, 8, False, None)
    assert "compile with example ids of 4 tokens" in str(caught.value), f"expected the fix in: {caught.value}"
    check_request(dataclasses.replace(recurrent, recurrent=False), 2, prompt, None, 8, False, None)


@pytest.mark.slow  # traces a five-layer Mamba's prefill and decode graphs: about 11 s
def test_a_deep_mamba_is_stamped_with_its_states() -> None:
    """No process group, tiny Mamba of 5 layers (4 or more: a candidate for stamping, which exports it whole today,
    refusing the lower-cased placeholder name of ``A_log``): the decode and prefill graphs write the convolution and
    SSM states of all five layers as state, and generation's check finds none unwritten."""
    import transformers as hf

    from autotp.runtime.generation.compile_for_generation import check_cache_is_state

    torch.manual_seed(0)
    config = hf.MambaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=5, state_size=8, use_cache=False)
    wrapper = CachedCausalLM(hf.MambaForCausalLM(config).eval(), batch_size=2, max_cache_len=16,
                             last_logits_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False)
        with wrapper.first_chunk():
            prefill = capture(wrapper, wrapper.example_inputs(6), dynamic=False)
    names = sorted(wrapper.cache_buffer_names())
    assert len(names) == 10, f"expected 10 state buffers (5 layers x conv, ssm), got {names}"
    for phase, graph in (("decode", decode), ("prefill", prefill)):
        written = sorted(graph.state_fqns().values())
        assert written == names, f"{phase}: expected every state written {names}, got {written}"
        check_cache_is_state(graph, wrapper, phase)
