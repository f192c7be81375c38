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


def _reduce_and_gather_graph(group_name: str, world_size: int) -> fx.GraphModule:
    """``x -> (all_reduce(x) * 2, all_gather_into_tensor(x))``, each waited on, as the rewrite emits them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(c10d.wait_tensor.default,
                                  (graph.call_function(c10d.all_reduce.default, (x, "sum", group_name)),))
    gathered = graph.call_function(c10d.wait_tensor.default, (
        graph.call_function(c10d.all_gather_into_tensor.default, (x, world_size, group_name)),))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (reduced, 2.0)), gathered))
    return fx.GraphModule(torch.nn.Module(), graph)


def _shared_memory_sums(rank: int, world_size: int) -> dict[str, Any]:
    from autotp.base.errors import RankTimeoutError
    from autotp.runtime.collectives.hosts import local_host
    from autotp.runtime.collectives.inference_collectives import inference_all_reduces
    from autotp.runtime.collectives.shared_memory import shared_memory_all_reduce_for

    gm = inference_all_reduces(_reduce_and_gather_graph(dist.group.WORLD.group_name, world_size), None, world_size,
                               host=local_host(), timeout_s=30.0)
    out: dict[str, Any] = {"targets": [type(n.target).__name__ for n in gm.graph.nodes if n.op == "call_function"],
                           "counts": count_collectives(gm)}
    # a 256-byte slot: 64 floats per chunk, so the larger tensors go through in many chunks
    small_slots = shared_memory_all_reduce_for(None, host=local_host(), timeout_s=30.0, slot_bytes=256)
    generator = torch.Generator().manual_seed(rank)
    for name, shape in (("graph, (2, 3)", (2, 3)), ("graph, (7, 33): another size", (7, 33)),
                        ("chunks, 1000 = 15 slots + 40", (1000,)), ("chunks, one slot exactly", (64,))):
        x = torch.randn(*shape, generator=generator)
        expected = x.clone()
        dist.all_reduce(expected)
        expected_gather = torch.empty(world_size * shape[0], *shape[1:])
        dist.all_gather_into_tensor(expected_gather, x)
        if name.startswith("graph"):
            got, got_gather = gm(x)
            got = got / 2.0
        else:
            got, got_gather = small_slots(x), small_slots.all_gather(x)
        gathered = [torch.empty_like(got) for _ in range(world_size)]
        dist.all_gather(gathered, got)
        out[name] = {"close": bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-6)),
                     "max_error": float((got - expected).abs().max()),
                     "same_bits_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered),
                     "gather_equal": torch.equal(got_gather, expected_gather)}
    # rank 0's graph takes a CUDA tensor (fake: no GPU needed to trace one): the segment is host memory, so
    # every rank keeps gloo's own collectives
    from torch._subclasses.fake_tensor import FakeTensorMode

    on_gpu = _reduce_and_gather_graph(dist.group.WORLD.group_name, world_size)
    if rank == 0:
        with FakeTensorMode():
            next(iter(on_gpu.graph.nodes)).meta["val"] = torch.empty(2, 3, device="cuda")
    on_gpu = inference_all_reduces(on_gpu, None, world_size, host=local_host(), timeout_s=30.0)
    out["gpu_targets"] = [type(n.target).__name__ for n in on_gpu.graph.nodes if n.op == "call_function"]
    # the last rank never calls: the others give up after 0.2 s and name it
    absent = shared_memory_all_reduce_for(None, host=local_host(), timeout_s=0.2)
    out["timeout"] = None
    if rank != world_size - 1:
        try:
            absent(torch.ones(4))
        except RankTimeoutError as error:
            out["timeout"] = str(error)
    dist.barrier()
    return out


def test_shared_memory_all_reduce_sums_like_gloo_agrees_across_ranks_and_times_out(gloo) -> None:
    """tp=2 and tp=3, gloo ranks on one host: the pass replaces all_reduce + wait_tensor (and all_gather_into_tensor
    + wait_tensor) by one shared-memory node each (counted as before); uneven sizes, sizes changing across calls
    and tensors of many slots sum like dist.all_reduce with the same bits on every rank and gather like
    dist.all_gather_into_tensor; where one rank's graph is on CUDA, no rank takes the shared-memory nodes; a rank
    that never arrives makes the others raise RankTimeoutError naming it and the timeout."""
    for world_size in (2, 3):
        results = gloo.run(world_size, _shared_memory_sums)
        for rank, result in enumerate(results):
            where = f"tp={world_size}, rank {rank}"
            assert sorted(result["targets"]) == ["OpOverload", "SharedMemoryAllGather", "SharedMemoryAllReduce"], (
                f"{where}: expected each collective pair replaced by one shared-memory node, got {result['targets']}")
            assert result["counts"] == {"all_reduce": 1, "all_gather": 1}, (
                f"{where}: counted {result['counts']}, expected one all_reduce and one all_gather")
            assert not any(t.startswith("SharedMemory") for t in result["gpu_targets"]), (
                f"{where}: rank 0's graph is on CUDA, yet the shared-memory nodes went in: {result['gpu_targets']}")
            for name, check in result.items():
                if isinstance(check, dict) and "close" in check:
                    assert check["close"], f"{where}, {name}: differs from dist.all_reduce by {check['max_error']}"
                    assert check["same_bits_on_every_rank"], f"{where}, {name}: ranks got different sums"
                    assert check["gather_equal"], f"{where}, {name}: the all-gather differs from gloo's"
            if rank == world_size - 1:
                continue
            message = result["timeout"] or ""
            assert f"rank {world_size - 1} of the group did not arrive within 0.2 s" in message, (
                f"{where}: expected a timeout naming rank {world_size - 1} and 0.2 s, got {message!r}")


def _symmetric_memory_on_this_build(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank's graph on CUDA (fake tensors: nothing runs), on a torch without CUDA."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotp.runtime.collectives.hosts import local_host
    from autotp.runtime.collectives.inference_collectives import graph_device, inference_all_reduces
    from autotp.runtime.collectives.symmetric_memory import has_kernel

    gm = _reduce_and_gather_graph(dist.group.WORLD.group_name, world_size)
    with FakeTensorMode():
        next(iter(gm.graph.nodes)).meta["val"] = torch.empty(2, 3, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = inference_all_reduces(gm, None, world_size, host=local_host(), timeout_s=30.0)
    return {"device": str(graph_device(gm)), "has_kernel": has_kernel(),
            "warnings": [str(w.message) for w in caught],
            "targets": [getattr(n.target, "__name__", type(n.target).__name__)
                        for n in gm.graph.nodes if n.op == "call_function"]}


def test_symmetric_memory_all_reduce_falls_back_alike_on_every_rank_where_it_cannot_allocate(gloo) -> None:
    """tp=2, gloo ranks on one host whose graphs are on CUDA, on this CPU build of torch (it has the kernel's
    schema but no CUDA): the ranks agree on the symmetric-memory form, every rank fails to allocate its buffer,
    and every rank warns, naming why, and keeps the backend's all-reduce and all-gather (no shared memory either:
    the tensors are not in host memory)."""
    if torch.cuda.is_available():  # there the allocation this test needs to fail succeeds
        pytest.skip("checks the fallback where no symmetric memory can be allocated, which a CUDA build does "
                    "allocate; the allocated path is run by benchmarks/gpu_check.sh (gloo, CUDA tensors, 2 ranks)")
    results = gloo.run(2, _symmetric_memory_on_this_build)
    for rank, result in enumerate(results):
        assert result["device"].startswith("cuda") and result["has_kernel"], f"rank {rank}: {result}"
        assert any("keeps the backend's all-reduce" in w and "could not allocate symmetric memory" in w
                   for w in result["warnings"]), f"rank {rank}: expected the fallback named, got {result['warnings']}"
        assert result["targets"] == ["all_reduce.default", "wait_tensor.default", "all_gather_into_tensor.default",
                                     "wait_tensor.default", "mul.Tensor"], (
            f"rank {rank}: expected the backend's collectives kept, got {result['targets']}")


def _symmetric_memory_routes(rank: int, world_size: int) -> dict[str, Any]:
    """Which all-reduces ``sum_in_symmetric_memory`` hands to the kernel: CPU tensors, so the backend's sums run
    (gloo) and the kernel, which has no CPU implementation, raises where it is asked."""
    from autotp.runtime.collectives.symmetric_memory import sum_in_symmetric_memory

    buffer = torch.zeros(ONE_SHOT_MAX_BYTES, dtype=torch.uint8)  # the kernel branch never reaches its memory here
    group_name = dist.group.WORLD.group_name
    out: dict[str, Any] = {}
    for name, x in (("float32, 2 x 3", torch.full((2, 3), rank + 1.0)),
                    ("bfloat16, 4", torch.full((4,), rank + 1.0, dtype=torch.bfloat16)),
                    ("float16, 4", torch.full((4,), rank + 1.0, dtype=torch.float16)),
                    ("bfloat16, 3: 6 bytes", torch.full((3,), rank + 1.0, dtype=torch.bfloat16)),
                    ("float32, one over 256 KiB", torch.full((ONE_SHOT_MAX_BYTES // 4 + 1,), rank + 1.0)),
                    ("float32, empty", torch.zeros(0, 5))):
        try:
            got = sum_in_symmetric_memory(x, buffer, group_name, world_size)
            out[name] = "backend" if torch.equal(got, torch.full_like(x, sum(range(1, world_size + 1)))) else "wrong"
        except NotImplementedError as exc:
            out[name] = "kernel" if "symm_mem::one_shot_all_reduce_copy_out" in str(exc) else f"other: {exc}"
    return out


def test_symmetric_memory_takes_small_float32_and_bfloat16_and_leaves_the_rest_to_the_backend(gloo) -> None:
    """tp=2, gloo, CPU tensors: float32 and bfloat16 all-reduces of at most 256 KiB and a multiple of 4 bytes go to
    the one-shot kernel (asked for on the CPU, where it has no implementation, it raises); float16, 6 bytes, one
    element over 256 KiB and an empty tensor go to the backend's all-reduce and sum right."""
    for rank, result in enumerate(gloo.run(2, _symmetric_memory_routes)):
        assert result == {"float32, 2 x 3": "kernel", "bfloat16, 4": "kernel", "float16, 4": "backend",
                          "bfloat16, 3: 6 bytes": "backend", "float32, one over 256 KiB": "backend",
                          "float32, empty": "backend"}, f"rank {rank}: {result}"


def test_symmetric_memory_stand_in_becomes_its_custom_op_for_a_compiler() -> None:
    """No process group: a graph calling a SymmetricMemoryAllReduce becomes, for torch.compile, one call of
    ``autotp::symmetric_memory_all_reduce`` on the buffer (a buffer of the copy, the op mutates it) with the group's
    name and size; traced on fake CUDA tensors it gives a tensor of the input's shape, dtype and device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotp.passes.small_collectives import compiler_visible_collectives
    from autotp.runtime.collectives.symmetric_memory import SymmetricMemoryAllReduce

    buffer = torch.zeros(ONE_SHOT_MAX_BYTES, dtype=torch.uint8)
    stand_in = SymmetricMemoryAllReduce(buffer, group_name="7", world_size=4)
    graph = fx.Graph()
    graph.output(graph.call_function(stand_in, (graph.placeholder("x"),)))
    as_op = compiler_visible_collectives(fx.GraphModule(torch.nn.Module(), graph))
    calls = [n for n in as_op.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.autotp.symmetric_memory_all_reduce.default], calls
    state = next(n for n in as_op.graph.nodes if n.op == "get_attr")
    assert calls[0].args[1] is state and as_op.get_buffer(str(state.target)) is buffer, "the op takes the buffer itself"
    assert calls[0].args[2:] == ("7", 4), calls[0].args
    schema = torch.ops.autotp.symmetric_memory_all_reduce.default._schema
    assert [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments] == [False, True, False, False]
    with FakeTensorMode():
        x = torch.empty(3, 8, dtype=torch.bfloat16, device="cuda")
        out = torch.ops.autotp.symmetric_memory_all_reduce(x, torch.empty(16, dtype=torch.uint8, device="cuda"), "7", 4)
    assert (out.shape, out.dtype, out.device.type) == ((3, 8), torch.bfloat16, "cuda"), out
