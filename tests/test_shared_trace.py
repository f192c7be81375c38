"""One trace per group (autotp/runtime/agreement/shared_trace.py): rank 0 runs torch.export, the others rebuild its program."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import tiny_llama

import autotp


class _DataDependent(torch.nn.Module):
    """Branches on a tensor value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if x.sum() > 0 else -self.proj(x)


def _exports_per_compile(rank: int, world_size: int) -> dict:
    """Count torch.export.export calls on this rank through a compile (dynamic shapes) and a generation
    compile (decode + prefill graphs); check the outputs at another shape than the traced one."""
    counted = {"calls": 0}
    export = torch.export.export

    def counting_export(*args, **kwargs):
        counted["calls"] += 1
        return export(*args, **kwargs)

    from autotp.runtime.agreement import shared_trace

    small = {"hidden": 64, "intermediate": 128, "num_heads": 4, "num_kv_heads": 2, "seq_len": 8}
    deep, _, _ = tiny_llama(layers=4, **small)  # traced with 3 layers, the 4th stamped (autotp.capture.stamping)
    model, (ids,), kwargs = tiny_llama(layers=1, **small)
    torch.export.export = counting_export
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(deep, example_inputs=(ids,), example_kwargs=kwargs)
            forward_exports = counted["calls"]
            # programs above the limit go by a broadcast instead of the key-value store: take that path here
            shared_trace._STORE_MESSAGE_BYTES = 0
            generating = autotp.compile(model, example_inputs=(ids,), max_cache_len=16)
    finally:
        torch.export.export = export
        shared_trace._STORE_MESSAGE_BYTES = 4 << 20
    other = ids[:1, :5]  # another batch and length: the rebuilt program keeps the symbolic dims
    with torch.no_grad():
        diff = (tp(other, **kwargs).logits - deep(other, **kwargs).logits).abs().max().item()
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    tokens = generating.generate(ids, max_new_tokens=4)
    try:
        autotp.compile(_DataDependent(), example_inputs=(torch.randn(2, 8),))
        untraceable = "no error"
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        untraceable = f"{type(exc).__name__}: {exc}"
    return {"untraceable": untraceable,"forward_exports": forward_exports, "generation_exports": counted["calls"] - forward_exports,
            "diff": diff, "tokens_equal": torch.equal(tokens, expected)}


@pytest.mark.distributed
def test_only_the_first_rank_traces(gloo) -> None:
    """tp=2, Llama: rank 0 exports once for compile (dynamic dims; 4 layers: a 3-layer twin, sent as such and
    stamped out on rank 1) and three times for generation (decode, prefill, continuation;
    sent by broadcast as a program too large for the key-value store would be); rank 1 exports nothing and
    rebuilds rank 0's programs with its own weights; its outputs at an untraced
    shape equal the single process's, and its greedy tokens HF's. A model no rank can trace gives every rank
    the same CaptureError (rank 0's, not a disagreement)."""
    results = gloo.run(2, _exports_per_compile)
    assert [r["forward_exports"] for r in results] == [1, 0], f"exports per rank in compile: {results}"
    assert [r["generation_exports"] for r in results] == [3, 0], f"exports per rank in generation: {results}"
    for rank, r in enumerate(results):
        assert r["diff"] <= 1e-4, f"rank {rank}: max abs diff {r['diff']:.3g} at batch 1, length 5"
        assert r["tokens_equal"], f"rank {rank}: generated tokens differ from HF's greedy generate"
        assert r["untraceable"].startswith("CaptureError: could not trace _DataDependent"), r["untraceable"]
    assert results[0]["untraceable"] == results[1]["untraceable"], [r["untraceable"] for r in results]
