"""autotp.compile_mesh(model, mesh): data parallel x pipeline parallel x tensor parallel over a DeviceMesh.

Unit tests of the equal-stage fallback plan and the plan/mesh checks (no process group), then real
gloo runs against the single-process model: dp2 x tp2, pp2 x tp2, dp2 x pp2 on 4 processes (one
pool call), dp2 x pp2 x tp2 on 8, and bad input raising the same clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import tiny_llama

from autotp.base.module_paths import layer_blocks
from autotp.planning.even_stages import even_parallel_plan, stage_bounds
from autotp.planning.mesh_plan import MeshShape, ParallelPlan
from autotp.runtime.mesh.mesh_module import check_plan_for_mesh, default_microbatches, replica_sizes, split_stages

TINY = {"num_heads": 4, "num_kv_heads": 2, "hidden": 64, "intermediate": 128, "seq_len": 8}


def test_even_stages_cut_layer_blocks_and_name_bad_plans() -> None:
    """pp=3 over 4 blocks, pp > blocks, a plan for another mesh, uneven dp slices (no process group)."""
    model, _, _ = tiny_llama(**TINY, layers=4, device="meta")
    blocks = layer_blocks(model)
    assert blocks == [f"model.layers.{i}" for i in range(4)], f"expected model.layers.0..3, got {blocks}"
    assert stage_bounds(4, 3) == [(0, 2), (2, 3), (3, 4)], f"got {stage_bounds(4, 3)}"
    plan = even_parallel_plan(model, MeshShape(dp=1, pp=3, tp=1), microbatches=2, schedule="1f1b")
    assert plan.split_points == ("model.layers.2", "model.layers.3"), f"got {plan.split_points}"
    assert check_plan_for_mesh(plan, MeshShape(pp=3), model) == plan
    with pytest.raises(ValueError, match=r"pp=5 .* the model has 4; use a mesh with pp <= 4"):
        even_parallel_plan(model, MeshShape(pp=5))
    with pytest.raises(ValueError, match=r"plan was made for a mesh dp1 x pp3 x tp1 but the given mesh is dp1 x pp2 x tp2"):
        check_plan_for_mesh(plan, MeshShape(pp=2, tp=2), model)
    with pytest.raises(ValueError, match="schedule='zb' is not one"):
        even_parallel_plan(model, MeshShape(pp=2), schedule="zb")
    assert replica_sizes(5, 2) == [3, 2], f"expected torch.tensor_split's [3, 2], got {replica_sizes(5, 2)}"
    assert default_microbatches(8, MeshShape(dp=2, pp=2)) == 2
    assert default_microbatches(6, MeshShape(dp=2, pp=2)) == 1, "3 rows per replica do not split in 2 microbatches"


def test_split_stages_pass_on_what_later_stages_read() -> None:
    """pp=4 over 4 layers (no process group): each stage takes exactly the previous stage's outputs (the mask
    and rotary cos/sin made before the layers are passed on by stages 1 and 2), holds the model's own
    parameters of its layers under their FQNs, and the chained stages give the model's logits in its output
    type; split points out of order are a clear error."""
    import torch
    import torch.utils._pytree as pytree

    model, args, kwargs = tiny_llama(**TINY, layers=4)
    split = split_stages(model, [f"model.layers.{i}" for i in (1, 2, 3)], args, kwargs)
    assert split.first_inputs == ("input_ids",) and split.constants == {"use_cache": False}, (
        f"got first inputs {split.first_inputs}, constants {split.constants}")
    for index in range(1, 4):
        given, taken = split.outputs[index - 1], split.inputs[index]
        assert len(given) == len(taken) == 4 and all(a is b for a, b in zip(given, taken)), (
            f"stage {index} must take stage {index - 1}'s 4 outputs (mask, cos, sin, hidden), got "
            f"{[tuple(t.shape) for t in taken]} from {[tuple(t.shape) for t in given]}")
    names = [sorted({name.split(".")[2] for name, _ in module.named_parameters() if name.startswith("model.layers.")})
             for module in split.modules]
    assert names == [["0"], ["1"], ["2"], ["3"]], f"expected one layer's parameters per stage, got {names}"
    own = split.modules[2].get_parameter("model.layers.2.mlp.up_proj.weight")
    assert own is model.model.layers[2].mlp.up_proj.weight, "a stage must hold the model's own parameter"
    out = pytree.tree_unflatten(list(split.outputs[-1]), split.out_spec)
    with torch.no_grad():
        reference = model(*args, **kwargs)
    assert type(out) is type(reference), f"expected {type(reference).__name__}, got {type(out).__name__}"
    assert torch.equal(out.logits, reference.logits), "the chained stages' logits differ from the model's"
    with pytest.raises(ValueError, match=r"runs 'model.layers.1' \(where stage 2 begins\) before 'model.layers.2'"):
        split_stages(model, ["model.layers.2", "model.layers.1"], args, kwargs)


def _run_meshes(rank: int, world_size: int, cases: list[tuple[tuple[int, ...], tuple[str, ...], int, dict]],
                checkpoint: str | None = None, ranks_per_host: int | None = None) -> list:
    """Each case: build the mesh, compile tiny Llama on it, compare with the single-process model. With
    ``checkpoint``, the first two cases compile a meta-device copy that reads its shards from that file; with
    ``ranks_per_host``, the ranks are told they run on hosts of that many, as torchrun tells them (the front door
    reads it: docs/hosts.md)."""
    import os

    launch = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % (ranks_per_host or 1)),
              "LOCAL_WORLD_SIZE": str(ranks_per_host)}
    before = {name: os.environ.get(name) for name in launch}
    if ranks_per_host:
        os.environ.update(launch)
    try:
        return _compare_meshes(cases, checkpoint)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _compare_meshes(cases: list[tuple[tuple[int, ...], tuple[str, ...], int, dict]], checkpoint: str | None) -> list:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.planning.even_stages import even_parallel_plan
    from autotp.runtime.mesh.mesh_module import mesh_shape_of

    results = []
    for index, (dims, names, batch, plan_options) in enumerate(cases):
        layers = max(2, dict(zip(names, dims)).get("pp", 1))  # a layer block per pipeline stage at least
        model, args, kwargs = tiny_llama(**TINY, layers=layers, batch=batch)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        plan = plan_options if isinstance(plan_options, ParallelPlan) else (
            even_parallel_plan(model, mesh_shape_of(mesh), **plan_options) if plan_options else None)
        read = checkpoint if index < 2 else None
        compiled = tiny_llama(**TINY, layers=layers, batch=batch, device="meta")[0] if read else model
        part = autotp.compile_mesh(compiled, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan,
                                   checkpoint=read)
        with torch.no_grad():
            out, ref = part(*args, **kwargs), model(*args, **kwargs)
        results.append((type(out).__name__, tuple(out.logits.shape), float((out.logits - ref.logits).abs().max())))
    return results


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    """Each bad input's error text on this rank (every rank must raise, none may hang)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import autotp
    from autotp.planning.even_stages import even_parallel_plan

    model, args, kwargs = tiny_llama(**TINY, layers=2, batch=4)
    attempts: list[Any] = [
        lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp")),
        lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)),
        lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        lambda: DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",)),
        lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")),
        lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
    ]
    messages = []
    for index, make in enumerate(attempts):
        mesh = make()
        plan = even_parallel_plan(model, MeshShape(pp=2, tp=2)) if index == 2 else None
        if index == 5 and rank == 3:  # one rank alone passes another schedule
            plan = even_parallel_plan(model, MeshShape(dp=2, tp=2), schedule="1f1b")
        ids = args[0][:3] if index == 4 else args[0][:1] if index == 6 else args[0]  # 3 rows do not split over 2
        extra: dict[str, Any] = {}
        if index == 6:  # generation: one row for 2 replicas
            kwargs, extra = {}, {"max_cache_len": 16}
        try:
            autotp.compile_mesh(model, mesh, example_inputs=(ids,), example_kwargs=kwargs, plan=plan, **extra)
        except (ValueError, autotp.AgreementError) as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


def _planned_pipeline(shape: MeshShape, batch: int, microbatches: int, schedule: str) -> ParallelPlan:
    """A ParallelPlan whose stages carry tensor-parallel plans made here (one process, no process group)
    on the stage graphs split_stages gives, as a mesh search would hand them to the runtime."""
    import dataclasses

    import autotp

    model, args, kwargs = tiny_llama(**TINY, layers=2, batch=batch)
    plan = even_parallel_plan(model, shape, microbatches=microbatches, schedule=schedule)
    rows = batch // (shape.dp * microbatches)
    split = split_stages(model, plan.split_points, (args[0][:rows],), kwargs)
    stages = tuple(dataclasses.replace(stage, tp_plan=autotp.plan(module, inputs, world_size=shape.tp))
                   for stage, module, inputs in zip(plan.stages, split.modules, split.inputs))
    return dataclasses.replace(plan, stages=stages)


def _searched_plan(shape: MeshShape, batch: int, *, microbatches: int) -> ParallelPlan:
    """The mesh search's ParallelPlan for ``shape`` (autotp.plan_mesh(mesh=...)), run with ``microbatches``."""
    import dataclasses

    import autotp

    model, args, kwargs = tiny_llama(**TINY, layers=2, batch=batch)
    plan = autotp.plan_mesh(model, args, kwargs, world_size=shape.world_size, mesh=shape)
    return dataclasses.replace(plan, microbatches=microbatches)


def test_mesh_outputs_equal_single_process_on_four_ranks(gloo: Any, tmp_path: Any) -> None:
    """dp2 x tp2 (uneven batch 3, planned on each tp group) and pp2 x tp2 (1F1B, 4 microbatches, each stage's tp
    plan made beforehand in this process), both compiling a meta model that reads its shards from a safetensors
    checkpoint; dp2 x pp2 (the mesh search's plan, GPipe, 2 microbatches) on 4 gloo processes: every rank
    returns the whole batch's logits, equal to one process's."""
    from safetensors.torch import save_file

    model, _, _ = tiny_llama(**TINY, layers=2)
    checkpoint = str(tmp_path / "model.safetensors")
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, checkpoint)
    cases = [((2, 2), ("dp", "tp"), 3, {}),
             ((2, 2), ("pp", "tp"), 4, _planned_pipeline(MeshShape(pp=2, tp=2), 4, 4, "1f1b")),
             ((2, 2), ("dp", "pp"), 4, _searched_plan(MeshShape(dp=2, pp=2), 4, microbatches=2))]
    results = gloo.run(4, _run_meshes, cases, checkpoint)
    for rank, per_case in enumerate(results):
        for (dims, names, batch, _), (kind, shape, error) in zip(cases, per_case):
            setup = " x ".join(f"{n}{d}" for n, d in zip(names, dims))
            assert kind == "CausalLMOutputWithPast", f"{setup} rank {rank}: expected the model's output type, got {kind}"
            assert shape == (batch, 8, 1000), f"{setup} rank {rank}: expected the whole batch's logits, got {shape}"
            assert error < 1e-5, f"{setup} rank {rank}: logits differ from one process by {error}"


def test_mesh_bad_input_fails_on_every_rank(gloo: Any) -> None:
    """4 ranks: unknown dim name, pp=4 over 2 layer blocks, a pp2 x tp2 plan on a dp2 x tp2 mesh, a mesh of 2
    of the 4 ranks, dp2 x pp2 with a batch of 3, rank 3 alone with another schedule, generation on dp2 with
    one example row: the same error, saying the fix, on every rank."""
    messages = gloo.run(4, _bad_inputs)
    expected = ["unknown dim name(s) 'sp'", "pp=4 pipeline stages need at least 4 layer blocks",
                "plan was made for a mesh dp1 x pp2 x tp2 but the given mesh is dp2 x pp1 x tp2",
                "holds 2 ranks but the process group has 4",
                "batch (3 rows) must split into dp=2 replicas x 1 microbatch(es) of equal rows; pass a batch that is "
                "a multiple of 2",
                "option schedule: ranks 0, 1, 2 gpipe; rank 3 1f1b",
                "example ids have 1 row(s) but the mesh has dp=2 replicas"]
    assert len(messages[0]) == len(expected), f"expected {len(expected)} errors, got {messages[0]}"
    for rank, texts in enumerate(messages):
        assert texts == messages[0], f"rank {rank} raised {texts}, rank 0 {messages[0]}"
        for text, wanted in zip(texts, expected):
            assert wanted in text, f"expected an error with {wanted!r}, got {text!r}"


class _BranchOnValues(torch.nn.Module):
    """Two linear blocks and a branch on a tensor's value, which ``torch.export`` cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 0:
                x = -x
        return x


def _pipeline_traces(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    """pp=2 over this pool's ranks: how many ``torch.export`` traces this rank made for two compiles of tiny Llama
    through the trace cache ``cache`` and for a model that cannot be traced, the outputs' difference from one
    process, and that model's error."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    model, args, kwargs = tiny_llama(**TINY, layers=2, batch=4)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    exports: list[int] = []
    export = torch.export.export

    @functools.wraps(export)
    def counted(*a: Any, **k: Any) -> Any:
        exports[-1] += 1
        return export(*a, **k)

    torch.export.export = counted
    errors = []
    try:
        for _ in range(2):
            exports.append(0)
            part = autotp.compile_mesh(model, mesh, example_inputs=args, example_kwargs=kwargs,
                                       runtime=autotp.RuntimeOptions(trace_cache=cache))
        with torch.no_grad():
            diff = float((part(*args, **kwargs).logits - model(*args, **kwargs).logits).abs().max())
        exports.append(0)
        try:
            autotp.compile_mesh(_BranchOnValues(), mesh, example_inputs=(torch.randn(4, 8),))
        except ValueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        torch.export.export = export
    return {"exports": exports, "diff": diff, "errors": errors}


def test_pipeline_split_is_traced_once_for_the_mesh(gloo: Any, tmp_path: Any) -> None:
    """pp=2 on 2 gloo ranks: the whole-model trace the stages are cut from is made on rank 0 alone and rebuilt on
    rank 1, and a second compile through the same trace cache traces on no rank; the logits equal one process's;
    a model ``torch.export`` cannot trace (traced on rank 0 alone too) raises the same ValueError, saying the fix,
    on both ranks."""
    results = gloo.run(2, _pipeline_traces, str(tmp_path / "trace-cache"))
    assert [r["exports"] for r in results] == [[1, 0, 1], [0, 0, 0]], (
        "expected traces on rank 0 alone, none for the second compile of the same model, got exports per compile by "
        f"rank: {[r['exports'] for r in results]}")
    for rank, result in enumerate(results):
        assert result["diff"] < 1e-5, f"rank {rank}: logits differ from one process by {result['diff']}"
        assert len(result["errors"]) == 1 and "the pipeline stages are cut from one torch.export trace" in result["errors"][0], (
            f"rank {rank}: expected the split's ValueError, got {result['errors']}")
        assert result["errors"] == results[0]["errors"], f"rank {rank} raised {result['errors']}, rank 0 {results[0]['errors']}"


def test_mesh_dp_pp_tp_on_eight_ranks(gloo: Any) -> None:
    """dp2 x pp2 x tp2 on 8 gloo processes (GPipe, default 2 microbatches) told by the launcher's variables that
    they run on 4 hosts of 2: whole-batch logits on every rank. Each replica's last stage is on another host than
    its first, so the batch gathered by the last stages is handed out along a tree that forwards it (source ->
    first stage's first tp rank on the other host -> its tp peer)."""
    results = gloo.run(8, _run_meshes, [((2, 2, 2), ("dp", "pp", "tp"), 4, {})], None, 2)
    for rank, [(kind, shape, error)] in enumerate(results):
        assert shape == (4, 8, 1000), f"rank {rank}: expected the whole batch's logits (4, 8, 1000), got {shape}"
        assert error < 1e-5, f"rank {rank}: logits differ from one process by {error} ({kind})"


def test_pipeline_output_reaches_ranks_on_hosts_of_one(gloo: Any) -> None:
    """pp4 on 4 ranks, each told it is a host of its own: the last stage's logits reach the 3 other hosts along a
    binomial tree over the hosts (3 -> 0, then 3 -> 1 and 0 -> 2), equal to one process's on every rank."""
    results = gloo.run(4, _run_meshes, [((4,), ("pp",), 2, {})], None, 1)
    for rank, [(kind, shape, error)] in enumerate(results):
        assert shape == (2, 8, 1000), f"rank {rank}: expected the whole batch's logits (2, 8, 1000), got {shape}"
        assert error < 1e-5, f"rank {rank}: logits differ from one process by {error} ({kind})"


def test_demo_mesh_argument() -> None:
    """`autotp demo --mesh dp2,pp2,tp2` parses to named sizes; a bad item is an argparse error naming the fix."""
    import argparse

    from autotp.cli.main import build_parser
    from autotp.cli.mesh_demo import mesh_spec

    args = build_parser().parse_args(["demo", "--mesh", "dp2,pp2,tp2"])
    assert args.mesh == (("dp", 2), ("pp", 2), ("tp", 2)), f"got {args.mesh}"
    for bad, why in [("dp2,xp2", "not a dim name"), ("tp2,tp2", "names tp twice"), ("pp0", "size >= 1")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            mesh_spec(bad)


def _hand_out_cases(rank: int, world_size: int) -> list[list[Any]]:
    """``hand_out`` from rank 3 to the 4 ranks on 2 hosts of 2 (3 -> 0 across, 3 -> 2 and 0 -> 1 inside): leaves its
    int64 header describes (two float tensors, an int one, a bool one), then leaves that go as an object (a value
    beside a tensor; a tensor of 9 dims)."""
    import torch

    from autotp.cost_model.collectives import host_tree_children
    from autotp.runtime.mesh.mesh_module import hand_out

    tree = host_tree_children([0, 1, 2, 3], 3, {0: 0, 1: 0, 2: 1, 3: 1})

    cases = [[torch.arange(6.0).reshape(2, 3), torch.ones(1, 2, dtype=torch.bfloat16), torch.tensor([7]),
              torch.tensor([True, False])],
             [torch.full((2,), 5.0), "a value", None],
             [torch.zeros([1] * 9)]]
    got = []
    for leaves in cases:
        received = hand_out(leaves if rank == 3 else None, 3, tree, torch.device("cpu"))
        got.append([(tuple(v.shape), str(v.dtype), v.tolist()) if isinstance(v, torch.Tensor) else v for v in received])
    return got


def test_hand_out_carries_every_kind_of_leaf(gloo: Any) -> None:
    """Every rank receives the source's leaves as they were: shapes, dtypes and values, non-tensor leaves too."""
    results = gloo.run(4, _hand_out_cases)
    for rank, got in enumerate(results):
        assert got == results[3], f"rank {rank}: expected the source's leaves {results[3]}, got {got}"
    first, second, third = results[3]
    assert first[1] == ((1, 2), "torch.bfloat16", [[1.0, 1.0]]) and first[3] == ((2,), "torch.bool", [True, False])
    assert second[1:] == ["a value", None] and third[0][0] == (1,) * 9, (second, third)
