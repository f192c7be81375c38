"""Tiers (a) and (b): every op of every model family has a rule; new rules; fallback and bad input.

No process group here except the fake one of the last tests; the gloo runs of the same models
are in ``test_equivalence.py``.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.fx as fx
from models import BUILDERS, tiny_mixtral
from torch import nn

import autotp
from autotp.base.errors import CaptureError, UnsupportedOpError
from autotp.base.placements import BlockShard, Partial, Replicate, Shard
from autotp.capture.tracing import capture
from autotp.passes.rules import RuleContext, has_rule, strategies_for

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _graph(fn, *inputs: torch.Tensor) -> fx.GraphModule:
    class Wrap(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    return capture(Wrap(), inputs).graph_module


def _node(gm: fx.GraphModule, target: object) -> fx.Node:
    found = [n for n in gm.graph.nodes if n.target is target]
    assert found, f"no {target} node in graph:\n{gm.graph}"
    return found[0]


def _pairs(node: fx.Node, world_size: int = 2, blocks: frozenset[int] = frozenset()) -> set:
    return {(s.inputs, s.output) for s in strategies_for(node, RuleContext(world_size, blocks))}


@functools.cache
def _meta_graph(name: str) -> fx.GraphModule:
    """The captured graph of ``BUILDERS[name]`` on meta, once per session (tests only read it)."""
    model, args, kwargs = BUILDERS[name](device="meta")
    args = tuple(a.to("meta") for a in args)
    return capture(model, args, kwargs).graph_module


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_op_of_every_family_has_a_rule(name: str) -> None:
    """No mesh: no op of Llama, GPT-2, BERT, Mistral, Qwen2, Mixtral, the tied LM, the CNN or the MLP falls back."""
    gm = _meta_graph(name)
    missing = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and not has_rule(n)})
    assert not missing, f"{name}: ops without a sharding rule: {missing}"


def test_mixtral_experts_run_through_the_grouped_mm_custom_op() -> None:
    """No mesh: transformers' default experts path under export is transformers::grouped_mm_fallback, ruled by name."""
    gm = _meta_graph("mixtral")
    grouped = [n for n in gm.graph.nodes if n.op == "call_function" and "grouped_mm" in str(n.target)]
    assert len(grouped) == 4, f"expected 2 layers x (gate_up, down) grouped GEMMs, got {[str(n.target) for n in grouped]}"
    node = grouped[0]
    pairs = _pairs(node, 2, frozenset({2}))
    assert ((R, Shard(2), R), Shard(1)) in pairs, f"column-parallel experts missing: {pairs}"
    assert ((R, BlockShard(2, 2), R), BlockShard(1, 2)) in pairs, f"fused gate/up block split missing: {pairs}"
    assert ((Shard(1), Shard(1), R), P) in pairs, f"row-parallel experts missing: {pairs}"
    assert not any(isinstance(s.inputs[0], Shard) and s.inputs[0].dim == 0 for s in strategies_for(node, RuleContext(2))), \
        "rows must not be split: the group offsets are global row positions"


def test_mixtral_batched_mm_path_is_covered_too() -> None:
    """No mesh: experts_implementation='batched_mm' (gather expert weights per token, bmm) has rules for every op."""
    model, args, kwargs = tiny_mixtral(layers=1, experts_implementation="batched_mm", device="meta")
    gm = capture(model, tuple(a.to("meta") for a in args), kwargs).graph_module
    missing = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and not has_rule(n)})
    assert not missing, f"ops without a rule: {missing}"


def test_mixtral_eager_experts_are_refused_with_the_fix() -> None:
    """No mesh: the eager expert loop is data-dependent control flow; the error names the line and what to do."""
    model, args, kwargs = tiny_mixtral(layers=1, experts_implementation="eager")
    with pytest.raises(CaptureError, match=r"(?s)could not trace.*modeling_mixtral.py.*select with torch.where"):
        capture(model, args, kwargs)


def test_large_vocabulary_output_projection_is_split_over_the_vocabulary() -> None:
    """tp=8 (planning on meta, h100-sxm): Llama-3-8B shapes (vocab 128256, hidden 4096, seq 2048), 2 layers.

    The output projection pays to split over the vocabulary (column-parallel, logits gathered):
    row-parallel would all-reduce full-size logits, twice the bytes. Neither vocabulary matrix
    stays whole."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    plan = autotp.plan(model, (torch.zeros(1, 2048, dtype=torch.long),), {"use_cache": False}, world_size=8)
    assert plan.parameters["lm_head.weight"] == "S(0)", plan.parameters["lm_head.weight"]
    assert plan.parameters["model.embed_tokens.weight"] != "R"


def test_embedding_offers_vocabulary_split() -> None:
    """tp=3: embedding weight S(0) gives a Partial output (rows looked up on the rank that holds them)."""
    gm = _graph(lambda w, ids: nn.functional.embedding(ids, w), torch.randn(10, 4), torch.randint(0, 10, (2, 5)))
    pairs = _pairs(_node(gm, aten.embedding.default), 3)
    assert ((Shard(0), R), P) in pairs and ((Shard(1), R), Shard(2)) in pairs, pairs
    assert ((Shard(0), R), P) not in _pairs(_node(gm, aten.embedding.default), 11), "11 ranks cannot share 10 rows"


def test_convolution_splits_channels_and_depthwise_groups() -> None:
    """tp=2: conv2d splits output channels (w S(0)), input channels (-> P, bias P), batch; depthwise splits groups."""
    x, w, b = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(6)
    gm = _graph(lambda x, w, b: nn.functional.conv2d(x, w, b, padding=1), x, w, b)
    pairs = _pairs(_node(gm, aten.conv2d.default))
    assert ((R, Shard(0), Shard(0)), Shard(1)) in pairs, pairs
    assert ((Shard(1), Shard(1), P), P) in pairs, pairs
    assert ((Shard(0), R, R), Shard(0)) in pairs, pairs
    assert not any(s.output == Shard(2) or s.output == Shard(3) for s in strategies_for(_node(gm, aten.conv2d.default), RuleContext(2))), \
        "spatial dims need a halo: never split"
    gm = _graph(lambda x, w: nn.functional.conv2d(x, w, groups=4), x, torch.randn(8, 1, 3, 3))
    pairs = _pairs(_node(gm, aten.conv2d.default))
    assert ((Shard(1), Shard(0)), Shard(1)) in pairs, f"depthwise (channel multiplier 2) split by groups missing: {pairs}"
    gm = _graph(lambda x, w: nn.functional.conv2d(x, w, groups=2), x, torch.randn(6, 2, 3, 3))
    assert not any(s.inputs[:2] == (Shard(1), Shard(0)) for s in strategies_for(_node(gm, aten.conv2d.default), RuleContext(2))), \
        "groups of 2 in / 3 out channels: a proportional cut could fall inside a group"


def test_index_rule_maps_non_adjacent_indices_to_the_front() -> None:
    """tp=2: x[i, :, j] with x (4, 6, 5) puts the index dims first: (3, 6); dim 1 of x becomes dim 1 of the output."""
    gm = _graph(lambda x, i, j: x[i, :, j], torch.randn(4, 6, 5), torch.tensor([0, 1, 3]), torch.tensor([4, 0, 2]))
    pairs = _pairs(_node(gm, aten.index.Tensor))
    assert ((Shard(1), R, R), Shard(1)) in pairs, pairs
    assert ((R, Shard(0), Shard(0)), Shard(0)) in pairs, pairs
    assert ((P, R, R), P) in pairs


def test_gather_and_scatter_keep_other_dims_split() -> None:
    """tp=2: gather/scatter_add along dim 1 keep dim 0 split in every operand; scatter_add passes sums through."""
    x, idx = torch.randn(4, 6), torch.randint(0, 6, (4, 6))
    gm = _graph(lambda x, i: torch.gather(x, 1, i), x, idx)
    assert ((Shard(0), Shard(0)), Shard(0)) in _pairs(_node(gm, aten.gather.default))
    gm = _graph(lambda x, i, s: x.scatter_add(1, i, s), x, idx, torch.randn(4, 6))
    pairs = _pairs(_node(gm, aten.scatter_add.default))
    assert ((Shard(0), Shard(0), Shard(0)), Shard(0)) in pairs and ((P, R, P), P) in pairs, pairs


def test_topk_keeps_rows_split() -> None:
    """tp=2: top-k over experts (last dim) keeps the token dim split; the expert dim is never split."""
    gm = _graph(lambda x: torch.topk(x, 2, dim=-1), torch.randn(8, 4))
    outputs = {s.output for s in strategies_for(_node(gm, aten.topk.default), RuleContext(2))}
    assert outputs == {R, Shard(0)}, outputs


def test_inplace_updates_of_intermediates_are_functionalized() -> None:
    """No mesh: h /= s and h[:, 0] = v inside forward become out-of-place ops (a copy on one rank cannot update another)."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            h /= h.abs().sum(-1, keepdim=True) + 1.0
            h[:, 0] = 0.5
            return h

    gm = capture(InPlace(), (torch.randn(4, 8),)).graph_module
    mutating = [str(n.target) for n in gm.graph.nodes
                if n.op == "call_function" and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable]
    assert not mutating, f"in-place ops left in the planned graph: {mutating}"


# --------------------------------------------------------------------------- fallback and strict mode

class _Unruled(nn.Module):
    """An MLP with two ops that have no sharding rule (Bessel J0 and digamma) between its projections."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.special.bessel_j0(self.up(x))
        return self.down(torch.digamma(h + 2.0))


def test_fallback_ops_are_named_once() -> None:
    """tp=2 (planning only): ops without rules run replicated, are listed in plan.fallback_ops and in exactly one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autotp.plan(_Unruled(), (torch.randn(2, 4, 16),), world_size=2)
    assert plan.fallback_ops == ("aten.digamma.default", "aten.special_bessel_j0.default"), plan.fallback_ops
    ours = [w for w in caught if "autotp" in str(w.message)]
    assert len(ours) == 1, f"expected one warning, got {[str(w.message) for w in ours]}"
    assert "aten.digamma.default" in str(ours[0].message) and "aten.special_bessel_j0.default" in str(ours[0].message)
    decisions = {n.op: n for n in plan.nodes}
    assert decisions["aten.digamma.default"].output == "R" and decisions["aten.digamma.default"].fallback


def test_strict_lists_every_unruled_op_with_its_line() -> None:
    """tp=2 (planning only): strict=True raises naming each unruled node and the line of forward() that made it."""
    with pytest.raises(UnsupportedOpError) as info:
        autotp.plan(_Unruled(), (torch.randn(2, 4, 16),), world_size=2, options=autotp.PlanOptions(strict=True))
    text = str(info.value)
    for op in ("aten.special_bessel_j0.default", "aten.digamma.default"):
        assert op in text, f"{op} missing from:\n{text}"
    assert text.count("test_op_coverage.py") >= 2 and "in forward" in text, f"locations missing from:\n{text}"
    assert "strict=False" in text, "the message says how to run them replicated instead"


# --------------------------------------------------------------------------- bad input

class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _DataDependent(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return self.proj(x)
        return x


class _IntOutput(_Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.proj(x), x.shape[0]


class _InputUpdate(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.proj(x)


def _train_batch_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()


def _train_dropout() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).train()


class _TensorCond(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.proj(x), lambda x: x * 2.0, (x,))


BAD_INPUTS = [
    (_DataDependent, r"(?s)could not trace _DataDependent.*test_op_coverage.py.*in forward.*select with torch.where"),
    (_IntOutput, r"neither a tensor nor a constant of the trace \(output 1: 4 of type int, computed from the inputs' "
                 r"sizes or values\).*return the value as a tensor"),
    (_InputUpdate, r"updates its input\(s\) in place: x\..*x = x \+ 1"),
    (_train_batch_norm, r"updates buffers in place: 1.running_mean, 1.running_var, 1.num_batches_tracked\. "
                        r"1.running_mean, 1.running_var are running statistics.*model.eval\(\)"),
    (_train_dropout, r"draws random numbers: aten.dropout.default.*call model.eval\(\)"),
    (_TensorCond, r"control-flow operators \(cond\).*select with torch.where"),
]


@pytest.mark.parametrize("factory,message", BAD_INPUTS, ids=[str(getattr(f, "__name__", f)) for f, _ in BAD_INPUTS])
def test_bad_input_is_refused_with_what_to_do(factory, message: str) -> None:
    """tp=2 (planning only): untraceable models, non-tensor outputs, in-place input updates, training-mode
    BatchNorm (its running statistics) and dropout are refused before planning, with an error that says what to
    change. (A buffer that forward updates otherwise is state: tests/test_own_state.py.)"""
    model = factory()
    with pytest.raises(CaptureError, match=message):
        autotp.plan(model, (torch.randn(4, 8),), world_size=2)


class _ConstantOutputs(_Linear):
    """Returns what model code returns beside tensors: None (nanoGPT's loss without targets), numbers, strings."""

    def forward(self, x: torch.Tensor) -> tuple:
        return self.proj(x), None, {"layers": 3, "kind": "decoder", "pair": (x * 2.0, 1.5), "flag": True}


def test_constant_outputs_come_back_where_the_model_returns_them() -> None:
    """No mesh: None, numbers, strings and flags returned beside tensors are constants of the trace; the graph
    returns the tensors only, and the call's result has the model's structure with the constants in place."""
    model, x = _ConstantOutputs(), torch.randn(4, 8)
    captured = capture(model, (x,))
    output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    assert all(isinstance(v, fx.Node) for v in output.args[0]), f"graph outputs must be tensors only: {output.args}"
    state = dict(model.named_parameters())
    values = [state[str(slot.target)] if slot.kind == "parameter" else x for slot in captured.inputs]
    got = captured.outputs.unflatten(captured.graph_module(*values))
    expected = model(x)
    assert got[1] is None and got[2]["layers"] == 3 and got[2]["kind"] == "decoder" and got[2]["flag"] is True, got
    assert got[2]["pair"][1] == 1.5 and torch.equal(got[2]["pair"][0], expected[2]["pair"][0]), got
    assert torch.equal(got[0], expected[0]), "the tensor output differs"


def test_autocast_region_inside_forward_is_inlined() -> None:
    """tp=2 (planning only): torch.autocast inside forward becomes a submodule in export's graph; capture inlines it."""

    class Autocast(_Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                y = x * 2.0
            return self.proj(y)

    plan = autotp.plan(Autocast(), (torch.randn(4, 8),), world_size=2)
    assert [n.op for n in plan.nodes if n.op not in ("placeholder", "output")] == ["aten.mul.Tensor", "aten.linear.default"]


def test_batch_norm_in_training_mode_without_running_stats_splits_channels_only() -> None:
    """tp=2 (planning only): BatchNorm(track_running_stats=False) in train mode uses batch statistics: no batch split."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False)).train()
    gm = capture(model, (torch.randn(4, 3, 8, 8),)).graph_module
    node = _node(gm, aten.batch_norm.default)
    outputs = {s.output for s in strategies_for(node, RuleContext(2))}
    assert outputs == {R, Shard(1)}, f"only channels may be split with batch statistics, got {outputs}"
