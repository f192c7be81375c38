"""Tier (a): sharding rules and partitions as pure functions (no process group)."""

from __future__ import annotations

import torch
import torch.fx as fx
from models import tiny_llama

from autotp.base.placements import BlockShard, Partial, Replicate, Shard, placement_from_str, placement_to_str
from autotp.capture.tracing import capture
from autotp.passes.rules import RULES, RuleContext, strategies_for, view_groups
from autotp.passes.uneven import Partitions

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _graph(fn, *inputs: torch.Tensor) -> fx.GraphModule:
    class Wrap(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    return capture(Wrap(), inputs).graph_module


def _node(gm: fx.GraphModule, target: object) -> fx.Node:
    found = [n for n in gm.graph.nodes if n.target is target]
    assert found, f"no {target} node in graph:\n{gm.graph}"
    return found[0]


def test_view_groups_split_heads() -> None:
    """No mesh: (batch, seq, hidden) -> (batch, seq, heads, head_dim) groups hidden with heads."""
    assert view_groups((2, 16, 256), (2, 16, 8, 32)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((2, 4, 2, 16, 32), (2, 8, 16, 32)) == [([0], [0]), ([1, 2], [1]), ([3], [2]), ([4], [3])]
    assert view_groups((2, 16, 1), (2, 16)) == [([0], [0]), ([1], [1]), ([2], [])]


def test_linear_rule_has_column_and_row_parallel() -> None:
    """tp=4: linear offers column-parallel (w S(0) -> out S(-1)) and row-parallel (x S(-1), w S(1) -> P)."""
    gm = _graph(lambda x, w: torch.nn.functional.linear(x, w), torch.randn(2, 16, 64), torch.randn(128, 64))
    strategies = strategies_for(_node(gm, aten.linear.default), RuleContext(4))
    pairs = {(s.inputs, s.output) for s in strategies}
    assert ((R, Shard(0)), Shard(2)) in pairs, f"column-parallel missing from {pairs}"
    assert ((Shard(2), Shard(1)), P) in pairs, f"row-parallel missing from {pairs}"
    assert ((Shard(0), R), Shard(0)) in pairs, f"batch split missing from {pairs}"
    assert strategies[0].output == R and all(p == R for p in strategies[0].inputs), "replicate must come first"


def test_view_rule_keeps_heads_sharded() -> None:
    """tp=2: a hidden split survives the view into (heads, head_dim) as a head split; head_dim never splits."""
    gm = _graph(lambda x: x.view(2, 16, 8, 32), torch.randn(2, 16, 256))
    outs = {s.inputs[0]: s.output for s in strategies_for(_node(gm, aten.view.default), RuleContext(2))}
    assert outs[Shard(2)] == Shard(2), f"expected S(2)->S(2), got {outs}"
    assert Shard(3) not in outs.values(), "head_dim must not be split by a view"


def test_index_put_keeps_the_split_of_every_dim_its_indices_leave_alone() -> None:
    """tp=2: ``cache[:, :, pos] = k`` (a KV cache (2, 4, 16, 8) written at positions of dim 2, keys (2, 4, 3, 8))
    may split batch or heads in the cache and the keys alike, never the indexed positions or via the index;
    ``x[pos] = v`` on a leading dim keeps the trailing dims' splits, as before."""
    def write(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out = cache.clone()
        out[:, :, pos] = k
        return out

    gm = _graph(write, torch.zeros(2, 4, 16, 8), torch.tensor([3, 4, 5]), torch.randn(2, 4, 3, 8))
    pairs = {(s.inputs, s.output) for s in strategies_for(_node(gm, aten.index_put.default), RuleContext(2))}
    expected = {((Shard(d), R, Shard(d)), Shard(d)) for d in (0, 1, 3)} | {((P, R, P), P), ((R, R, R), R)}
    assert pairs == expected, f"index_put strategies {pairs}, expected {expected}"

    def write_rows(x: torch.Tensor, rows: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[rows] = v
        return out

    gm = _graph(write_rows, torch.zeros(16, 8), torch.tensor([1, 2]), torch.randn(2, 8))
    pairs = {(s.inputs, s.output) for s in strategies_for(_node(gm, aten.index_put.default), RuleContext(2))}
    assert ((Shard(1), R, Shard(1)), Shard(1)) in pairs and not any(out == Shard(0) for _, out in pairs), (
        f"x[rows] = v: strategies {pairs}, expected the columns split (S(1)) and never the rows")


def test_add_with_nonzero_scalar_is_not_linear() -> None:
    """tp=2: x + 1e-6 on a Partial sum would add 1e-6 per rank, so no Partial strategy is offered."""
    gm = _graph(lambda x: x + 1e-6, torch.randn(4, 8))
    outs = [s.output for s in strategies_for(_node(gm, aten.add.Tensor), RuleContext(2))]
    assert P not in outs, f"unexpected Partial strategy in {outs}"
    gm2 = _graph(lambda x, y: x + y, torch.randn(4, 8), torch.randn(4, 8))
    outs2 = [s.output for s in strategies_for(_node(gm2, aten.add.Tensor), RuleContext(2))]
    assert P in outs2, f"P + P -> P missing from {outs2}"


def test_sdpa_rule_splits_heads_with_gqa() -> None:
    """tp=2, 8 query heads and 4 kv heads: the head split covers q, k and v together."""
    q, kv = torch.randn(2, 8, 16, 32), torch.randn(2, 4, 16, 32)
    gm = _graph(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), q, kv, kv)
    strategies = strategies_for(_node(gm, aten.scaled_dot_product_attention.default), RuleContext(2))
    assert any(s.inputs == (Shard(1), Shard(1), Shard(1)) and s.output == Shard(1) for s in strategies)


def test_split_of_block_sharded_fused_projection() -> None:
    """tp=2: a (.., 3H) tensor split in 3 equal pieces can arrive block-sharded and leave Shard per piece."""
    gm = _graph(lambda x: x.split(64, dim=2), torch.randn(2, 16, 192))
    strategies = strategies_for(_node(gm, aten.split.Tensor), RuleContext(2, frozenset({3})))
    assert any(s.inputs == (BlockShard(2, 3),) and s.output == Shard(2) for s in strategies), strategies


def test_placement_text_round_trip() -> None:
    """No mesh: every placement kind prints and parses back."""
    for placement in (R, P, Shard(0), Shard(3), BlockShard(1, 3)):
        assert placement_from_str(placement_to_str(placement)) == placement


def test_uneven_partition_of_heads() -> None:
    """tp=3, 8 heads of 32 channels: heads 3/3/2, channels 96/96/64, the same cut in both views."""
    parts = Partitions(3)
    parts.add(("q_weight", 0, 1), 256)
    parts.add(("q_heads", 1, 1), 8)
    parts.union(("q_weight", 0, 1), ("q_heads", 1, 1))
    assert parts.sizes("q_heads", 1) == [3, 3, 2]
    assert parts.sizes("q_weight", 0) == [96, 96, 64]
    assert parts.local("q_weight", 0, 2) == (192, 64)


def test_gqa_partition_keeps_kv_groups() -> None:
    """tp=3, 8 query heads in 4 kv groups: kv heads 2/1/1 and query heads 4/2/2 (each group whole)."""
    parts = Partitions(3)
    parts.add(("q", 1, 1), 8)
    parts.add(("kv", 1, 1), 4)
    parts.union(("q", 1, 1), ("kv", 1, 1))
    assert parts.sizes("kv", 1) == [2, 1, 1]
    assert parts.sizes("q", 1) == [4, 2, 2]


def test_every_llama_op_in_attention_and_mlp_has_a_rule() -> None:
    """No mesh: the ops of Llama's attention and MLP blocks are all covered by rules."""
    model, args, kwargs = tiny_llama(device="meta")
    args = tuple(a.to("meta") for a in args)
    gm = capture(model, args, kwargs).graph_module
    missing = {str(n.target) for n in gm.graph.nodes
               if n.op == "call_function" and n.target not in RULES
               and any(k in str(n.meta.get("nn_module_stack", "")) for k in ("self_attn", "mlp"))}
    assert not missing, f"ops in attention/MLP without a rule: {missing}"


def test_the_vocab_split_embeddings_declared_ops_are_those_its_local_form_emits_and_are_priced() -> None:
    """The tied-embedding LM (vocabulary 1000, hidden 128, ids (2, 16)) at tp 2 with the embedding's weight split
    over the vocabulary: of the ops the rank-local graph adds to the original graph, those of the kinds
    ``local_form_kernels_for`` declares are exactly the declared ones (so the cost pass prices what runs), with
    the bytes the shapes give; the cost pass prices them at a dispatch or more each under the vocabulary split,
    and at nothing under the hidden split."""
    import collections
    import dataclasses

    from models import tiny_tied_lm

    import autotp
    from autotp.cost_model import get_hardware
    from autotp.passes.costing import local_form_kernels_s
    from autotp.passes.rewrite import rewrite_for_rank
    from autotp.passes.rules import local_form_kernels_for
    from autotp.passes.uneven import build_partitions

    aten = torch.ops.aten
    model, args, kwargs = tiny_tied_lm()
    captured = capture(model, args, kwargs)
    plan = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(hardware="cpu-gloo", memory_budget=None, constraints={"embed.weight": Shard(0)}))
    decisions = plan.decisions()
    local = rewrite_for_rank(captured.graph_module, decisions, build_partitions(captured.graph_module, decisions, 2),
                             0, "unused", routes=plan.reshard_routes())

    def kernels(graph: fx.Graph) -> collections.Counter:
        return collections.Counter(node.target for node in graph.nodes if node.op == "call_function")

    added = kernels(local.graph) - kernels(captured.graph_module.graph)
    lookup = next(node for node in captured.graph_module.graph.nodes if node.target is aten.embedding.default)
    split = next(s for s in strategies_for(lookup, RuleContext(2)) if s.inputs[0] == Shard(0))
    declared = collections.Counter(op for op, _ in local_form_kernels_for(aten.embedding.default)(lookup, split, 2))
    assert declared, "the vocabulary split adds ops"
    emitted = collections.Counter({op: count for op, count in added.items() if op in declared})
    assert emitted == declared, (emitted, declared)
    # the whole output's masked_fill and the ids' ops read and write what the shapes say
    nbytes = dict(local_form_kernels_for(aten.embedding.default)(lookup, split, 2))
    assert nbytes[aten.masked_fill.Scalar] == 2 * (2 * 16 * 128 * 4) + 2 * 16
    assert nbytes[aten.sub.Tensor] == 2 * (2 * 16 * 8)
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), host_dispatch_s=10e-6)
    hidden = next(s for s in strategies_for(lookup, RuleContext(2)) if s.inputs[0] == Shard(1))
    assert local_form_kernels_s(lookup, hidden, 2, hardware) == 0.0
    assert local_form_kernels_s(lookup, split, 2, hardware) >= 7 * 10e-6  # seven kernels, each dispatched
