"""One compiled model serves every batch size and sequence length (dynamic batch and sequence dims).

Tier (b): symbolic localisation of shape arguments on a fake process group (no gloo), the
clear error for a static dim, keyword inputs in any order and the errors for other structures. Tier (c): real gloo runs at tp 2 and 3 (uneven heads), one
compile per model, called at three shapes, compared with the single-process model (1e-4).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from models import BUILDERS, tiny_llama, tiny_mlp
from torch import nn

import autotp
from autotp.base.errors import InputShapeError

aten = torch.ops.aten
TOLERANCE = 1e-4
SHAPES = [(1, 5), (3, 33), (2, 9)]  # (batch, sequence); traced at (2, 16)


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield
    dist.destroy_process_group()


def _compile(model: torch.nn.Module, args: tuple, kwargs: dict, **options: object) -> autotp.TensorParallelModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.compile(model, example_inputs=args, example_kwargs=kwargs, **options)


def _shape_args(gm: fx.GraphModule) -> list[list]:
    return [list(n.args[1]) for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]


def test_shape_arguments_stay_symbolic_except_the_split_dim(fake_group) -> None:
    """tp=3 (fake group, rank 1), Llama 8 q / 4 kv heads (kv 2/1/1 per rank, q 4/2/2), one layer: q is viewed as
    (batch, seq, 2 local heads, 32), k and v as (batch, seq, 1, 32), with batch and seq the graph's sym_size
    nodes; no view or reshape bakes the traced batch 2 or sequence 16."""
    model, args, kwargs = tiny_llama(layers=1)
    tp = _compile(model, args, kwargs)
    shapes = _shape_args(tp.graph_module)
    symbolic = [[a.target if isinstance(a, fx.Node) else a for a in shape] for shape in shapes]
    heads = sorted(s[2] for s in symbolic if len(s) == 4 and s[:2] == [aten.sym_size.int] * 2 and s[3] == 32)
    assert heads == [1, 1, 2], f"expected one q view of 2 heads and k, v views of 1 head, got {symbolic}"
    baked = [s for s in symbolic if not isinstance(s[0], torch._ops.OpOverload) or 16 in s]
    assert not baked, f"shape arguments with the traced batch 2 or sequence 16 baked in: {baked}"
    placeholders = {n.name: n for n in tp.graph_module.graph.nodes if n.op == "placeholder"}
    assert "input_ids" in placeholders, f"user input placeholder missing: {sorted(placeholders)}"


def test_only_static_dims_are_split() -> None:
    """tp=2 planning, MLP at (batch 2, seq 16, hidden 256): no node's output is split on a dynamic dim
    (batch, seq are symbols), so per-rank cuts never depend on the call's size."""
    model, args, kwargs = tiny_mlp()
    plan = autotp.plan(model, args, kwargs, world_size=2, options=autotp.PlanOptions(memory_budget=None))
    gm = autotp.capture.tracing.capture(model, args, kwargs).graph_module
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    bad = []
    for node in plan.nodes:
        for placement in (node.output, *node.inputs):
            if placement.startswith("S(") and isinstance(vals.get(node.name), torch.Tensor):
                dim = int(placement[2:placement.index(")")])
                if node.output == placement and not isinstance(vals[node.name].shape[dim], int):
                    bad.append((node.name, placement, vals[node.name].shape))
    assert not bad, f"splits of symbolic dims: {bad}"


def test_static_dim_called_at_another_size_names_the_dim_and_the_option(fake_group) -> None:
    """tp=3 (fake group), Llama traced with dynamic=False at (2, 16), called at (2, 9): an InputShapeError naming
    the input, the dim, both sizes and dynamic=True, raised before the graph runs (not a reshape error)."""
    model, args, kwargs = tiny_llama(layers=1)
    tp = _compile(model, args, kwargs, options=autotp.PlanOptions(dynamic=False))
    with pytest.raises(InputShapeError) as info:
        tp(torch.randint(0, 1000, (2, 9)), **kwargs)
    message = str(info.value)
    for part in ("input_ids", "dim 1", "size 9", "size 16", "dynamic=True"):
        assert part in message, f"expected {part!r} in the error, got: {message}"


def test_other_static_dims_name_why_and_the_fix(fake_group) -> None:
    """tp=3 (fake group): MLP traced at (2, 16, 256) called with hidden 128 (dim 2 is not dynamic by default: the
    error names dynamic_shapes=); CNN traced at 3 channels called with 4 (export fixed dim 1: the convolution
    needs 3); a 4-d input to the 3-d MLP says how many dims were traced."""
    model, args, kwargs = tiny_mlp()
    tp = _compile(model, args, kwargs)
    with pytest.raises(InputShapeError, match=r"dim 2 has size 128.*traced with size 256.*dynamic_shapes="):
        tp(torch.randn(2, 16, 128))
    with pytest.raises(InputShapeError, match=r"traced as a 3-d tensor"):
        tp(torch.randn(1, 2, 16, 256))
    cnn, cnn_args, cnn_kwargs = BUILDERS["cnn"]()
    tp_cnn = _compile(cnn, cnn_args, cnn_kwargs)
    with pytest.raises(InputShapeError, match=r"'images' dim 1 has size 4.*traced with size 3.*torch.export fixed it"):
        tp_cnn(torch.randn(2, 4, 16, 16))


def test_bert_sequence_beyond_positions_is_refused(fake_group) -> None:
    """tp=3 (fake group), BERT with 64 positions: export bounds the sequence at 64; 65 gives a clear error."""
    model, args, kwargs = BUILDERS["bert"](layers=1)
    tp = _compile(model, args, kwargs)
    with pytest.raises(InputShapeError, match=r"'input_ids' dim 1 has size 65, outside .*1\.\.64"):
        tp(torch.randint(0, 1000, (2, 65)))


def _serve_three_shapes(rank: int, world_size: int, name: str, builder_kwargs: dict, trace_cache: str) -> dict:
    """Compile once (through ``trace_cache``: tp=3 rebuilds the program tp=2 traced), call at every shape of SHAPES."""
    model, args, kwargs = BUILDERS[name](**builder_kwargs)
    tp = _compile(model, args, kwargs, runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
    plan, graph = tp.plan, tp.graph_module
    diffs = []
    generator = torch.Generator().manual_seed(7)
    for batch, seq in SHAPES:
        ids = torch.randint(0, 1000, (batch, seq), generator=generator)
        with torch.no_grad():
            expected = pytree.tree_leaves(model(ids, **kwargs))
        got = pytree.tree_leaves(tp(ids, **kwargs))
        shapes_match = [tuple(e.shape) == tuple(g.shape) for e, g in zip(expected, got)]
        assert all(shapes_match), f"{name} at {(batch, seq)}: shapes {[tuple(g.shape) for g in got]}"
        diffs.append(max((e - g).abs().max().item() for e, g in zip(expected, got) if isinstance(e, torch.Tensor)))
    return {"diffs": diffs, "same_objects": tp.plan is plan and tp.graph_module is graph,
            "counts": tp.collective_counts()}


CASES = [(2, "llama", {}), (2, "gpt2", {}), (2, "bert", {}),
         (3, "llama", {}), (3, "gpt2", {}), (3, "bert", {})]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,name,builder_kwargs", CASES, ids=[f"tp{ws}-{n}" for ws, n, _ in CASES])
def test_one_compile_serves_every_shape(gloo, world_size: int, name: str, builder_kwargs: dict, trace_cache: str) -> None:
    """tp=2 and tp=3 (uneven: 8 heads as 3/3/2) on gloo: compiled once at (batch 2, seq 16), called at (1, 5),
    (3, 33), (2, 9): every rank returns the single-process outputs, with the same plan and graph objects
    (no re-trace, no re-plan per shape)."""
    results = gloo.run(world_size, _serve_three_shapes, name, builder_kwargs, trace_cache)
    for rank, result in enumerate(results):
        for (batch, seq), diff in zip(SHAPES, result["diffs"]):
            assert diff <= TOLERANCE, f"{name} tp={world_size} rank {rank} at {(batch, seq)}: max abs diff {diff:.3g} > {TOLERANCE}"
        assert result["same_objects"], f"{name} tp={world_size} rank {rank}: plan or graph module replaced after calls"
        assert result["counts"] == results[0]["counts"], "every rank issues the same collectives"


def test_plan_that_splits_the_batch_says_to_pin_shapes() -> None:
    """tp=4 planning on meta, MLP at (8, 2048, 256) on h100-sxm with no memory budget: traced with dynamic=False
    the cheapest plan splits the batch (data-parallel style); applied to a dynamic capture, the mismatch error
    says batch and sequence are never split there and names dynamic=False."""
    from autotp.base.errors import PlanMismatchError
    from autotp.capture.tracing import capture, inputs_on_model_device
    from autotp.planning.checks import check_plan_applies

    model, args, kwargs = tiny_mlp(batch=8, seq_len=2048, device="meta")
    plan = autotp.plan(model, args, kwargs, world_size=4,
                       options=autotp.PlanOptions(dynamic=False, hardware="h100-sxm", memory_budget=None))
    batch_split = [n.name for n in plan.nodes if n.output == "S(0)" and n.op == "aten.linear.default"]
    assert batch_split, f"expected the static plan to split the batch, got {[(n.name, n.output) for n in plan.nodes]}"
    captured = capture(model, inputs_on_model_device(model, args), kwargs)
    with pytest.raises(PlanMismatchError, match=r"never split.*dynamic=False"):
        check_plan_applies(plan, captured, 4)


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * scale + shift


def test_keyword_tensors_in_any_order_and_clear_errors_for_other_structures(fake_group) -> None:
    """Keyword tensors given in another order than traced reach the same graph slots (the fast path keys them by
    name); a missing keyword and a container where a tensor was traced are refused with TypeError, as before."""
    torch.manual_seed(0)
    model = _Shifted()
    x, shift, scale = torch.randn(2, 5, 24), torch.randn(24), torch.randn(24)
    tp = _compile(model, (x,), {"shift": shift, "scale": scale})
    with torch.no_grad():
        traced_order = tp(x, shift=shift, scale=scale)
        other_order = tp(x, scale=scale, shift=shift)
        swapped = tp(x, shift=scale, scale=shift)
    assert torch.equal(traced_order, other_order), "keyword order must not matter"
    assert not torch.equal(traced_order, swapped), "each keyword reaches its own slot"
    with pytest.raises(TypeError, match="keyword arguments"):
        tp(x, shift=shift)
    with pytest.raises(TypeError, match="structure"):
        tp((x,), shift=shift, scale=scale)
