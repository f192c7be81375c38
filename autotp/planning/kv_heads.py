"""Key/value projections with fewer heads than ranks: weights the default budget lets stay whole.

Attention splits by heads. When a model has fewer key/value heads than ranks (Gemma's
multi-query attention: 1 kv head; Llama-3-70B: 8 kv heads at tp 16), the key and value
projections cannot be split by heads: each rank needs whole kv heads. Megatron and vLLM then
*replicate* the kv heads (every rank computes them; no collective), instead of splitting the
projection by its input features, which needs an all-reduce of k and of v in every layer.

The ``memory_budget="auto"`` allowance is "every matrix split along some dim"; for these
projections the only splits are the costly input-feature split or a split inside a head, so
:func:`kv_projection_parameters` names them and the budget allows them whole. Whether to
replicate them is then the cost model's choice, as for any tensor within budget.

The analysis reads the graph only (no module names): from each attention op's key and value
inputs it walks back through the ops between (views, transposes, rotary embedding, cache
writes, ``repeat_kv``'s expand) to the first matrix multiplications, and keeps those whose
output features hold fewer heads (``features // head_dim``) than ranks. A fused projection
(GPT-2's ``c_attn``: q, k and v in one matrix) has query heads in its features too, so it keeps
the ordinary allowance unless all its heads together are fewer than the ranks.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["kv_projection_parameters"]

aten = torch.ops.aten

_ATTENTION_OPS = (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
_GEMM_OPS = (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default, aten.bmm.default)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _parameters_read(gemm: fx.Node, parameters: set[str]) -> set[str]:
    """Parameters ``gemm`` reads, directly or through single-input ops such as ``t`` or ``view``."""
    found: set[str] = set()
    for start in gemm.all_input_nodes:
        node = start
        while node.op == "call_function" and len(node.all_input_nodes) == 1:
            node = node.all_input_nodes[0]
        if node.op == "placeholder" and node.name in parameters:
            found.add(node.name)
    return found


def kv_projection_parameters(gm: fx.GraphModule, world_size: int, parameters: set[str]) -> frozenset[str]:
    """Names of the ``parameters`` (placeholder names) of key/value projections whose heads are fewer than ranks.

    ``gm`` is a captured ATen graph with ``meta["val"]`` on every node; see the module docstring.
    """
    kept: set[str] = set()
    for attention in gm.graph.nodes:
        if attention.op != "call_function" or attention.target not in _ATTENTION_OPS:
            continue
        inputs = _tensor_args(attention)
        if len(inputs) < 3:
            continue
        head_dim = int(inputs[1].meta["val"].shape[-1])  # key (batch, kv_heads, seq, head_dim)
        stack, seen = [inputs[1], inputs[2]], set()
        while stack:
            node = stack.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if node.target in _GEMM_OPS:
                val = node.meta.get("val")
                features = val.shape[-1] if isinstance(val, torch.Tensor) else None
                if isinstance(features, int) and head_dim > 0 and features // head_dim < world_size:
                    kept |= _parameters_read(node, parameters)
                continue  # the projection's own input is the layer's hidden state: stop here
            stack.extend(_tensor_args(node))
    return frozenset(kept)
