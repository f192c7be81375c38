"""Vocabulary-parallel cross-entropy (``passes/rules/losses.py``): the logits stay split over the vocabulary.

A model that returns only its loss (the logits are no output, so nothing needs them whole) is planned
with the cross-entropy reading the lm_head's vocabulary-split output: no all-gather of the logits.
"""

from __future__ import annotations

import dataclasses
import warnings

import models
import pytest
import torch

import autotp
from autotp.cost_model import get_hardware
from autotp.passes.rules import strategies_for
from autotp.passes.rules.registry import RuleContext

aten = torch.ops.aten
GRAD_RTOL = 1e-5


class LossOnly(torch.nn.Module):
    """A causal LM whose forward returns only the loss of predicting ``ids`` (HF's shifted labels)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, labels=ids, use_cache=False).loss


def _tiny(vocab: int) -> tuple[torch.nn.Module, torch.Tensor]:
    model, (ids,), _ = models.tiny_llama(num_heads=4, num_kv_heads=2, intermediate=96, hidden=48, layers=2,
                                         vocab_size=vocab, seq_len=8)
    return LossOnly(model).double(), ids  # HF pads the shifted labels with -100: the last positions are ignored


def test_rule_offers_vocab_split_and_prices_its_all_gather() -> None:
    """tp=2 and tp=4 (no ranks): cross_entropy_loss offers logits S(1) -> R, whose price carries one
    all-gather of (log-sum-exp, target logit) per row; a rule-less split of rows is not offered."""
    from autotp.cost_model import collective_time_s
    from autotp.passes.costing import op_collectives_s

    logits = torch.randn(16, 96)
    target = torch.randint(0, 96, (16,))
    gm = torch.fx.symbolic_trace(lambda x, t: torch.ops.aten.cross_entropy_loss.default(x, t))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    for placeholder, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], (logits, target)):
        placeholder.meta["val"] = value
    node.meta["val"] = torch.tensor(0.0)
    hardware = get_hardware("h100-sxm")
    for world_size in (2, 4):
        strategies = [str(s) for s in strategies_for(node, RuleContext(world_size))]
        assert strategies == ["(R, R) -> R", "(S(1), R) -> R"], f"tp={world_size}: strategies {strategies}"
        split = strategies_for(node, RuleContext(world_size))[1]
        want = collective_time_s("all_gather", 16 * 2 * 4 * world_size, world_size, hardware)
        got = op_collectives_s(node, split, world_size, hardware)
        assert got == pytest.approx(want) and got > 0, f"tp={world_size}: in-op collective {got} s, expected {want} s"
        replicated = strategies_for(node, RuleContext(world_size))[0]
        assert op_collectives_s(node, replicated, world_size, hardware) == 0.0, "the replicated loss issues none"


def _loss_and_gradients(rank: int, world_size: int, vocab: int) -> dict:
    """Inference loss, training loss and the worst relative gradient error of this rank's shards."""
    model, ids = _tiny(vocab)
    expected_loss = model(ids)
    expected_loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    # NCCL's ring for every all-reduce, as training graphs price it: with h100-sxm's one-shot kernel for small
    # ones, this tiny model's inference plan sums its 12 KiB of logits (5.2 us) rather than all-gather the loss's
    # two values per row (7.2 us), and would not read the logits vocabulary-split
    ring = dataclasses.replace(get_hardware("h100-sxm"), small_all_reduce="ring")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference = autotp.compile(model, example_inputs=(ids,), options=autotp.PlanOptions(hardware=ring))
        trained = autotp.compile(model, example_inputs=(ids,), options=autotp.PlanOptions(training=True, hardware=ring))
    with torch.no_grad():
        inference_loss = inference(ids).item()
    loss = trained(ids)
    loss.backward()
    worst, worst_name = 0.0, ""
    for name, param in trained.named_parameters():
        _, blocks = trained.layout[name]
        want = expected[name]
        if blocks is not None:
            dim, ranges = blocks[rank]
            want = torch.cat([want.narrow(dim, a, b - a) for a, b in ranges], dim)
        error = (param.grad - want).abs().max().item() / max(want.abs().max().item(), 1e-9)
        if error > worst:
            worst, worst_name = error, name
    ce = {p: [n.name for n in plan.nodes if n.name.startswith("cross_entropy")][0]
          for p, plan in (("inference", inference.plan), ("training", trained.plan))}
    return {"expected": expected_loss.item(), "inference": inference_loss, "training": loss.item(),
            "worst": worst, "worst_name": worst_name,
            "strategies": {p: str(tp.plan.decisions()[ce[p]]) for p, tp in (("inference", inference),
                                                                             ("training", trained))},
            "gathered": {p: _gathered_shapes(tp.plan) for p, tp in (("inference", inference), ("training", trained))},
            "in_graph": inference.collective_counts()}


def _gathered_shapes(plan: autotp.Plan) -> list[tuple[int, ...]]:
    """The shape of every tensor ``plan`` all-gathers."""
    shapes = {node.name: node.shape for node in plan.nodes}
    return [shapes[c.producer] for c in plan.collectives if any(str(step) == "all_gather" for step in c.steps)]


def test_vocab_parallel_loss_matches_single_process(gloo) -> None:
    """tp=2, vocab 97 (49/48 classes per rank, uneven), planned for h100-sxm with NCCL's ring for every all-reduce:
    a loss-only Llama's inference and training losses equal one process's, each shard's gradient is the matching block of the single-process gradient, and
    the cross-entropy reads the logits vocabulary-split: the plan gathers no logits, and the rank-local graph's
    all-gathers are the loss's own (two values per row) and the plan's."""
    results = gloo.run(2, _loss_and_gradients, 97)
    for rank, r in enumerate(results):
        for phase in ("inference", "training"):
            assert r[phase] == pytest.approx(r["expected"], rel=1e-6), (  # HF computes the loss in float32 (logits.float())
                f"rank {rank} {phase}: loss {r[phase]}, single process {r['expected']}")
            assert r["strategies"][phase] == "(S(1), R) -> R", (
                f"rank {rank} {phase}: cross-entropy strategy {r['strategies'][phase]}, expected (S(1), R) -> R")
            # the logits (batch, sequence, vocab) are never gathered; a hidden-split embedding's output may be
            logits = [shape for shape in r["gathered"][phase] if shape and shape[-1] == 97]
            assert not logits, f"rank {rank} {phase}: logits gathered: {r['gathered'][phase]}"
        assert r["in_graph"].get("all_gather") == 1 + len(r["gathered"]["inference"]), (
            f"rank {rank}: graph collectives {r['in_graph']}, expected the loss's all_gather and the plan's "
            f"{r['gathered']['inference']}")
        assert r["worst"] <= GRAD_RTOL, (
            f"rank {rank}: gradient of {r['worst_name']} off by {r['worst']:.3g} relative, expected <= {GRAD_RTOL}")
