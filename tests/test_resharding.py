"""Typed resharding steps: routes between placements, the route the cost model prefers, plan files
that name the steps, and the all-to-all (S(i) -> S(j)) on real gloo ranks.

Tiers: the route and plan tests are unit tests (no process group); the equivalence tests run
tp=2 and tp=3 (uneven) on gloo.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autotp
from autotp.base.errors import PlanMismatchError
from autotp.base.placements import BlockShard, Partial, Replicate, Shard
from autotp.base.reshard import ReshardKind, ReshardStep, reshard_routes, reshard_steps, route_with_kinds
from autotp.cost_model import compute_time_s, get_hardware
from autotp.cost_model.compute import aten_memory_bytes
from autotp.cost_model.runtime import view_time_s
from autotp.cost_model.symbolic import BATCH, SEQ, evaluate_s
from autotp.passes.costing import reshard_route, route_time_s
from autotp.passes.resharding import (
    RESHARD_TABLE,
    SYMBOLIC,
    PartBytes,
    route_label,
    step_time_terms,
    tensor_route_time_s,
)
from autotp.passes.uneven import Partitions
from autotp.planning.plan import Plan

K = ReshardKind
TOLERANCE = 1e-4  # float32, as in test_equivalence.py


@pytest.mark.parametrize("src,dst,expected", [
    (Replicate(), Shard(1), (ReshardStep(K.SLICE, 1),)),
    (Replicate(), Partial(), (ReshardStep(K.ZERO),)),
    (Partial(), Replicate(), (ReshardStep(K.ALL_REDUCE),)),
    (Partial(), Shard(2), (ReshardStep(K.REDUCE_SCATTER, 2),)),
    (Partial(), BlockShard(0, 3), (ReshardStep(K.ALL_REDUCE), ReshardStep(K.SLICE, 0, 3))),
    (Shard(1), Replicate(), (ReshardStep(K.ALL_GATHER, 1),)),
    (BlockShard(1, 2), Replicate(), (ReshardStep(K.ALL_GATHER, 1, 2),)),
    (Shard(1), Shard(2), (ReshardStep(K.ALL_TO_ALL, 1, 1, 2),)),
    (BlockShard(2, 2), Shard(2), (ReshardStep(K.ALL_GATHER, 2, 2), ReshardStep(K.SLICE, 2))),
    (Shard(0), Partial(), (ReshardStep(K.ALL_GATHER, 0), ReshardStep(K.ZERO))),
    (Shard(0), Shard(0), ()),
])
def test_default_route_between_placements(src, dst, expected) -> None:
    """One mesh axis: the default steps (and their dims) from each placement to each other."""
    assert reshard_steps(src, dst) == expected, f"{src} -> {dst}: expected {expected}, got {reshard_steps(src, dst)}"


def test_every_step_kind_has_one_table_row() -> None:
    """The table prices, emits and names every kind; the kinds' names are what plan files hold."""
    assert set(RESHARD_TABLE) == set(ReshardKind), f"table rows {set(RESHARD_TABLE)} != kinds {set(ReshardKind)}"
    local = {kind for kind, spec in RESHARD_TABLE.items() if spec.collective is None}
    assert local == {K.SLICE, K.ZERO}, f"local steps: expected slice and zero, got {local}"
    assert route_label([K.ALL_GATHER, "slice"]) == "all_gather+slice", route_label([K.ALL_GATHER, "slice"])
    assert json.dumps([K.ALL_TO_ALL]) == '["all_to_all"]', json.dumps([K.ALL_TO_ALL])


def test_shard_to_shard_takes_the_route_the_cost_model_prefers() -> None:
    """tp=2..8 on h100-sxm: S(i) -> S(j) has two routes (all-to-all; all-gather then slice) and the
    cost pass takes the cheaper. A small tensor gathered along dim 0 needs no layout copies, so
    the all-gather wins there; a large one, or one split along another dim, goes all-to-all."""
    hardware = get_hardware("h100-sxm")
    chosen = set()
    with FakeTensorMode():
        for shape in [(4, 8), (1024, 4096)]:
            value = torch.empty(shape)
            for src, dst in [(Shard(0), Shard(1)), (Shard(1), Shard(0))]:
                for world_size in (2, 3, 8):
                    routes = reshard_routes(src, dst)
                    times = [route_time_s(route, value, world_size, hardware) for route in routes]
                    route = reshard_route(src, dst, value, world_size, hardware)
                    assert route_time_s(route, value, world_size, hardware) == min(times), (
                        f"{shape} {src}->{dst} tp={world_size}: chose {route} at "
                        f"{route_time_s(route, value, world_size, hardware)}, routes cost {times}")
                    chosen.add((shape, src.dim, tuple(step.kind for step in route)))
    assert ((4, 8), 0, (K.ALL_GATHER, K.SLICE)) in chosen, f"small S(0)->S(1) should gather: {sorted(chosen)}"
    assert ((1024, 4096), 1, (K.ALL_TO_ALL,)) in chosen, f"large S(1)->S(0) should be all-to-all: {sorted(chosen)}"


def test_symbolic_route_price_is_the_planner_price() -> None:
    """tp=3 (uneven splits of seq and of 10 features) on h100-sxm: every route priced on sympy sizes
    (batch, seq, 10) by the table's rows, evaluated at concrete sizes, equals the cost pass's
    numeric price of a tensor of those sizes (layout copies of a non-dim-0 gather included)."""
    hardware = get_hardware("h100-sxm")
    pairs = [(Shard(2), Replicate()), (Shard(0), Replicate()), (Partial(), Replicate()), (Partial(), Shard(1)),
             (Replicate(), Shard(1)), (Replicate(), Partial()), (Shard(1), Shard(2)), (Shard(2), Partial())]
    with FakeTensorMode():
        for src, dst in pairs:
            for route in reshard_routes(src, dst):
                expression = tensor_route_time_s(route, (BATCH, SEQ, 10), torch.float32, 3, hardware,
                                                 formulas=SYMBOLIC)
                for batch, seq in [(1, 1), (2, 7), (4, 4096)]:
                    numeric = route_time_s(route, torch.empty(batch, seq, 10), 3, hardware)
                    got = evaluate_s(expression, {BATCH: batch, SEQ: seq})
                    assert got == pytest.approx(numeric, rel=1e-12, abs=1e-18), (
                        f"{src}->{dst} by {route_label(s.kind for s in route)} at batch={batch} seq={seq}: "
                        f"planner {numeric}, symbolic {got} ({expression})")


class _RankGraph:
    """The rewrite's view of one rank's graph (``autotp.passes.rules.LocalGraph``), built here so that a step can
    be emitted alone."""

    def __init__(self, parts: Partitions, rank: int) -> None:
        self.graph, self.parts, self.rank = fx.Graph(), parts, rank
        self.world_size, self.group_name = parts.world_size, "test"

    def call(self, target: object, *args: object, meta_from: fx.Node | None = None) -> fx.Node:
        return self.graph.call_function(target, args)


_C10D = torch.ops._c10d_functional


class _Collectives(fx.Interpreter):
    """Runs an emitted step on real tensors, each collective replaced by a local op of its output's shape, and
    records every other node as ``(op, bytes it reads and writes)``: 0 for a node whose output aliases its input
    (a view, or a ``contiguous`` that returns its input), else ``aten_memory_bytes`` of its real arguments."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.nodes: list[tuple[object, int]] = []

    def call_function(self, target, args, kwargs):  # noqa: ANN001, ANN201 - fx.Interpreter's hook
        if target is _C10D.all_gather_into_tensor.default:
            return torch.cat([args[0]] * args[1])
        if target is _C10D.reduce_scatter_tensor.default:
            return args[0].narrow(0, 0, args[0].shape[0] // args[2]).clone()
        if target is _C10D.all_to_all_single.default:
            return torch.zeros(sum(args[1]), *args[0].shape[1:])
        if target is _C10D.all_reduce.default:
            return args[0].clone()
        if target is _C10D.wait_tensor.default:
            return args[0]
        out = super().call_function(target, args, kwargs)
        first = args[0][0] if isinstance(args[0], list) else args[0]
        aliases = out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        self.nodes.append((target, 0 if aliases else aten_memory_bytes(target, args, kwargs, out)))
        return out


def _emitted_nodes(step: ReshardStep, shape: tuple[int, ...], world_size: int, rank: int) -> list[tuple[object, int]]:
    """The local nodes ``step``'s rewrite emits on ``rank`` for a tensor of ``shape``, run on real tensors."""
    parts = Partitions(world_size)
    for dim in {step.dim, step.to_dim} - {None}:
        parts.add(("x", dim, step.blocks), shape[dim] // step.blocks)
    builder = _RankGraph(parts, rank)
    producer = builder.graph.placeholder("x")
    producer.meta["val"] = torch.empty(shape)
    local = list(shape)
    if step.kind in (K.ALL_GATHER, K.ALL_TO_ALL):  # the step starts from this rank's part
        local[step.dim] = step.blocks * parts.local("x", step.dim, rank, step.blocks)[1]
    builder.graph.output(RESHARD_TABLE[step.kind].emit(builder, producer, producer, step))
    interpreter = _Collectives(fx.GraphModule(nn.Module(), builder.graph))
    interpreter.run(torch.randn(local))
    return interpreter.nodes


@pytest.mark.parametrize("step,shape,world_size", [
    (ReshardStep(K.SLICE, 1), (3, 8, 5), 2),
    (ReshardStep(K.SLICE, 2, 2), (3, 4, 14), 3),
    (ReshardStep(K.ZERO), (3, 4), 2),
    (ReshardStep(K.ALL_REDUCE), (3, 4), 2),
    (ReshardStep(K.ALL_GATHER, 0), (8, 5), 2),
    (ReshardStep(K.ALL_GATHER, 0), (7, 5), 3),
    (ReshardStep(K.ALL_GATHER, 1), (3, 8, 5), 4),
    (ReshardStep(K.ALL_GATHER, 1), (3, 10, 5), 4),
    (ReshardStep(K.ALL_GATHER, 2, 2), (3, 4, 12), 2),
    (ReshardStep(K.ALL_GATHER, 1, 3), (2, 15, 3), 2),
    (ReshardStep(K.REDUCE_SCATTER, 0), (8, 5), 4),
    (ReshardStep(K.REDUCE_SCATTER, 1), (3, 8, 5), 2),
    (ReshardStep(K.REDUCE_SCATTER, 1), (3, 11, 5), 4),
    (ReshardStep(K.REDUCE_SCATTER, 0), (7, 5), 3),
    (ReshardStep(K.ALL_TO_ALL, 1, 1, 2), (3, 8, 6), 2),
    (ReshardStep(K.ALL_TO_ALL, 1, 1, 2), (3, 7, 5), 3),
    (ReshardStep(K.ALL_TO_ALL, 2, 1, 0), (5, 3, 7), 4),
    (ReshardStep(K.ALL_TO_ALL, 2, 1, 0), (4, 3, 8), 2),
    (ReshardStep(K.ALL_TO_ALL, 0, 1, 2), (6, 3, 4), 2),
    (ReshardStep(K.ALL_TO_ALL, 3, 1, 1), (2, 8, 3, 4), 4),
])
def test_each_step_prices_the_nodes_its_rewrite_emits(step, shape, world_size) -> None:
    """Every local node a step's rewrite emits (run on real tensors, its collective replaced by a local op) is
    in the step's priced layout with the bytes it moves, and nothing else is: even and uneven parts, blocks,
    dim 0 and others. On rank 0, the largest part; a zero-fill on rank 1, the ranks that write zeros. The terms
    besides the collective are those nodes priced as the cost pass prices a graph's (a view's dispatch; a kernel
    by its bytes), on a GPU profile and a CPU one."""
    rank = 1 if step.kind is K.ZERO else 0
    emitted = collections.Counter(_emitted_nodes(step, shape, world_size, rank))
    parts = PartBytes.of(step, shape, torch.float32.itemsize, world_size)
    priced = collections.Counter()
    for op, nbytes, count in RESHARD_TABLE[step.kind].layout(step, parts):
        priced[(op, nbytes)] += count
    priced = +priced  # ops the step does not emit here: a count of 0
    assert emitted == priced, (f"{step.kind} dim {step.dim} x{step.blocks} of {shape} over {world_size}: the rewrite "
                               f"emits {sorted(map(str, emitted.items()))}, the price counts "
                               f"{sorted(map(str, priced.items()))}")
    for hardware in (get_hardware("h100-sxm"), dataclasses.replace(get_hardware("cpu-gloo"), view_op_s=2e-6)):
        terms = step_time_terms(step, shape, torch.float32, world_size, hardware)
        local = terms[1:] if RESHARD_TABLE[step.kind].collective else terms
        expected = sum(n * (view_time_s(hardware) if nbytes == 0 else compute_time_s(0, nbytes, torch.float32, hardware))
                       for (_, nbytes), n in emitted.items())
        assert sum(local) == pytest.approx(expected, rel=1e-12), (
            f"{step.kind} on {hardware.name}: local nodes priced {sum(local)} s, as graph nodes {expected} s")


def test_route_named_by_a_plan_must_exist() -> None:
    """A hand-edited plan naming steps that do not turn src into dst is refused, with the possible routes."""
    assert route_with_kinds(Shard(0), Shard(1), ("all_gather", "slice"))[0].kind is K.ALL_GATHER
    with pytest.raises(ValueError, match=r"possible: all_to_all or all_gather\+slice"):
        route_with_kinds(Shard(0), Shard(1), ("all_reduce",))


class _ShardSwap(nn.Module):
    """``x (batch, seq, rows * cols)``: linear, unflatten to ``(batch, seq, rows, cols)``, relu, gelu,
    flatten, linear. Pinning relu's output to S(2) (rows) and gelu's to S(3) (cols) puts an
    S(2)->S(3) edge (relu to gelu) and an S(3)->S(2) edge (gelu to the flatten) in the plan. The
    static dims are split, not batch or sequence (which stay symbolic)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.rows, self.cols = rows, cols
        self.up = nn.Linear(rows * cols, rows * cols)
        self.down = nn.Linear(rows * cols, rows * cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x).unflatten(-1, (self.rows, self.cols)))  # (batch, seq, rows, cols), split rows
        g = nn.functional.gelu(h)  # split cols
        return self.down(g.flatten(-2))


_PINS = {"relu": "S(2)", "gelu": "S(3)"}


def _shard_swap(rows: int, cols: int) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _ShardSwap(rows, cols).eval()
        x = torch.randn(2, 3, rows * cols)  # (batch, seq, rows * cols)
    return model, x


def test_plan_files_keep_step_names() -> None:
    """tp=3, rows 5 / cols 7 (uneven): steps are saved by name and load back typed; a plan with the
    former S(i)->S(j) route (all_gather+slice) still loads; an unknown step name is refused."""
    model, x = _shard_swap(5, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, (x,), world_size=3, options=autotp.PlanOptions(constraints=_PINS))
    data = json.loads(plan.to_json())
    names = {tuple(c["steps"]) for c in data["collectives"]}
    assert ("all_to_all",) in names, f"expected an all_to_all step in the saved plan, got {names}"
    loaded = Plan.from_json(plan.to_json())
    assert loaded.collectives == plan.collectives, "collectives differ after a JSON round trip"
    assert all(isinstance(s, ReshardKind) for c in loaded.collectives for s in c.steps), loaded.collectives
    for c in data["collectives"]:
        if c["steps"] == ["all_to_all"]:
            c["steps"] = ["all_gather", "slice"]
    older = Plan.from_json(json.dumps(data))
    assert older.collective_counts().get("all_to_all") is None, older.collective_counts()
    data["collectives"][0]["steps"] = ["all_broadcast"]
    with pytest.raises(PlanMismatchError, match="unknown resharding step 'all_broadcast'; valid steps: slice, zero"):
        Plan.from_json(json.dumps(data))


_SWAP_ROUTES = ((K.ALL_TO_ALL,), (K.ALL_GATHER, K.SLICE))
"""The two routes of an S(i) -> S(j) edge."""


def _run_shard_swap(rank: int, world_size: int, rows: int, cols: int, route: tuple[ReshardKind, ...]) -> dict:
    """The shard-swap model compiled with its S(i) -> S(j) edges taken by ``route`` (named in the plan, as a plan
    file names them), against the single-process model."""
    model, x = _shard_swap(rows, cols)
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, (x,), world_size=world_size, options=autotp.PlanOptions(constraints=_PINS))
        collectives = tuple(dataclasses.replace(c, steps=route) if c.steps in _SWAP_ROUTES else c
                            for c in plan.collectives)
        plan = dataclasses.replace(plan, collectives=collectives)
        tp_model = autotp.compile(model, example_inputs=(x,), plan=plan)
    got = tp_model(x)
    return {
        "max_diff": (expected - got).abs().max().item(),
        "graph_counts": tp_model.collective_counts(),
        "plan_steps": sorted({"+".join(map(str, c.steps)) for c in plan.collectives}),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,rows,cols", [(2, 4, 6), (3, 5, 7)], ids=["tp2-even", "tp3-uneven"])
def test_all_to_all_matches_single_process(gloo, world_size: int, rows: int, cols: int) -> None:
    """tp=2 (rows 4, cols 6) and tp=3 (rows 5 -> 2/2/1, cols 7 -> 3/2/2): the S(2)->S(3) and
    S(3)->S(2) edges, taken by the all-to-all, are emitted as all_to_all_single, and every rank's
    output equals the single-process model's. The plan names the route: at sizes this small the cost
    model may price all_gather+slice lower, each with every node its rewrite emits."""
    results = gloo.run(world_size, _run_shard_swap, rows, cols, (K.ALL_TO_ALL,))
    for rank, result in enumerate(results):
        assert "all_to_all" in result["plan_steps"], f"rank {rank}: plan steps {result['plan_steps']}"
        assert result["graph_counts"].get("all_to_all") == 2, (
            f"rank {rank}: expected 2 all_to_all_single in the graph, got {result['graph_counts']}")
        assert result["graph_counts"].get("all_gather") is None, f"rank {rank}: {result['graph_counts']}"
        assert result["max_diff"] <= TOLERANCE, f"rank {rank}: max abs diff {result['max_diff']:.3g} > {TOLERANCE}"


def _all_to_all_every_dim_pair(rank: int, world_size: int) -> list[str]:
    """On this rank, each ``S(i) -> S(j)`` all-to-all of a 3-d and a 4-d tensor (every pair of dims that split
    evenly) emitted alone and run on the group: what differs from the tensor's ``j``-part, or is not contiguous."""
    failures = []
    for shape in [(4, 6, 8), (2, 4, 6, 8)]:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        for i, j in itertools.permutations(range(len(shape)), 2):
            if shape[i] % world_size or shape[j] % world_size:
                continue
            parts = Partitions(world_size)
            for dim in (i, j):
                parts.add(("x", dim, 1), shape[dim])
            builder = _RankGraph(parts, rank)
            builder.group_name = dist.group.WORLD.group_name
            producer = builder.graph.placeholder("x")
            producer.meta["val"] = torch.empty(shape)
            builder.graph.output(RESHARD_TABLE[K.ALL_TO_ALL].emit(builder, producer, producer, ReshardStep(K.ALL_TO_ALL, i, 1, j)))
            got = fx.GraphModule(nn.Module(), builder.graph)(full.chunk(world_size, i)[rank].contiguous())
            want = full.chunk(world_size, j)[rank]
            if got.shape != want.shape or not torch.equal(got, want) or not got.is_contiguous():
                failures.append(f"{shape} S({i}) -> S({j}): got {tuple(got.shape)}, contiguous {got.is_contiguous()}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_of_every_dim_pair_is_the_new_part(gloo, world_size: int) -> None:
    """tp=2 and 4, parts of one width: every S(i) -> S(j) of a 3-d and a 4-d tensor (j in front or not, i before
    or after j) leaves each rank exactly its j-part of the tensor, laid out contiguous."""
    for rank, failures in enumerate(gloo.run(world_size, _all_to_all_every_dim_pair)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


@pytest.mark.distributed
def test_plan_naming_all_gather_and_slice_still_applies(gloo) -> None:
    """tp=3, uneven (rows 5, cols 7): a plan that records all_gather+slice for S(i)->S(j) (as plans
    saved before the all-to-all did) is applied as recorded, and outputs still match."""
    results = gloo.run(3, _run_shard_swap, 5, 7, (K.ALL_GATHER, K.SLICE))
    for rank, result in enumerate(results):
        assert result["graph_counts"].get("all_to_all") is None, f"rank {rank}: {result['graph_counts']}"
        assert result["graph_counts"].get("all_gather") == 2, (
            f"rank {rank}: expected 2 all_gather in the graph, got {result['graph_counts']}")
        assert result["max_diff"] <= TOLERANCE, f"rank {rank}: max abs diff {result['max_diff']:.3g} > {TOLERANCE}"
