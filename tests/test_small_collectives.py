"""One-shot all-reduce of small tensors on gloo (``autotp/passes/small_collectives.py``).

Tier (c), real gloo processes at tp=3 (the ring has 4 hops there, the one-shot exchange one).
Token-level equality of whole models at tp 3 and 4 goes through this path in ``test_generate.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from autotp.passes.rewrite import count_collectives
from autotp.passes.small_collectives import ONE_SHOT_MAX_BYTES, one_shot_all_reduce, one_shot_small_all_reduces

pytestmark = pytest.mark.distributed

c10d = torch.ops._c10d_functional


def _all_reduce_graph(group_name: str) -> fx.GraphModule:
    """``x -> all_reduce(x, "sum") -> wait_tensor -> * 2``, as the rewrite emits it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(c10d.wait_tensor.default,
                                  (graph.call_function(c10d.all_reduce.default, (x, "sum", group_name)),))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (reduced, 2.0)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def _sums(rank: int, world_size: int) -> dict[str, Any]:
    group_name = dist.group.WORLD.group_name
    gm = one_shot_small_all_reduces(_all_reduce_graph(group_name), None, world_size)
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    out: dict[str, Any] = {"targets": [getattr(t, "__name__", str(t)) for t in targets],
                           "counts": count_collectives(gm)}
    generator = torch.Generator().manual_seed(rank)
    for name, numel in (("small", 3 * 5), ("large", ONE_SHOT_MAX_BYTES // 4 + 1)):
        x = torch.randn(numel, generator=generator)
        expected = x.clone()
        dist.all_reduce(expected)
        got = gm(x)[0] / 2.0 if name == "small" else one_shot_all_reduce(x, group_name, world_size)
        gathered = [torch.empty_like(got) for _ in range(world_size)]
        dist.all_gather(gathered, got)
        out[name] = {"close": bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-6)),
                     "max_error": float((got - expected).abs().max()),
                     "same_bits_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered)}
    return out


def test_one_shot_all_reduce_sums_like_gloo_and_agrees_across_ranks(gloo) -> None:
    """tp=3, gloo: the pass replaces all_reduce + wait_tensor by one one-shot node (still counted as one
    all_reduce); a small tensor (15 floats) and one just over ONE_SHOT_MAX_BYTES (the ring path) both sum
    like dist.all_reduce, and every rank gets the same bits."""
    results = gloo.run(3, _sums)
    for rank, result in enumerate(results):
        assert result["targets"] == ["one_shot_all_reduce", "mul.Tensor"], (
            f"rank {rank}: expected the all-reduce pair replaced by one one-shot node, got {result['targets']}")
        assert result["counts"] == {"all_reduce": 1}, f"rank {rank}: counted {result['counts']}, expected 1 all_reduce"
        for name in ("small", "large"):
            check = result[name]
            assert check["close"], f"rank {rank}, {name}: differs from dist.all_reduce by {check['max_error']}"
            assert check["same_bits_on_every_rank"], f"rank {rank}, {name}: ranks got different sums"
