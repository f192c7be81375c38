"""Grouped-query attention attends to the unrepeated kv heads (passes/grouped_query.py): one-token attention
packed, longer attention with enable_gqa."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from autotp.capture.kv_cache import CachedCausalLM
from autotp.capture.tracing import capture
from autotp.passes.grouped_query import attend_grouped_query, pack_one_token_gqa

aten = torch.ops.aten


class RepeatKV(torch.nn.Module):
    """Attention over kv heads repeated the way HF's ``repeat_kv`` does it."""

    def __init__(self, rep: int) -> None:
        super().__init__()
        self.rep = rep

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, hkv, s, d = k.shape
        k = k[:, :, None].expand(b, hkv, self.rep, s, d).reshape(b, hkv * self.rep, s, d)
        v = v[:, :, None].expand(b, hkv, self.rep, s, d).reshape(b, hkv * self.rep, s, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _graph(q_len: int, mask_heads: int) -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    args = (torch.randn(2, 6, q_len, 8), torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8),
            torch.rand(2, mask_heads, q_len, 10) > 0.3)
    args[3][..., 0] = True  # every row attends somewhere
    return torch.export.export(RepeatKV(2), args).run_decompositions({}).graph_module, args


def _ops(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_one_token_attention_reads_the_cache_unrepeated_and_computes_the_same() -> None:
    gm, args = _graph(q_len=1, mask_heads=1)
    expected = gm(*args)[0]
    assert aten.clone.default in _ops(gm)
    assert pack_one_token_gqa(gm) == 1
    ops = _ops(gm)
    assert aten.clone.default not in ops and aten.expand.default not in ops
    (sdpa,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert tuple(sdpa.args[0].meta["val"].shape) == (2, 3, 2, 8)  # (batch, kv heads, group, dim)
    assert sdpa.args[1].op == "placeholder" and sdpa.args[2].op == "placeholder"
    torch.testing.assert_close(gm(*args)[0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("q_len, mask_heads", [(2, 1), (1, 6)], ids=["two-query-tokens", "per-head-mask"])
def test_attention_the_packing_would_change_is_left_alone(q_len: int, mask_heads: int) -> None:
    gm, _ = _graph(q_len=q_len, mask_heads=mask_heads)
    before = _ops(gm)
    assert pack_one_token_gqa(gm) == 0
    assert _ops(gm) == before


def test_captured_decode_step_attends_to_the_cache_itself() -> None:
    """The decode graph of a GQA Llama (4 query / 2 kv heads) reads each cache where the step wrote it:
    attention's keys and values are the cache updates, with no per-head copy in between."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    wrapper = CachedCausalLM(LlamaForCausalLM(config).eval(), batch_size=2, max_cache_len=16, last_logits_only=True)
    decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False)
    attentions = [n for n in decode.graph_module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(attentions) == 2
    for sdpa in attentions:
        assert sdpa.args[1].target is aten.index_copy.default and sdpa.args[2].target is aten.index_copy.default
    assert aten.clone.default not in _ops(decode.graph_module)
    prefill = capture(wrapper, wrapper.example_inputs(3), dynamic=False)  # three query tokens: grouped, no copy
    assert aten.clone.default not in _ops(prefill.graph_module)
    attentions = [n for n in prefill.graph_module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(attentions) == 2 and all(n.kwargs.get("enable_gqa") for n in attentions), [n.kwargs for n in attentions]


@pytest.mark.parametrize("q_len, mask_heads", [(4, 1), (1, 6)], ids=["four-query-tokens", "per-head-mask"])
def test_attention_over_copies_the_packing_leaves_groups_kv_heads_and_computes_the_same(q_len: int,
                                                                                        mask_heads: int) -> None:
    """Four query tokens (the mask differs per row), or one token with a per-head mask: the packing leaves
    them, attend_grouped_query drops the copies and sets enable_gqa; outputs equal the copying form."""
    gm, args = _graph(q_len=q_len, mask_heads=mask_heads)
    expected = gm(*args)[0]
    assert pack_one_token_gqa(gm) == 0 and attend_grouped_query(gm) == 1
    ops = _ops(gm)
    assert aten.clone.default not in ops and aten.expand.default not in ops
    (sdpa,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa.kwargs.get("enable_gqa") and sdpa.args[1].op == "placeholder" and sdpa.args[2].op == "placeholder"
    torch.testing.assert_close(gm(*args)[0], expected, rtol=1e-6, atol=1e-6)
    assert attend_grouped_query(gm) == 0, "a grouped attention is not rewritten again"


def test_cache_update_is_priced_as_the_rows_it_writes() -> None:
    """The decode step's cache update runs in place (passes/state.py), so the planner prices the rows it
    writes, not a copy of the whole cache (8 MiB per cache here against 2 KiB per row)."""
    from autotp.cost_model import get_hardware
    from autotp.cost_model.compute import compute_time_s
    from autotp.planning.options import PlanOptions
    from autotp.planning.planner import plan_graph

    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    wrapper = CachedCausalLM(LlamaForCausalLM(config).eval(), batch_size=4, max_cache_len=2048, last_logits_only=True)
    decode = capture(wrapper, wrapper.example_inputs(1), dynamic=False)
    hardware = get_hardware("cpu-gloo")
    plan = plan_graph(decode, PlanOptions(world_size=1, hardware=hardware, memory_budget=None))
    updates = [d for d in plan.nodes if d.op == "aten.index_copy.default"]
    assert len(updates) == 2
    rows = 4 * 2 * 1 * 64 * 4  # (batch, kv heads, 1 position, head dim) float32
    in_place_s = compute_time_s(0, rows + 8 + rows, torch.float32, hardware)  # rows read, int64 index, rows written
    whole_cache_copy_s = compute_time_s(0, 2 * 4 * 2 * 2048 * 64 * 4, torch.float32, hardware)
    for update in updates:
        assert update.compute_s == pytest.approx(in_place_s), (update.name, update.compute_s, in_place_s)
    assert in_place_s < 0.1 * whole_cache_copy_s
