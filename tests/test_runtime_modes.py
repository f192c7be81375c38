"""Runtime modes (``RuntimeOptions(runtime_mode=...)``): eager, compiled (Inductor), cuda_graph.

Tier (c), real gloo processes at tp=2: the compiled generation graphs (prefill, continuation, decode)
and a compiled plain forward give HF's greedy tokens and logits, compiled once per graph (Dynamo's
counters do not move on later calls); the plans are priced in the mode that runs; tier (a): mode validation and a decode loop that reads nothing back per token in the compiled modes. Tiny models, few tokens.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from host_reads import HostReads
from models import tiny_llama

import autotp
from autotp.capture.kv_cache import CacheLayout
from autotp.runtime.execution.runtime_modes import resolve_runtime_mode
from autotp.runtime.generation.generate import EOS_CHECK_TOKENS, generation_loop

NEW_TOKENS = 6


def _compile(model: torch.nn.Module, ids: torch.Tensor, mode: str, trace_cache: str | None = None,
             **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.compile(model, example_inputs=(ids,),
                              runtime=autotp.RuntimeOptions(runtime_mode=mode, trace_cache=trace_cache), **kwargs)


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _step(x: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor]:
    cache.index_copy_(0, slot, x)  # as a KV cache update: in place into a graph input
    return (cache.sum(0) * 2,)


def _runner_case() -> dict[str, Any]:
    """A 3-node FX graph through graph_runner("compiled") 4 times against eager: results, the input written in
    place, Dynamo graphs compiled and the progress lines."""
    import contextlib
    import io

    from torch import fx

    from autotp.runtime.execution.runtime_modes import graph_runner

    gm = fx.symbolic_trace(_step)
    run = graph_runner(gm, "compiled", what="decode", talk=True)
    cache, reference = torch.zeros(4, 3), torch.zeros(4, 3)
    graphs, err = _graph_count(), io.StringIO()
    same = True
    with contextlib.redirect_stderr(err):
        for position in range(4):
            x, slot = torch.full((1, 3), float(position + 1)), torch.tensor([position])
            same &= torch.equal(run(x, cache, slot)[0], gm(x, reference, slot)[0])
    return {"same": same, "in_place": torch.equal(cache, reference), "graphs": _graph_count() - graphs,
            "progress": err.getvalue()}


def _pipeline_compiled(trace_cache: str) -> dict[str, Any]:
    """pp2 mesh (one layer per stage), tiny Llama 2 layers hidden 64: greedy tokens of compile_mesh in eager and
    compiled mode and HF's (prompt 5 in one chunk, 4 new tokens: two Inductor compiles per stage; chunked prompts
    are covered at tp 2 above). The compiled mesh rebuilds the programs the eager one traced (``trace_cache``)."""
    from torch.distributed.device_mesh import init_device_mesh

    model, _, _ = tiny_llama(num_heads=4, num_kv_heads=2, hidden=64, intermediate=128, seq_len=8, layers=2)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    tokens: dict[str, Any] = {
        "hf": model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False).tolist()}
    for mode in ("eager", "compiled"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            part = autotp.compile_mesh(model, mesh, example_inputs=(ids,), max_cache_len=12,
                                       runtime=autotp.RuntimeOptions(runtime_mode=mode, trace_cache=trace_cache))
        graphs = _graph_count()
        tokens[mode] = part.generate(ids, max_new_tokens=4).tolist()
        tokens[f"{mode} graphs"] = _graph_count() - graphs
        tokens[f"{mode} plan"] = str(part.stage_module.plan).splitlines()[0]
    return tokens


def _modes_on_ranks(rank: int, world_size: int, trace_cache: str) -> dict[str, Any]:
    """tp=2, tiny Llama (1 layer, GQA 8/4, hidden 256): greedy tokens in eager and compiled mode against HF,
    prompt 6 read in chunks of 4 (prefill, continuation, decode graphs); a compiled plain forward's logits.
    The compiled mode's generation graphs are the programs the eager mode traced, rebuilt from ``trace_cache``
    (what is checked is how each mode plans and runs them, not the tracing)."""
    import torch._dynamo

    torch._dynamo.reset()
    out: dict[str, Any] = {"runner": _runner_case()}
    model, (ids,), _ = tiny_llama(layers=1, seq_len=6)
    model.generation_config.pad_token_id = 0
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    out["expected"] = expected.tolist()
    options = autotp.PlanOptions(hardware="h100-sxm")  # splits the weights even at batch 2: collectives in decode
    eager = _compile(model, ids[:, :4], "eager", trace_cache, max_cache_len=16, options=options)
    out["eager"] = eager.generate(ids, max_new_tokens=NEW_TOKENS).tolist()
    compiled = _compile(model, ids[:, :4], "compiled", trace_cache, max_cache_len=16, options=options)
    out["plan_lines"] = [str(tp.plan).splitlines()[0] for tp in (eager, compiled)]
    out["predicted_s"] = [tp.plan.predicted_time_s for tp in (eager, compiled)]
    out["decode_collectives"] = sum(compiled.collective_counts().values())
    caches = {fqn: t for fqn, t in compiled.local_state().items() if "cache" in fqn}
    addresses = {fqn: t.data_ptr() for fqn, t in caches.items()}
    out["compiled"] = compiled.generate(ids, max_new_tokens=NEW_TOKENS).tolist()
    after = {fqn: t for fqn, t in compiled.local_state().items() if "cache" in fqn}
    out["cache_moved"] = [fqn for fqn, t in after.items() if t.data_ptr() != addresses[fqn]]
    out["cache_written"] = bool(caches) and all(bool(t.abs().sum() > 0) for t in after.values())
    graphs = _graph_count()
    out["compiled_again"] = compiled.generate(ids, max_new_tokens=NEW_TOKENS, stop_check_every=3).tolist()
    out["new_graphs"] = _graph_count() - graphs
    plain = _compile(model, ids, "compiled", options=options)
    with torch.no_grad():
        reference = model(ids).logits
        logits = plain(ids).logits
        graphs = _graph_count()
        again = plain(ids).logits
        sizes = []  # other sequence lengths: one more compile with symbolic sizes at most, then none
        for length in (4, 5):
            graphs = _graph_count()
            sizes.append((float((plain(ids[:, :length]).logits - model(ids[:, :length]).logits).abs().max()),
                          _graph_count() - graphs))
    out["other_sizes"] = sizes
    out["logits_error"] = float((logits - reference).abs().max())
    out["logits_again_error"] = float((again - reference).abs().max())
    out["forward_new_graphs"] = _graph_count() - graphs
    out["pp_mesh"] = _pipeline_compiled(trace_cache)
    return out


@pytest.mark.distributed
def test_compiled_mode_matches_hf_and_compiles_once(gloo, trace_cache: str) -> None:
    """tp=2 on gloo: a 3-node graph compiled once, same results, input written in place, progress lines.
    Tiny Llama: compiled generate == eager generate == HF greedy, also with stop_check_every=3; no recompile on a
    second request; the KV cache written in place (same tensors, filled); each plan priced in its mode
    (compiled: no per-node dispatch, so less); a compiled plain forward within 1e-4 of the model's logits, no recompile on a
    second call; at a new length one compile with symbolic sizes at most, at a third none. A pp2 mesh
    (compile_mesh, one layer per stage) generates HF's tokens compiled as in eager, each stage's plan priced in
    its mode and its two graphs compiled by Inductor in compiled mode (none in eager)."""
    results = gloo.run(2, _modes_on_ranks, trace_cache, timeout_s=900)
    for rank, result in enumerate(results):
        runner = result["runner"]  # a 3-node graph writing into its input, 4 calls
        assert runner["same"] and runner["in_place"], f"rank {rank}: compiled runner differs from eager: {runner}"
        assert runner["graphs"] == 1, f"rank {rank}: {runner['graphs']} graphs compiled for 4 calls of one size"
        assert runner["progress"].count("compiling the decode graph with Inductor") == 1, runner["progress"]
        assert "compiled the decode graph in" in runner["progress"], runner["progress"]
        expected = result["expected"]
        assert result["eager"] == expected, f"rank {rank}: eager {result['eager']} != HF {expected}"
        assert result["compiled"] == expected, f"rank {rank}: compiled {result['compiled']} != HF {expected}"
        assert result["compiled_again"] == expected, f"rank {rank}: second request {result['compiled_again']}"
        assert result["decode_collectives"] > 0, f"rank {rank}: the decode plan has no collective to compile"
        for mode, line in zip(("eager", "compiled"), result["plan_lines"]):
            assert f"({mode}, format v" in line, f"rank {rank}: the {mode} plan's header is {line!r}"
        eager_s, compiled_s = result["predicted_s"]
        assert compiled_s < eager_s, f"rank {rank}: priced compiled {compiled_s} s, not below eager {eager_s} s"
        assert not result["cache_moved"], f"rank {rank}: cache buffers replaced, not written in place: {result['cache_moved']}"
        assert result["cache_written"], f"rank {rank}: the compiled graphs left a KV cache buffer empty"
        assert result["new_graphs"] == 0, f"rank {rank}: {result['new_graphs']} graphs compiled on a second request"
        assert result["logits_error"] < 1e-4, f"rank {rank}: compiled forward logits off by {result['logits_error']}"
        assert result["logits_again_error"] < 1e-4, f"rank {rank}: second call off by {result['logits_again_error']}"
        assert result["forward_new_graphs"] == 0, f"rank {rank}: {result['forward_new_graphs']} recompiles"
        (error_4, graphs_4), (error_5, graphs_5) = result["other_sizes"]
        assert max(error_4, error_5) < 1e-4, f"rank {rank}: logits at 4 and 5 tokens off by {error_4}, {error_5}"
        assert graphs_4 <= 1 and graphs_5 == 0, f"rank {rank}: graphs compiled at 4 tokens {graphs_4}, at 5 {graphs_5}"
        pp = result["pp_mesh"]
        assert pp["compiled"] == pp["eager"] == pp["hf"], f"rank {rank}: pp2 mesh tokens {pp}"
        assert (pp["eager graphs"], pp["compiled graphs"]) == (0, 2), (
            f"rank {rank}: pp2 mesh stage graphs compiled in eager and compiled mode: {pp}, expected none and two "
            "(prefill, decode)")
        for mode in ("eager", "compiled"):
            assert f"({mode}, format v" in pp[f"{mode} plan"], f"rank {rank}: the pp2 {mode} stage plan: {pp}"


def test_mode_validation_and_auto_fallback() -> None:
    """No process group: a bad name and cuda_graph on the CPU raise saying what works; auto on the CPU is eager;
    training runs eager."""
    with pytest.raises(ValueError, match="runtime_mode must be one of"):
        autotp.RuntimeOptions(runtime_mode="graph")
    with pytest.raises(autotp.RuntimeModeError, match="cuda_graph needs a CUDA device.*runtime_mode='eager'"):
        resolve_runtime_mode("cuda_graph", torch.device("cpu"))
    with pytest.raises(autotp.RuntimeModeError, match="training=True runs eager"):
        resolve_runtime_mode("compiled", torch.device("cpu"), training=True)
    assert resolve_runtime_mode("auto", torch.device("cpu")) == "eager"
    assert resolve_runtime_mode("compiled", torch.device("cpu")) == "compiled"


def _loop(stop_check_every: int, eos_at: int, max_new_tokens: int) -> tuple[list[list[int]], int, int]:
    """The decode loop over a stand-in graph whose next token is the position + 1 in row 0 and + 2 in row 1
    (eos = ``eos_at``, pad 0): (tokens, graph calls, host reads)."""
    layout = CacheLayout(batch_size=2, max_cache_len=64, prefill_len=1, vocab_size=64, eos_token_ids=(eos_at,),
                         pad_token_id=0)
    calls = [0]

    def runner(phase: str) -> Any:
        def run(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            calls[0] += 1
            positions = inputs[1]  # (batch, 1)
            return torch.nn.functional.one_hot(positions + torch.tensor([[1], [2]]), 64).float()  # (batch, 1, vocab)
        return run

    with HostReads() as reads:
        tokens = generation_loop(layout, runner, torch.tensor([[5], [5]]), None, max_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=None, seed=None, streamer=None,
                                 pick=lambda logits, generator: logits.argmax(-1), stop_check_every=stop_check_every)
    return tokens.tolist(), calls[0], reads.count


def test_compiled_loop_reads_nothing_back_per_token() -> None:
    """No process group, a stand-in graph, batch 2, eos in the middle (row 1 ends a step before row 0 and is
    padded): with the stop check every k tokens (k = 1, EOS_CHECK_TOKENS, more than max_new_tokens) the loop
    reads from a tensor about once per k tokens, not per token, and returns HF's trimmed tokens for every k;
    a bad k raises saying what works."""
    from autotp.runtime.generation.generate import check_stop_check_every

    hf_trimmed = [[5, *range(1, 13)], [5, *range(2, 13), 0]]  # HF: stop when every row ended, pad the early one
    per_token = _loop(1, eos_at=12, max_new_tokens=20)
    assert per_token[0] == hf_trimmed, f"k=1: {per_token[0]}"
    assert per_token[2] >= 12, f"k=1: {per_token[2]} host reads for 12 tokens"
    for k in (EOS_CHECK_TOKENS, 25):
        tokens, calls, reads = _loop(k, eos_at=12, max_new_tokens=20)
        assert tokens == hf_trimmed, f"k={k}: {tokens}, HF's trimmed result {hf_trimmed}"
        decoded = min(20, -(-12 // k) * k)  # tokens made before a check saw the end (or max_new_tokens)
        checks = decoded // k  # host reads of "every row ended" in the loop; one more finds where to cut
        assert reads <= checks + 1, f"k={k}: {reads} host reads for 12 tokens, expected at most {checks + 1}"
        assert calls - per_token[1] == decoded - 12, f"k={k}: {calls} graph calls, per-token check {per_token[1]}"
    no_eos = _loop(EOS_CHECK_TOKENS, eos_at=60, max_new_tokens=20)
    assert no_eos[0] == [[5, *range(1, 21)], [5, *range(2, 22)]], f"without an eos in range: {no_eos[0]}"
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="stop_check_every must be an int >= 1"):
            check_stop_check_every(bad)
    check_stop_check_every(None)


def _linear_graph(rows: int) -> Any:
    """x (rows, 1, 3) -> linear(x, w1, b1) -> mm(., t(w2)) + linear(., w3) summed, and w3 is also read whole."""
    from torch import fx

    aten = torch.ops.aten
    graph = fx.Graph()
    w1, b1, w2, w3, x = (graph.placeholder(name) for name in ("w1", "b1", "w2", "w3", "x"))
    hidden = graph.call_function(aten.linear.default, (x, w1, b1))  # (rows, 1, 6)
    flat = graph.call_function(aten.view.default, (hidden, [rows, 6]))
    out = graph.call_function(aten.mm.default, (flat, graph.call_function(aten.t.default, (w2,))))  # (rows, 4)
    other = graph.call_function(aten.linear.default, (flat, w3))  # (rows, 6)
    graph.output((graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.sum.default, (other,)))),
                  graph.call_function(aten.sum.default, (w3,))))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.slow  # compiles with Inductor: the first compile in a process takes 15-25 s on 2 cores
@pytest.mark.parametrize("rows", [1, 4])
def test_compiled_decode_sums_one_row_linears(rows: int) -> None:
    """No process group: the compiled decode graph's linear layers of a CPU weight input (linear with bias, mm of
    a transpose, linear of a weight also read whole) go through one_row_linear, which sums one row and leaves
    more to the GEMM; float32 and bfloat16 results equal the eager graph's, also after a weight is written in
    place."""
    from autotp.runtime.execution.runtime_modes import graph_runner, one_row_linear, one_row_linears

    gm = _linear_graph(rows)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        generator = torch.Generator().manual_seed(0)
        weights = [torch.randn(6, 3, generator=generator), torch.randn(6, generator=generator),
                   torch.randn(4, 6, generator=generator), torch.randn(6, 6, generator=generator)]
        weights = [w.to(dtype) for w in weights]
        x = torch.randn(rows, 1, 3, generator=generator).to(dtype)
        rewritten = one_row_linears(gm, (*weights, x))
        summed = [n for n in rewritten.graph.nodes if n.target is one_row_linear]
        assert len(summed) == 3, f"{len(summed)} of the 3 linear layers go through one_row_linear"
        assert not [n for n in rewritten.graph.nodes if n.target is torch.ops.aten.t.default], "a transpose is left"
        run = graph_runner(gm, "compiled", what="decode")
        for step in range(3):
            if step == 2:
                weights[0].add_(1.0)  # written in place: the compiled graph reads the new values
            got, expected = run(*weights, x), gm(*weights, x)
            for g, e in zip(got, expected):
                assert g.dtype == e.dtype and torch.allclose(g.float(), e.float(), atol=atol, rtol=atol), (
                    f"{dtype}, {rows} rows, step {step}: compiled {g} != eager {e}")


@pytest.mark.slow  # compiles with Inductor: the first compile in a process takes 15-25 s on 2 cores
def test_compiled_decode_skips_guards_only_for_the_inputs_it_was_compiled_for() -> None:
    """No process group: after its first call the compiled decode graph runs without Dynamo's guards while its
    inputs are the first call's tensors or alike (same shape, stride, dtype, device) and the global state Dynamo
    guards on is as it was; an input of another size, a torch function mode, autocast or grad mode off go through
    the guards (Dynamo compiles again) and the result is still right."""
    from torch import fx

    from autotp.runtime.execution.runtime_modes import graph_runner

    gm = fx.symbolic_trace(_step)
    run = graph_runner(gm, "compiled", what="decode")
    cache, reference = torch.zeros(4, 3), torch.zeros(4, 3)
    for position in range(3):
        x, slot = torch.full((1, 3), float(position + 1)), torch.tensor([position])
        assert torch.equal(run(x, cache, slot)[0], gm(x, reference, slot)[0]), f"call {position + 1}"
    assert run.unguarded == 2, f"{run.unguarded} of the 2 calls after the first ran without guards"
    wide, wide_reference, x = torch.zeros(4, 5), torch.zeros(4, 5), torch.ones(1, 5)
    got, expected = run(x, wide, torch.tensor([0]))[0], gm(x, wide_reference, torch.tensor([0]))[0]
    assert torch.equal(got, expected), f"another size: {got} != {expected}"
    assert run.unguarded == 2, "a call with another size ran without guards"
    # the same inputs under state Dynamo guards on beyond them (a torch function mode, such as a
    # torch.device(...) block or a counter of host reads; autocast; no grad mode) go through the guards too
    for name, state in (("a torch function mode", HostReads), ("autocast", lambda: torch.autocast("cpu")),
                        ("grad mode off", torch.no_grad)):
        x, slot = torch.full((1, 3), 9.0), torch.tensor([3])
        with state():
            got = run(x, cache, slot)[0]
        assert torch.equal(got, gm(x, reference, slot)[0]), f"under {name}: {got}"
        assert run.unguarded == 2, f"under {name} a call ran without guards"
    x, slot = torch.full((1, 3), 5.0), torch.tensor([1])
    assert torch.equal(run(x, cache, slot)[0], gm(x, reference, slot)[0]) and run.unguarded == 3, (
        "back as compiled for: the guards are skipped again")
