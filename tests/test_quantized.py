"""torchao-quantized weights (int8 and float8 weight-only): each weight's parts split together.

Tier (a), no process group: the adapter names a weight's parts as export does; a scheme autotp
does not split (int4, int4 in int8, activation quantization) raises UnsupportedQuantizationError
before tracing; the plan counts the parts' bytes as stored (int8 data: about 1/4 of float32's).
Tier (c), real gloo at tp=2 and tp=3: a quantized MLP (int8, float8) and a tiny Llama (int8)
give the single-process quantized model's outputs within 1e-4, every part follows its data's
placement (scales split with a column split, whole under a row split), and at tp=2 greedy
``tp.generate`` gives HF ``generate``'s tokens of the quantized model.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torchao.quantization as tq
from models import tiny_llama

import autotp
from autotp.adapters import hf_transformers
from autotp.adapters import torchao as adapter

NEW_TOKENS = 6


def _mlp(bias: bool = True, hidden: int = 128) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden, bias=bias), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 32, bias=bias)).eval()
    return model, (torch.randn(4, 64),), {}


GROUP = 32
CONFIGS = {
    "int8": lambda: tq.Int8WeightOnlyConfig(),
    "int8group": lambda: tq.Int8WeightOnlyConfig(granularity=tq.PerGroup(GROUP)),
    "int4group": lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(GROUP)),
    "float8": lambda: tq.Float8WeightOnlyConfig(),
}
"""Weight-only schemes that run on this CPU; int4 is IntxWeightOnlyConfig's (int4 values held in int8)."""


ROW_SPLIT = {"mlp-int4group": autotp.PlanOptions(constraints={"2.parametrizations.weight.original0": "S(1)"},
                                                 memory_budget=None)}
"""Cases whose second Linear is pinned to a row split (the solver splits its columns otherwise)."""


GENERATION_LAYERS = 4
"""The generating Llama's: its graphs are traced with three layers, functionalized there (each quantized weight split
into its parts), and stamped out to the fourth (autotp.capture.stamping)."""


def _quantized(case: str, layers: int = 2) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    family, scheme = case.split("-")
    model, args, kwargs = _mlp() if family == "mlp" else tiny_llama(batch=2, seq_len=6, layers=layers)
    tq.quantize_(model, CONFIGS[scheme]())
    return model, args, kwargs


def _part_placements(plan: autotp.Plan, model: torch.nn.Module) -> dict[str, dict[int, tuple[str, tuple[int, ...]]]]:
    """Weight FQN -> part index -> (placement text, part shape), for every quantized weight of ``plan``."""
    shapes = {fqn: [s for _, s, _ in weight.parts] for fqn, weight in adapter.quantized_weights(model).items()}
    found: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {}
    for fqn, placement in plan.parameters.items():
        part = adapter.weight_of(fqn)
        if part is not None:
            found.setdefault(part[0], {})[part[1]] = (str(placement), shapes[part[0]][part[1]])
    return found


def _inconsistent(parts: dict[str, dict[int, tuple[str, tuple[int, ...]]]]) -> list[str]:
    """Parts that do not follow their data: split along the data's split dim d, or whole where they have
    length 1 along d (a per-row scale under a row split) or the data is whole."""
    bad = []
    for fqn, by_index in parts.items():
        data = by_index[0][0]
        for i, (placement, part_shape) in by_index.items():
            split = int(data[2]) if data.startswith("S(") else None
            wanted = data if split is not None and part_shape[split] > 1 else "R"
            if i and placement != wanted:
                bad.append(f"{fqn} part {i} {part_shape}: {placement} (data {data}, expected {wanted})")
    return bad


def _compile_and_compare(rank: int, world_size: int, cases: list[str], generate: bool) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        model, args, kwargs = _quantized(case)
        with torch.no_grad():
            expected = model(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=args, example_kwargs=kwargs or None, options=ROW_SPLIT.get(case))
        got = tp(*args, **kwargs)
        if not isinstance(got, torch.Tensor):
            got, expected = got.logits, expected.logits
        local = {name.removeprefix("_local."): tuple(t.shape) for name, t in tp.state_dict().items()}
        results[case] = {"diff": (got - expected).abs().max().item(), "parts": _part_placements(tp.plan, model),
                         "bytes": tp.parameter_bytes(), "planned_bytes": tp.plan.parameter_bytes_per_rank,
                         # the second Linear (32, 128): this rank's data and scales
                         "local": [local.get(f"p_2_parametrizations_weight_original{i}") for i in (0, 1)]}
    if generate:
        model, (ids,), _ = _quantized("llama-int8", layers=GENERATION_LAYERS)
        model.generation_config.pad_token_id = 0
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        float_model, _, _ = tiny_llama(batch=2, seq_len=6, layers=GENERATION_LAYERS)  # the same weights, not quantized
        float_model.generation_config.pad_token_id = 0
        results["float tokens"] = float_model.generate(ids, attention_mask=torch.ones_like(ids),
                                                       max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        if not hf_transformers.GENERATION_RELEASES.admits(hf_transformers.installed_release()):
            with pytest.raises(autotp.UnsupportedReleaseError, match="supports for generation"):
                autotp.compile(model, example_inputs=(ids,), max_cache_len=16)
            return results  # below the generation range: refused, as on a model that is not quantized
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, example_inputs=(ids,), max_cache_len=16)
        results["generate"] = {"got": tp.generate(ids, max_new_tokens=NEW_TOKENS).tolist(),
                               "expected": expected.tolist()}
    return results


def _check(results: list[dict[str, Any]], cases: list[str], world_size: int) -> None:
    for rank, result in enumerate(results):
        for case in cases:
            diff = result[case]["diff"]
            assert diff <= 1e-4, f"tp={world_size} rank {rank} {case}: max |tp - quantized model| {diff:.3g}, expected <= 1e-4"
            parts = result[case]["parts"]
            assert parts, f"tp={world_size} {case}: no quantized weight parts in the plan"
            assert not _inconsistent(parts), f"tp={world_size} {case}: {_inconsistent(parts)}"
            split = {by_index[0][0] for by_index in parts.values()}
            assert {"S(0)", "S(1)"} <= split, f"tp={world_size} {case}: data placements {split}, expected column and row splits"
    for case in (c for c in cases if "group" in c):  # every rank holds whole groups of 32 columns
        for rank, result in enumerate(results):
            (rows, columns), (_, groups) = result[case]["local"]
            assert columns == groups * GROUP, (
                f"tp={world_size} rank {rank} {case}: {columns} data columns with {groups} groups of scales")
    # the plan sizes each shard alone (ceil); uneven cuts shared by several tensors (8 heads over 3 ranks) can
    # give a rank more (passes/uneven.py), so the bytes held equal the plan's where every split is even
    for case in cases if world_size == 2 else ():
        held = max(result[case]["bytes"] for result in results)
        planned = results[0][case]["planned_bytes"]
        assert held == planned, f"tp={world_size} {case}: largest rank holds {held} parameter bytes, the plan says {planned}"
    for rank, result in enumerate(results):
        if "generate" in result:
            got, expected = result["generate"]["got"], result["generate"]["expected"]
            assert expected != result["float tokens"], "the int8 model generates the float model's tokens: the check cannot fail"
            assert got == expected, f"tp={world_size} rank {rank}: tokens {got}, HF generate gave {expected}"


def test_quantized_models_match_at_tp2_and_generate(gloo: Any) -> None:
    """tp=2: MLP in int8, float8 and group-wise int4; int8 tiny Llama (forward, and greedy generation
    with a KV cache on four layers)."""
    cases = ["mlp-int8", "mlp-float8", "mlp-int4group", "llama-int8"]
    _check(gloo.run(2, _compile_and_compare, cases, True, timeout_s=600), cases, 2)


def test_quantized_models_match_at_tp3(gloo: Any) -> None:
    """tp=3, uneven splits (128 rows, 8 heads over 3 ranks; the row split of a 128-wide weight in groups of
    32 keeps whole groups: 2/1/1 of 4): MLP in int8 and group-wise int8, int8 tiny Llama."""
    cases = ["mlp-int8", "mlp-int8group", "llama-int8"]
    _check(gloo.run(3, _compile_and_compare, cases, False, timeout_s=600), cases, 3)


def test_adapter_names_the_parts_as_export_does() -> None:
    """A weight's parts in __tensor_flatten__ order, named parametrizations.<name>.original<i> by export."""
    model, _, _ = _quantized("mlp-int8")
    weights = adapter.quantized_weights(model)
    assert sorted(weights) == ["0.weight", "2.weight"], sorted(weights)
    first = weights["0.weight"]
    assert (first.scheme, first.shape) == ("Int8Tensor", (128, 64)), (first.scheme, first.shape)
    assert [(n, s, d) for n, s, d in first.parts] == [
        ("qdata", (128, 64), torch.int8), ("scale", (128, 1), torch.float32), ("zero_point", (128, 1), torch.int8)]
    assert first.part_names() == {"0.parametrizations.weight.original0": "qdata",
                                  "0.parametrizations.weight.original1": "scale",
                                  "0.parametrizations.weight.original2": "zero_point"}
    assert adapter.weight_of("model.layers.3.mlp.up_proj.parametrizations.weight.original1") == (
        "model.layers.3.mlp.up_proj.weight", 1)
    assert adapter.weight_of("model.layers.3.mlp.up_proj.weight") is None
    plan = autotp.plan(model, (torch.randn(4, 64),), world_size=2)
    exported = {fqn for fqn in plan.parameters if adapter.weight_of(fqn)}
    assert exported == set(first.part_names()) | set(weights["2.weight"].part_names()), sorted(exported)


def _int4_tensor_model() -> torch.nn.Module:
    """A Linear holding torchao's Int4Tensor (group size 32), built by hand: torchao 0.18 makes one only
    with a CUDA kernel library (mslk), so int4 weight-only cannot run on this CPU."""
    from torchao.quantization import Int4Tensor

    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False)).eval()
    weight = Int4Tensor(torch.zeros(128, 32, dtype=torch.uint8), torch.ones(2, 128, dtype=torch.bfloat16),
                        torch.zeros(2, 128, dtype=torch.bfloat16), [1, 32], torch.Size([128, 64]))
    model[0].weight = torch.nn.Parameter(weight, requires_grad=False)
    return model


@pytest.mark.parametrize("scheme", ["int4", "int8-dynamic-activation"])
def test_an_unsupported_scheme_raises_naming_it_and_what_is_supported(scheme: str) -> None:
    """int4 in Int4WeightOnlyConfig's packed layout (Int4Tensor) and int8 with activation quantization are
    refused before tracing, with the weight and the schemes that work."""
    if scheme == "int4":
        model, name = _int4_tensor_model(), "Int4Tensor"
    else:
        model, name = _mlp()[0], "activation quantization"
        tq.quantize_(model, tq.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(autotp.UnsupportedQuantizationError) as raised:
        autotp.plan(model, (torch.randn(4, 64),), world_size=2)
    message = str(raised.value)
    for wanted in ("0.weight", name, "Int8WeightOnlyConfig", "Float8WeightOnlyConfig"):
        assert wanted in message, f"{wanted!r} not in: {message}"


@pytest.mark.parametrize("scheme", ["int8", "float8"])
def test_parameter_bytes_are_counted_as_stored(scheme: str) -> None:
    """tp=2, bias-free MLP 64 -> 512 -> 32: int8/float8 data (1 byte) plus float32 per-row scales (and int8
    zero points), about 1/4 of the float32 model's bytes per rank; exactly the parts' shard bytes."""
    model, args, _ = _mlp(bias=False, hidden=512)
    full = autotp.plan(model, args, world_size=2)
    tq.quantize_(model, tq.Int8WeightOnlyConfig() if scheme == "int8" else tq.Float8WeightOnlyConfig())
    plan = autotp.plan(model, args, world_size=2)
    parts = _part_placements(plan, model)
    assert not _inconsistent(parts), _inconsistent(parts)
    read = {name for node in plan.nodes for name in node.input_nodes}
    expected = 0  # the parts the graph reads (symmetric int8 never reads its zero points; nothing keeps them)
    for fqn, weight in adapter.quantized_weights(model).items():
        for index, (_, shape, dtype) in enumerate(weight.parts):
            if "p_" + adapter.exported_name(fqn, index).replace(".", "_") not in read:
                continue
            placement = parts[fqn][index][0]
            split = int(placement[2]) if placement.startswith("S(") else None
            kept = [-(-size // 2) if d == split else size for d, size in enumerate(shape)]
            expected += math.prod(kept) * torch.empty((), dtype=dtype).element_size()
    assert plan.parameter_bytes_per_rank == expected, (plan.parameter_bytes_per_rank, expected)
    ratio = plan.parameter_bytes_per_rank / full.parameter_bytes_per_rank
    assert 0.25 < ratio < 0.27, f"quantized / float32 bytes per rank {ratio:.3f}, expected about 1/4"


@pytest.mark.parametrize(("granularity", "scale_under_row_split"), [("group", "S(1)"), ("row", "R")])
def test_dequantize_affine_splits_scales_by_block(granularity: str, scale_under_row_split: str) -> None:
    """No process group: torchao.dequantize_affine of (128, 64) int4 data. S(0) splits data, scales and zero
    points by rows; S(1) splits group-wise scales (groups of 32) by groups and keeps per-row ones (one block of
    64) whole."""
    from autotp.capture.tracing import capture
    from autotp.passes.rules import RuleContext, strategies_for

    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False)).eval()
    tq.quantize_(model, tq.IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=tq.PerGroup(GROUP) if granularity == "group" else tq.PerAxis(0)))
    graph = capture(model, (torch.randn(4, 64),)).graph_module.graph
    (node,) = [n for n in graph.nodes if n.op == "call_function" and "dequantize_affine" in str(n.target)]
    found = {str(s.output): [str(p) for p in s.inputs] for s in strategies_for(node, RuleContext(world_size=2))}
    expected = {"R": ["R", "R", "R"], "S(0)": ["S(0)", "S(0)", "S(0)"],
                "S(1)": ["S(1)", scale_under_row_split, scale_under_row_split]}
    assert found == expected, f"strategies {found}, expected {expected}"


@pytest.mark.slow  # quantizes, traces and plans a model: about 6 s on 2 cores
def test_the_plan_text_shows_a_quantized_weight_once() -> None:
    """tp=2, int8 tiny Llama: print(plan) names each quantized weight once (q_proj.weight S(0)q), never its parts,
    under the weight's own module (lm_head, not lm_head.parametrizations)."""
    model, args, kwargs = _quantized("llama-int8")
    text = str(autotp.plan(model, args, kwargs, world_size=2))
    assert "parametrizations" not in text, text
    for wanted in ("self_attn.q_proj.weight S(0)q", "self_attn.o_proj.weight S(1)q", "lm_head.weight", "(q: quantized"):
        assert wanted in text, f"{wanted!r} not in:\n{text}"


def test_a_quantized_model_traces_the_same_twice() -> None:
    """No process group: tracing a quantized model leaves each weight the same quantized parameter (torch's own
    unparametrize puts a weight that needs no grad back as a buffer), so a second trace of it, as generation
    makes after a plain compile, still reads the quantized parts; on meta too, where a float weight of the same
    shape would otherwise be traced silently."""
    from autotp.capture.tracing import capture

    for device in ("cpu", "meta"):
        model, args, kwargs = tiny_llama(batch=1, seq_len=4, layers=1, device=device)
        tq.quantize_(model, CONFIGS["int8"]())
        before = dict(model.named_parameters())
        ids = torch.zeros(1, 4, dtype=torch.long)
        first, second = (capture(model, (ids,), kwargs, dynamic=False) for _ in range(2))
        assert dict(model.named_parameters()) == before, f"{device}: the parameters changed while tracing"
        assert not dict(model.named_buffers()).keys() & before.keys(), f"{device}: a weight became a buffer"
        for graph in (first, second):
            names = [str(slot.target) for slot in graph.inputs if slot.kind == "parameter"]
            assert "model.layers.0.self_attn.q_proj.parametrizations.weight.original0" in names, f"{device}: {names}"
            assert "model.layers.0.self_attn.q_proj.weight" not in names, f"{device}: {names}"
