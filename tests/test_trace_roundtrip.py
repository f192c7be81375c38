"""Tiers (a) and (b), no processes: a program rebuilt from the shared trace is the program that was traced.

``autotp.compile`` traces once per group: rank 0 exports and the other ranks rebuild its serialized
program (``runtime/agreement/shared_trace.py``, through ``trace_cache.program_bytes`` / ``program_from_bytes``).
The ranks' agreement then compares graph fingerprints, so a rebuild that differs by one node (a
``getitem`` the serialized form invents for an unused output) made every rank fail with "the traced
graphs differ" although the ranks were identical. Here each case is captured both ways, as rank 0
does and as another rank does, and the two graphs are compared node for node: every multi-output op
that has a sharding rule (each output used alone), the list-returning ops, and every model family.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from models import BUILDERS
from odd_models import batch_stats_cnn
from torch import nn

from autotp.capture.trace_cache import program_bytes, program_from_bytes, trace_key
from autotp.capture.tracing import Traced, capture, trace_device
from autotp.passes.rules import RULES
from autotp.planning.plan import graph_fingerprint

aten = torch.ops.aten


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _norm_stats(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ones(n), torch.zeros(n), torch.zeros(n), torch.ones(n)


# op -> (call, example inputs); the call's outputs are a tuple (or list) whose items the cases use one at a time
MULTI_OUTPUT_CASES: dict[object, tuple[Callable[..., object], tuple[torch.Tensor, ...]]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v), (_x(1, 2, 4, 8),) * 3),
    aten._native_batch_norm_legit_no_training.default: (
        lambda x: aten._native_batch_norm_legit_no_training(x, *_norm_stats(3), 0.1, 1e-5), (_x(2, 3, 4, 4),)),
    aten.max_pool2d_with_indices.default: (lambda x: aten.max_pool2d_with_indices(x, [2, 2]), (_x(1, 3, 4, 4),)),
    aten.max_pool3d_with_indices.default: (lambda x: aten.max_pool3d_with_indices(x, [2, 2, 2]), (_x(1, 2, 4, 4, 4),)),
    aten.adaptive_max_pool1d.default: (lambda x: aten.adaptive_max_pool1d(x, [2]), (_x(1, 3, 8),)),
    aten.adaptive_max_pool2d.default: (lambda x: aten.adaptive_max_pool2d(x, [2, 2]), (_x(1, 3, 4, 4),)),
    aten.native_dropout.default: (lambda x: aten.native_dropout(x, 0.5, False), (_x(2, 8),)),
    aten.topk.default: (lambda x: aten.topk(x, 2), (_x(2, 8),)),
    aten.sort.default: (lambda x: aten.sort(x), (_x(2, 8),)),
    aten.sort.stable: (lambda x: aten.sort.stable(x, stable=True), (_x(2, 8),)),
    aten.kthvalue.default: (lambda x: aten.kthvalue(x, 2), (_x(2, 8),)),
    aten.cummax.default: (lambda x: aten.cummax(x, 1), (_x(2, 8),)),
    aten.cummin.default: (lambda x: aten.cummin(x, 1), (_x(2, 8),)),
    aten.native_layer_norm.default: (
        lambda x: aten.native_layer_norm(x, [8], torch.ones(8), torch.zeros(8), 1e-5), (_x(2, 8),)),
    aten.max.dim: (lambda x: aten.max.dim(x, 1), (_x(2, 8),)),
    aten.min.dim: (lambda x: aten.min.dim(x, 1), (_x(2, 8),)),
    # list outputs: a getitem per item used
    aten.split.Tensor: (lambda x: aten.split.Tensor(x, 3, 1), (_x(2, 8),)),
    aten.split_with_sizes.default: (lambda x: aten.split_with_sizes(x, [3, 5], 1), (_x(2, 8),)),
    aten.unbind.int: (lambda x: aten.unbind(x, 0), (_x(2, 8),)),
}


def _outputs(op: object) -> int:
    call, inputs = MULTI_OUTPUT_CASES[op]
    return len(call(*inputs))


class _Uses(nn.Module):
    """Returns item ``index`` of ``call``'s outputs (plus a parameter, so the graph has state to bind).

    ``in_place``: the result is updated in place, so capture hands on the program functionalized, which drops
    the ``getitem`` of every unused output (torch.export's own program keeps one with no users).
    """

    def __init__(self, call: Callable[..., object], index: int, *, in_place: bool) -> None:
        super().__init__()
        self.call = call
        self.index = index
        self.in_place = in_place
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.call(*xs)[self.index] * self.scale
        if self.in_place:
            out += 1
        return out


def _rebuilt(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object, training: bool,
             trace: Callable[[], Traced]) -> Traced:
    """What a rank other than 0 gets (``FirstRankTrace``): rank 0's program serialized, rebuilt with its own weights."""
    traced = trace()
    device = trace_device(args, kwargs)
    key = trace_key(model, args, kwargs, dynamic_shapes, device=device, training=training)
    rebuilt = program_from_bytes(program_bytes(key, traced.exported), key, model, device)
    assert rebuilt is not None, "the serialized program did not bind to the same model"
    return Traced(rebuilt, traced.mode, traced.dynamic_shapes)


def _nodes(gm: fx.GraphModule) -> list[str]:
    return [f"{n.name} = {n.op}[{n.target}]{n.args}" for n in gm.graph.nodes]


def _assert_same_program(model: nn.Module, args: tuple, kwargs: dict | None = None, *, dynamic: bool = True) -> fx.GraphModule:
    traced = capture(model, args, kwargs, dynamic=dynamic).graph_module
    rebuilt = capture(model, args, kwargs, dynamic=dynamic, share=_rebuilt).graph_module
    ours, theirs = _nodes(traced), _nodes(rebuilt)
    extra = sorted(set(theirs) - set(ours))
    missing = sorted(set(ours) - set(theirs))
    assert ours == theirs, f"rebuilt program differs: nodes only in the rebuild {extra}, only in the trace {missing}"
    assert graph_fingerprint(traced) == graph_fingerprint(rebuilt), "same nodes, different fingerprints"
    return traced


def test_every_multi_output_op_with_a_rule_has_a_case() -> None:
    """No mesh: every ruled op with several outputs (schema) is round-tripped below; a new one needs a case here."""
    multi = {op for op in RULES if isinstance(op, torch._ops.OpOverload) and len(op._schema.returns) > 1}
    lists = {op for op in RULES if isinstance(op, torch._ops.OpOverload) and op._schema.returns
             and str(op._schema.returns[0].type).endswith("[]") and op not in (aten.chunk.default,)}
    missing = sorted(str(op) for op in (multi | lists) - set(MULTI_OUTPUT_CASES))
    assert not missing, f"multi-output ops with a rule but no round-trip case: {missing}"


@pytest.mark.parametrize("in_place", [False, True], ids=["as-exported", "functionalized"])
@pytest.mark.parametrize("op", list(MULTI_OUTPUT_CASES), ids=str)
def test_a_multi_output_op_with_unused_outputs_round_trips(op: object, in_place: bool) -> None:
    """No mesh: ``op`` with only one of its outputs used (each in turn) rebuilds node for node, as torch.export
    gives it and functionalized (no ``getitem`` for the unused outputs)."""
    call, inputs = MULTI_OUTPUT_CASES[op]
    for index in range(_outputs(op)):
        graph = _assert_same_program(_Uses(call, index, in_place=in_place), inputs, dynamic=False)
        targets = {n.target for n in graph.graph.nodes}
        assert op in targets, f"the case for {op} traced to other ops: {sorted(map(str, targets))}"


def test_the_case_distinguishes_an_invented_getitem() -> None:
    """No mesh: the functionalized topk case is one where a rebuild could differ — the program sent has no
    ``getitem`` for the unused indices, and its serialized form names them (``*_unused_1``)."""
    from autotp.capture.tracing import _functional

    call, (x,) = MULTI_OUTPUT_CASES[aten.topk.default]
    model = _Uses(call, 0, in_place=True)
    exported = _functional(torch.export.export(model, (x,)))
    topk = next(n for n in exported.graph.nodes if n.target is aten.topk.default)
    assert [u.args[1] for u in topk.users] == [0], f"expected one getitem (values), got {list(topk.users)}"
    key = trace_key(model, (x,), {}, None, device=torch.device("cpu"), training=False)
    assert b"topk_unused_1" in program_bytes(key, exported), "torch's serializer no longer names unused outputs"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_family_round_trips(name: str) -> None:
    """No mesh: each model family's program (dynamic dims, stamped decoders included) rebuilds node for node."""
    model, args, kwargs = BUILDERS[name]()
    _assert_same_program(model, args, kwargs)


def test_an_eval_batch_norm_cnn_round_trips() -> None:
    """No mesh: a CNN with BatchNorm in eval mode (the case that raised a false disagreement) rebuilds node for node."""
    model, args, kwargs = batch_stats_cnn()
    _assert_same_program(model.eval(), args, kwargs)
