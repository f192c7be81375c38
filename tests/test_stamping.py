"""Trace three layers, stamp the rest (autotp/capture/stamping.py): the program of a transformers decoder, and of
the KV-cache wrapper a generation compile traces, equals a whole ``torch.export`` of it node for node, and
models it cannot prove that for are exported whole."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from generation_models import tiny_gemma, tiny_phi
from models import tiny_gpt2, tiny_llama, tiny_mlp, tiny_qwen2
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from autotp.capture.kv_cache import CachedCausalLM
from autotp.capture.stamping import export_stamped
from autotp.capture.trace_cache import TraceCache
from autotp.capture.tracing import CapturedGraph, _export_whole, capture, default_dynamic_shapes, from_exported
from autotp.planning.plan import graph_fingerprint

SMALL = {"hidden": 64, "intermediate": 128, "seq_len": 8}
FAMILIES = {  # name -> (model and inputs, traced with dynamic batch and sequence dims, through the trace cache);
    # static traces are cheaper
    "llama, meta, dynamic": (lambda: tiny_llama(4, 2, layers=4, device="meta", **SMALL), True, True),
    "qwen2, meta": (lambda: tiny_qwen2(4, 2, layers=4, device="meta", **SMALL), False, False),
    "gpt2": (lambda: tiny_gpt2(4, layers=4, hidden=64, seq_len=8), False, False),
    "gemma": (lambda: tiny_gemma(4, layers=4, **SMALL), False, False),
    "phi": (lambda: tiny_phi(4, layers=4, **SMALL), False, False),
    "llama, int8": (lambda: _int8(*tiny_llama(4, 2, layers=4, **SMALL)), False, True),
}


def _int8(model: torch.nn.Module, *rest: Any) -> tuple[Any, ...]:
    """``model`` with torchao int8 weight-only Linears: its program is functionalized before stamping, which
    splits each weight into its parts (``parametrizations.weight.original<i>``), stamped as the layer's weights."""
    import torchao.quantization as tq

    tq.quantize_(model, tq.Int8WeightOnlyConfig())
    return (model, *rest)


def _structure(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """Every node as (placeholder name, op, target, arguments by node position, value's shape/stride/dtype,
    module path): what a plan depends on, with the numbering of intermediate names left out."""
    position = {node: f"%{i}" for i, node in enumerate(gm.graph.nodes)}
    described = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = (f"{tuple(val.shape)} {tuple(val.stride())} {val.dtype}" if isinstance(val, torch.Tensor) else repr(val))
        stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        described.append((node.name if node.op == "placeholder" else "", node.op, str(node.target),
                          str(fx.map_arg((node.args, node.kwargs), position.__getitem__)), shape, str(stack)))
    return described


@pytest.mark.slow  # exports each family whole and stamped: up to 7 s each on 2 cores
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stamped_program_equals_a_whole_export(family: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No parallelism (capture only), 4 layers of each family (meta models traced as fake tensors, as
    from_pretrained does; the others with real weights; Llama with dynamic batch and sequence dims; an int8
    Llama, its weights split into their parts): capture exports a 3-layer twin and stamps the 4th layer (the
    meta and the int8 Llama: the trace cache keeps the twin's program and binds the model's weights to it and stamps
    it again to the same graph); graph, signature, state, constants, symbolic ranges and module call graph equal a
    whole export's (node names too, within the layers)."""
    build, dynamic, through_cache = FAMILIES[family]
    model, args, kwargs = build()
    exported: list[int] = []
    original = torch.export.export

    def spy(traced, *rest, **options):
        exported.append(sum(1 for _ in traced.parameters()))
        return original(traced, *rest, **options)

    monkeypatch.setattr(torch.export, "export", spy)
    cache = TraceCache(tmp_path) if through_cache else None
    captured = capture(model, args, kwargs, dynamic=dynamic, trace_cache=cache)
    monkeypatch.setattr(torch.export, "export", original)
    every = sum(1 for _ in model.parameters())
    assert len(exported) == 1 and exported[0] < every, \
        f"expected one export of a twin with fewer than {every} parameters, got exports with {exported}"
    if cache is not None:
        again = capture(model, args, kwargs, dynamic=dynamic, trace_cache=cache)  # the twin's program, stamped again
        assert again.from_cache, "the second capture should read the trace cache"
        assert graph_fingerprint(again.graph_module) == graph_fingerprint(captured.graph_module), \
            "the program stamped from the cached twin differs from the one stamped after export"
    whole = from_exported(_export_whole(model, args, kwargs, default_dynamic_shapes(model, args, kwargs) if dynamic else None), family)
    _check_same_program(captured, whole, (".layers.3", ".h.3"))


def _check_same_program(captured: CapturedGraph, whole: CapturedGraph, fourth_layer: tuple[str, ...]) -> None:
    """``captured`` (stamped) equals ``whole`` (a whole export): nodes, signature, state, constants, symbolic
    ranges, module call graph, and the names of the nodes of the layer at ``fourth_layer`` (a module path part)."""
    stamped_nodes, whole_nodes = _structure(captured.graph_module), _structure(whole.graph_module)
    assert len(stamped_nodes) == len(whole_nodes), f"nodes: stamped {len(stamped_nodes)}, whole export {len(whole_nodes)}"
    for index, (got, expected) in enumerate(zip(stamped_nodes, whole_nodes)):
        assert got == expected, f"node {index}: stamped {got}, whole export {expected}"
    ours, theirs = captured.exported, whole.exported
    assert str(ours.graph_signature) == str(theirs.graph_signature), \
        f"signatures differ:\n{ours.graph_signature}\nvs\n{theirs.graph_signature}"
    assert list(ours.state_dict) == list(theirs.state_dict), "state dict keys differ"
    assert list(ours.constants) == list(theirs.constants), "constants differ"
    assert str(ours.range_constraints) == str(theirs.range_constraints), \
        f"ranges: {ours.range_constraints} vs {theirs.range_constraints}"
    assert [e.fqn for e in ours.module_call_graph] == [e.fqn for e in theirs.module_call_graph], "module call graphs differ"

    def layer_names(gm: fx.GraphModule) -> list[str]:
        return [n.name for n in gm.graph.nodes if any(p in str(n.meta.get("nn_module_stack")) for p in fourth_layer)]

    ours_named, theirs_named = layer_names(captured.graph_module), layer_names(whole.graph_module)
    assert ours_named and ours_named == theirs_named, f"the stamped layer's node names differ: {ours_named[:5]}..."


GENERATING = {  # the generation compile's cache wrapper around 4 layers of each; the cache writes functionalized
    "llama, meta": (lambda: tiny_llama(4, 2, layers=4, device="meta", **SMALL)[0], 6),
    "gpt2": (lambda: tiny_gpt2(4, layers=4, hidden=64, seq_len=8)[0], 6),
    "gemma": (lambda: tiny_gemma(4, layers=4, **SMALL)[0], 6),
    "llama, int8": (lambda: _int8(*tiny_llama(4, 2, layers=4, **SMALL))[0], 6),
}


@pytest.mark.slow  # exports the prefill and decode graphs of each family twice: 6-14 s each on 2 cores
@pytest.mark.parametrize("family", list(GENERATING))
def test_generation_graphs_are_stamped_with_their_cache(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No parallelism (capture only), the KV-cache wrapper a generation compile traces
    (``CachedCausalLM``, 4 layers): its decode graph and a prompt's first-chunk graph are exported with 3 layers,
    functionalized there (3 layers' cache writes, not 4; int8 weights split into their parts), and stamped out with
    the 4th layer's cache buffers and their updates; each equals a whole export's functional program node for
    node, with the same signature (every layer's cache update among the outputs)."""
    build, writes = GENERATING[family]
    wrapper = CachedCausalLM(build(), batch_size=2, max_cache_len=12, last_logits_only=True,
                             inputs_device=torch.device("cpu"))
    functionalized: list[int] = []
    exported: list[int] = []
    original, original_export = ExportedProgram.run_decompositions, torch.export.export

    def spy(program, *rest, **options):
        functionalized.append(sum(1 for n in program.graph.nodes if n.target == torch.ops.aten.index_copy_.default))
        return original(program, *rest, **options)

    def export_spy(traced, *rest, **options):
        exported.append(len(traced.cache_buffer_names()))
        return original_export(traced, *rest, **options)

    for phase, tokens in (("decode", 1), ("first chunk", 4)):
        with wrapper.first_chunk() if phase == "first chunk" else contextlib.nullcontext():
            monkeypatch.setattr(ExportedProgram, "run_decompositions", spy)
            monkeypatch.setattr(torch.export, "export", export_spy)
            functionalized.clear()
            exported.clear()
            captured = capture(wrapper, wrapper.example_inputs(tokens), dynamic=False)
            assert exported == [6], f"{family} {phase}: expected one export of a twin with 3 layers' cache, got {exported}"
            assert functionalized == [writes], (
                f"{family} {phase}: expected one functionalization of {writes} cache writes, got {functionalized}")
            monkeypatch.setattr(ExportedProgram, "run_decompositions", original)
            monkeypatch.setattr(torch.export, "export", original_export)
            whole = from_exported(_export_whole(wrapper, wrapper.example_inputs(tokens), {}, None), family)
        updated = [str(spec.target) for spec in captured.exported.graph_signature.output_specs
                   if spec.kind == OutputKind.BUFFER_MUTATION]
        assert updated == wrapper.cache_buffer_names(), f"{family} {phase}: the graph updates {updated}"
        _check_same_program(captured, whole, (".layers.3", ".h.3"))


def test_models_not_provably_uniform_are_exported_whole(caplog: pytest.LogCaptureFixture) -> None:
    """No parallelism: Qwen2 with sliding-window attention on some layers only (config.layer_types mixed), a
    3-layer Llama (nothing to stamp) and a plain torch MLP (no config) are not stamped: no export is made for
    a twin, and the reason is logged at debug level."""
    exports: list[str] = []

    def export(model, *rest):
        exports.append(type(model).__name__)
        raise AssertionError("no twin should be exported")

    mixed, args, kwargs = tiny_qwen2(4, 2, layers=4, device="meta", **SMALL)
    mixed.config.layer_types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    shallow, _, _ = tiny_llama(4, 2, layers=3, device="meta", **SMALL)
    plain, plain_args, _ = tiny_mlp(hidden=16, intermediate=32)
    with caplog.at_level(logging.DEBUG, logger="autotp.capture.stamping"):
        for model, inputs in ((mixed, args), (shallow, args), (plain, plain_args)):
            assert export_stamped(model, inputs, {}, None, export) is None, f"{type(model).__name__} was stamped"
    assert exports == [], f"twins exported: {exports}"
    for reason in ("config.layer_types differs between layers", "3 layers: fewer than 4", "no config.num_hidden_layers"):
        assert reason in caplog.text, f"expected the reason {reason!r} in the debug log: {caplog.text!r}"
