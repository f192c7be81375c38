"""Models that keep their own state in buffers and update it in place in forward (a KV cache in module
buffers, a convolution state, a running counter, BatchNorm's running statistics).

A buffer that forward updates is state like the generation cache: the planner places it (a KV cache
split by kv heads with the attention that writes and reads it), it counts in the memory budget, and
the rank-local graph updates this rank's block in place, so the compiled module keeps it across calls.
Tiers (b) (planning, no processes) and (c) (real gloo ranks against the single-process model).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from own_state_models import RollingConv, TransformerArgs, run_loop, tiny_cached_transformer

import autotp
from autotp.capture.tracing import capture

TOLERANCE = 1e-4
CACHE_FQNS = [f"layers.{i}.attention.kv_cache.{kind}_cache" for i in (0, 1) for kind in ("k", "v")]


def _prompt(seq: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))  # (batch, seq)


@pytest.mark.slow  # traces and plans a decoder with its own cache: about 6 s on 2 cores
def test_cache_buffers_updated_in_forward_are_planned_as_state() -> None:
    """tp=2 (autotp.plan, no processes), gpt-fast-style decoder, 2 layers, 6 heads / 3 kv heads, cache of 16
    positions in module buffers written with ``cache[:, :, input_pos] = k``: the four cache buffers are state
    (placed like parameters, not refused; the rotary table and causal mask, only read, are not), each placed
    S(1) (split by kv heads, 2 and 1 per rank) with its ``index_put`` update alike, and the plan's memory
    counts them: 16 more positions add the caches' bytes in all and the largest rank's block per rank."""
    model = tiny_cached_transformer()
    prompt = _prompt()
    plan = autotp.plan(model, (prompt, torch.arange(5)), world_size=2)
    placed = sorted(fqn for fqn in plan.parameters if fqn not in dict(model.named_parameters()))
    assert placed == sorted(CACHE_FQNS), f"buffers placed {placed}, expected the four caches {sorted(CACHE_FQNS)}"
    placements = {fqn: plan.parameters[fqn] for fqn in CACHE_FQNS}
    assert set(placements.values()) == {"S(1)"}, f"cache placements {placements}, expected S(1) (kv heads)"
    updates = {n.name: (n.inputs, n.output) for n in plan.nodes if n.op == "aten.index_put.default"}
    assert len(updates) == 4 and set(updates.values()) == {(("S(1)", "R", "S(0)"), "S(1)")}, (
        f"cache updates {updates}, expected 4 index_put writing S(1) with the keys split by heads (S(0))")
    longer = autotp.plan(tiny_cached_transformer(max_seq=32), (prompt, torch.arange(5)), world_size=2)
    assert longer.parameters == plan.parameters, "a longer cache changed the placements; the memory figures below compare"
    # 4 caches of (batch 1, 3 kv heads, positions, head_dim 8), float32: 16 positions more in each
    whole, largest_rank = 4 * 3 * 16 * 8 * 4, 4 * 2 * 16 * 8 * 4  # the largest rank holds 2 of the 3 kv heads
    total = longer.parameter_bytes_total - plan.parameter_bytes_total
    per_rank = longer.parameter_bytes_per_rank - plan.parameter_bytes_per_rank
    assert (total, per_rank) == (whole, largest_rank), (
        f"16 more cache positions add {total} bytes in all and {per_rank} per rank to the plan's memory, "
        f"expected {whole} and {largest_rank}")


def _loop_on_rank(rank: int, world_size: int, steps: int, fused_qkv: bool, trace_cache: str) -> dict:
    """Compile the decoder on this rank (through ``trace_cache``: the same decoder at tp 3 rebuilds the program
    traced at tp 2), run gpt-fast's loop through it and through the single-process model."""
    args = TransformerArgs(fused_qkv=fused_qkv)
    model, reference = tiny_cached_transformer(args), tiny_cached_transformer(args)
    prompt = _prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(prompt, torch.arange(5)),
                            runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    expected, got = run_loop(reference, prompt, steps), run_loop(tp, prompt, steps)
    held = tp.local_state()
    return {
        "diffs": [(e - g).abs().max().item() for e, g in zip(expected, got)],
        "tokens": [e[:, -1].argmax(-1).item() for e in expected],
        "got_tokens": [g[:, -1].argmax(-1).item() for g in got],
        "kv_heads": {fqn: tuple(held[fqn].shape)[1] for fqn in CACHE_FQNS},
        # positions the loop wrote (0 .. 5 + steps - 1) hold keys on this rank, the others are still zero
        "written": [bool(held[CACHE_FQNS[0]][0, :, p].abs().sum() > 0) for p in range(16)],
        "placements": {fqn: tp.plan.parameters[fqn] for fqn in CACHE_FQNS},
    }


@pytest.mark.parametrize("world_size,fused_qkv", [(2, False), (3, False), (2, True)])
def test_the_models_own_loop_runs_on_one_compile(gloo, world_size: int, fused_qkv: bool, trace_cache: str) -> None:
    """tp=2 (3 kv heads: 2 + 1 per rank) and tp=3 (one each), gpt-fast-style decoder with its KV cache in
    module buffers (q, k, v from three projections; at tp=2 also from one fused wqkv): one compile serves the
    model's own loop, a 5-token prefill on ``arange(5)`` then 4 calls of one token at ``tensor([5 + i])``;
    every call's logits equal the single-process model's on every rank, and each rank's cache buffers hold
    fewer kv heads than the model's 3 and keep the written positions."""
    steps = 4
    results = gloo.run(world_size, _loop_on_rank, steps, fused_qkv, trace_cache)
    first = results[0]
    assert len(set(first["tokens"][1:])) > 1, f"the loop's tokens {first['tokens']} are all alike: a weak check"
    for rank, result in enumerate(results):
        worst = max(result["diffs"])
        assert len(result["diffs"]) == steps + 1 and worst < TOLERANCE, (
            f"rank {rank}: logits per call differ from the single-process model's by {result['diffs']}, "
            f"expected {steps + 1} calls each < {TOLERANCE}")
        assert result["got_tokens"] == first["tokens"], (
            f"rank {rank}: tokens {result['got_tokens']}, expected {first['tokens']}")
        assert set(result["placements"].values()) == {"S(1)"}, f"rank {rank}: placements {result['placements']}"
        heads = result["kv_heads"]
        assert all(0 < h < 3 for h in heads.values()), f"rank {rank}: kv heads held {heads}, expected fewer than 3"
        written = [p for p, w in enumerate(result["written"]) if w]
        assert written == list(range(5 + steps)), (
            f"rank {rank}: cache positions written {written}, expected 0..{5 + steps - 1} (prefill and decode)")
    held = sum(r["kv_heads"][CACHE_FQNS[0]] for r in results)
    assert held == 3, f"kv heads held over the ranks sum to {held}, expected the model's 3"


class _CountingScale(torch.nn.Module):
    """A linear layer whose output is scaled by how many times it was called: a counter buffer (a whole
    tensor of one element) that forward updates with ``calls += 1`` and reads after."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 12)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x) * self.calls


def _count_on_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _CountingScale()
    reference = _CountingScale()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    tp = autotp.compile(model, example_inputs=(x,))
    with torch.no_grad():
        diffs = [(reference(x) - tp(x)).abs().max().item() for _ in range(3)]
    return {"diffs": diffs, "calls": tp.local_state()["calls"].tolist(), "model_calls": model.calls.tolist(),
            "split": tp.plan.parameters["proj.weight"]}


def test_a_counter_buffer_is_kept_across_calls(gloo) -> None:
    """tp=2, a linear layer (split) scaled by a call counter kept in a buffer (``calls += 1`` in forward): the
    counter is state, whole on each rank; three calls give the single-process model's outputs (scaled 1, 2, 3)
    and leave the compiled module's counter at 3, the original model's untouched at 0."""
    results = gloo.run(2, _count_on_rank)
    for rank, result in enumerate(results):
        assert result["split"] != "R", f"rank {rank}: proj.weight placed {result['split']}, expected a split"
        assert max(result["diffs"]) < TOLERANCE, f"rank {rank}: output diffs {result['diffs']}, expected < {TOLERANCE}"
        assert result["calls"] == [3.0], f"rank {rank}: counter {result['calls']} after 3 calls, expected [3.0]"
        assert result["model_calls"] == [0.0], f"rank {rank}: the original's counter {result['model_calls']}, expected [0.0]"


@pytest.mark.parametrize("training", [False, True])
def test_batch_norm_running_statistics_are_refused_with_what_to_do(training: bool) -> None:
    """tp=2 (planning only), conv + BatchNorm in train mode (running statistics updated by forward), planned for
    inference and with training=True: refused naming the statistics buffers, with the fix for each case
    (eval() for inference; track_running_stats=False or frozen statistics to train). In eval mode, and with
    batch statistics only (track_running_stats=False) in training, the same model plans, its statistics (read
    only, or none) not state."""
    from torch import nn

    from autotp.base.errors import CaptureError

    def model(track: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=track), nn.ReLU()).train()

    x = torch.randn(4, 3, 8, 8)
    fix = "track_running_stats=False" if training else r"call model\.eval\(\)"
    with pytest.raises(CaptureError, match=rf"1\.running_mean, 1\.running_var are running statistics.*{fix}"):
        autotp.plan(model(), (x,), world_size=2, options=autotp.PlanOptions(training=training))
    ok = model().eval() if not training else model(track=False)
    plan = autotp.plan(ok, (x,), world_size=2, options=autotp.PlanOptions(training=training))
    placed = sorted(plan.parameters)
    assert placed == ["0.bias", "0.weight", "1.bias", "1.weight"], (
        f"placed {placed}, expected the four parameters only: a buffer forward only reads is not state")


def test_a_state_update_that_does_not_write_its_own_block_is_refused_naming_the_buffer() -> None:
    """tp=1 graph, no processes: the counter's update is ``copy(calls, calls + 1)`` last in the captured graph;
    with a step put between the buffer and its update (as a reshard would be), making it in place raises a
    PlanError naming the buffer ``calls`` instead of writing a value the buffer never sees."""
    from autotp.base.errors import PlanError
    from autotp.passes.state import update_state_in_place

    captured = capture(_CountingScale(), (torch.randn(4, 8),))
    placeholder, update_name = next(iter(captured.state.items()))
    gm = captured.graph_module
    update = next(n for n in gm.graph.nodes if n.name == update_name)
    last = max((n for n in gm.graph.nodes if n.op != "output"), key=list(gm.graph.nodes).index)
    assert (update.target, update is last) == (torch.ops.aten.copy.default, True), (
        f"counter update {update.format_node()}, expected aten.copy last in the graph (after every read)")
    with gm.graph.inserting_before(update):
        moved = gm.graph.call_function(torch.ops.aten.clone.default, (update.args[0],))
    update.args = (moved, *update.args[1:])
    with pytest.raises(PlanError, match=r"update of state buffer 'calls' does not write into its own block"):
        update_state_in_place(gm, captured.state, captured.state_fqns())


def _train_counting_on_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _CountingScale()
    reference = _CountingScale()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    tp = autotp.compile(model, example_inputs=(x,), options=autotp.PlanOptions(training=True))
    losses = []
    for module in (reference, tp):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        steps = []
        for _ in range(3):
            loss = module(x).pow(2).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append(loss.item())
        losses.append(steps)
    return {"expected": losses[0], "got": losses[1], "calls": tp.local_state()["calls"].tolist(),
            "split": tp.plan.parameters["proj.weight"]}


def test_a_counter_buffer_is_state_in_training_too(gloo) -> None:
    """tp=2, training=True, the counter-scaled linear layer (split) and SGD for 3 steps: the losses equal the
    single-process model's step by step (the counter scales each step's output and gradient: 1, 2, 3) and
    the compiled module's counter ends at 3."""
    for rank, result in enumerate(gloo.run(2, _train_counting_on_rank)):
        assert result["split"] != "R", f"rank {rank}: proj.weight placed {result['split']}, expected a split"
        assert len(set(result["expected"])) == 3, f"losses {result['expected']} do not change: a weak check"
        rel = max(abs(g - e) / abs(e) for g, e in zip(result["got"], result["expected"]))
        assert rel < 1e-5, f"rank {rank}: losses {result['got']}, expected {result['expected']} (rel diff {rel:.2g})"
        assert result["calls"] == [3.0], f"rank {rank}: counter {result['calls']} after 3 steps, expected [3.0]"


def _roll_on_rank(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = RollingConv()
    reference = RollingConv()
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(steps, 2, 8, generator=torch.Generator().manual_seed(3))  # (steps, batch, dim)
    tp = autotp.compile(model, example_inputs=(inputs[0],))
    with torch.no_grad():
        expected = [reference(x) for x in inputs]
        got = [tp(x) for x in inputs]
    return {"diffs": [(e - g).abs().max().item() for e, g in zip(expected, got)],
            "changes": [(expected[i] - expected[i - 1]).abs().max().item() for i in range(1, steps)],
            "placement": tp.plan.parameters["state"], "held": tuple(tp.local_state()["state"].shape),
            "state_diff": (tp.local_state()["state"] - reference.state[:, _rows(rank, world_size)]).abs().max().item()}


def _rows(rank: int, world_size: int) -> slice:
    """This rank's channels of 10 split over ``world_size`` ranks, the first ranks one more (4/3/3 at 3)."""
    sizes = [10 // world_size + (r < 10 % world_size) for r in range(world_size)]
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def test_a_convolution_state_replaced_every_call_is_split_by_channels(gloo) -> None:
    """tp=3, 10 channels (4/3/3 per rank): a causal depthwise convolution's state (batch 2, channels, 3 last
    inputs) that each call reads and replaces with ``state.copy_(window[:, :, 1:])`` is split by channels with
    the projections around it; 4 calls give the single-process model's outputs, and each rank's state equals
    its channels of the single-process model's state after them."""
    steps = 4
    for rank, result in enumerate(gloo.run(3, _roll_on_rank, steps)):
        assert min(result["changes"]) > 1e-3, f"outputs barely change between calls ({result['changes']}): weak check"
        assert max(result["diffs"]) < TOLERANCE, f"rank {rank}: output diffs {result['diffs']}, expected < {TOLERANCE}"
        channels = _rows(rank, 3).stop - _rows(rank, 3).start
        assert (result["placement"], result["held"]) == ("S(1)", (2, channels, 3)), (
            f"rank {rank}: state placed {result['placement']} holding {result['held']}, expected S(1) holding "
            f"(2, {channels}, 3)")
        assert result["state_diff"] < TOLERANCE, f"rank {rank}: state differs by {result['state_diff']:.3g}"
