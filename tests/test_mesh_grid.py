"""Every dp x pp x tp factorisation of 4 ranks, against the single-process model.

The grid: meshes 1x1x4, 1x4x1, 4x1x1, 2x2x1, 2x1x2, 1x2x2 (dp x pp x tp) x tiny Llama of 2 and 4
layers x example batch 1, 2 and 4 x without a plan (the default) and with the plan the default
call applied passed back in (each stage's tensor-parallel plan filled in). Each compiled model is
called with its example batch and with batches 1 and 4: every call returns the whole batch's
logits equal to one process's, or raises a clear error on every rank before any work (a mesh
the model or batch does not fit at compile, a batch a pipeline was not compiled for at the call).
One pool call per mesh walks its models and batches inside the workers and returns a table. The walks
share one trace cache (a directory for this file): the compile with the plan passed back, and a mesh
that traces the same model at the same rows as an earlier one, rebuild the program ``torch.export`` made
instead of tracing again (the same program: what the grid checks is the plan and the outputs).
"""

from __future__ import annotations

from typing import Any

import pytest
from models import tiny_llama

TINY = {"num_heads": 4, "num_kv_heads": 2, "hidden": 64, "intermediate": 128, "seq_len": 8}
MESHES = [(1, 1, 4), (1, 4, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
"""(dp, pp, tp) of 4 ranks."""
LAYERS = (2, 4)
BATCHES = (1, 2, 4)
CALL_BATCHES = (1, 2, 4)

Row = tuple[int, int, str, "int | None", str, Any]
"""(layers, example batch, "default" or "plan", call batch or None for the compile, outcome, detail):
outcome "ok" with the largest logit difference from one process, or an error's type with its text."""


def _mesh(dims: tuple[int, int, int]) -> Any:
    """The mesh a user builds for ``dims``: only the dims larger than 1, named."""
    from torch.distributed.device_mesh import init_device_mesh

    named = [(name, size) for name, size in zip(("dp", "pp", "tp"), dims) if size > 1]
    return init_device_mesh("cpu", tuple(size for _, size in named), mesh_dim_names=tuple(name for name, _ in named))


def _plan_applied(part: Any) -> Any:
    """The ParallelPlan ``part`` runs, with every stage's tensor-parallel plan (gathered from the ranks)."""
    import dataclasses

    import torch.distributed as dist

    own = getattr(part.stage_module, "plan", None) if part.plan.mesh.tp > 1 else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (part.stage_index, own))
    by_stage: dict[int, Any] = {}
    for stage_index, tp_plan in every:
        by_stage.setdefault(stage_index, tp_plan)
    stages = tuple(dataclasses.replace(stage, tp_plan=by_stage[index]) for index, stage in enumerate(part.plan.stages))
    return dataclasses.replace(part.plan, stages=stages)


def _walk(rank: int, world_size: int, dims: tuple[int, int, int], trace_cache: str) -> list[Row]:
    """This rank's table for one mesh (see :data:`Row`); programs traced through ``trace_cache`` (a directory)."""
    import torch

    import autotp
    from autotp.base.errors import InputShapeError

    mesh = _mesh(dims)
    runtime = autotp.RuntimeOptions(trace_cache=trace_cache)
    rows: list[Row] = []
    for layers in LAYERS:
        references = {}
        for batch in CALL_BATCHES:
            model, args, kwargs = tiny_llama(**TINY, layers=layers, batch=batch)
            with torch.no_grad():
                references[batch] = (args, kwargs, model(*args, **kwargs).logits)
        for batch in BATCHES:
            plan = None
            for mode in ("default", "plan"):
                if mode == "plan" and plan is None:
                    continue  # the default call failed: there is no plan to pass back
                args, kwargs, _ = references[batch]
                try:
                    part = autotp.compile_mesh(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan,
                                              runtime=runtime)
                except (ValueError, autotp.AgreementError) as exc:
                    rows.append((layers, batch, mode, None, type(exc).__name__, str(exc)))
                    continue
                rows.append((layers, batch, mode, None, "ok", 0.0))
                for call in CALL_BATCHES:
                    call_args, call_kwargs, expected = references[call]
                    try:
                        with torch.no_grad():
                            out = part(*call_args, **call_kwargs)
                    except InputShapeError as exc:
                        rows.append((layers, batch, mode, call, type(exc).__name__, str(exc)))
                        continue
                    if type(out).__name__ != "CausalLMOutputWithPast" or out.logits.shape != expected.shape:
                        rows.append((layers, batch, mode, call, "wrong", (type(out).__name__, tuple(out.logits.shape))))
                        continue
                    rows.append((layers, batch, mode, call, "ok", float((out.logits - expected).abs().max())))
                if mode == "default":
                    plan = _plan_applied(part)
    return rows


def _expected_error(dims: tuple[int, int, int], layers: int, batch: int, call: int | None) -> str | None:
    """The text the clear error must contain, or None where the outputs must equal one process's."""
    dp, pp, _ = dims
    if pp > layers:
        return f"pp={pp} pipeline stages need at least {pp} layer blocks"
    if batch < dp:
        return f"must have at least dp={dp} rows"
    if call is None:
        return None
    if pp > 1 and call != batch:
        return f"a pipeline over pp={pp} stages runs the shapes it was compiled for"
    if call < dp:
        return f"must have at least dp={dp} rows"
    if batch == 1 and call != 1 and dp * pp == 1:  # export specialises size 1; tp compiles that graph
        return "traced with size 1 there and that dim is static: torch.export specialises"
    return None


def _show(dims: tuple[int, int, int], table: list[Row]) -> str:
    """The table, one row a line, for assertion messages."""
    return "\n".join(f"  {'x'.join(map(str, dims))} layers={layers} batch={batch} {mode} "
                     f"{'compile' if call is None else f'call {call}'}: {outcome} {str(detail)[:90]}"
                     for layers, batch, mode, call, outcome, detail in table)


@pytest.fixture(scope="module")
def trace_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One trace cache directory for every mesh of this file."""
    return str(tmp_path_factory.mktemp("mesh-grid-trace-cache"))


@pytest.mark.parametrize("dims", MESHES, ids=["x".join(map(str, dims)) for dims in MESHES])
def test_mesh_grid(gloo: Any, dims: tuple[int, int, int], trace_cache: str) -> None:
    """dp x pp x tp on 4 gloo ranks (each of the six factorisations): for tiny Llama of 2 and 4 layers,
    example batches 1, 2, 4, no plan and the applied plan passed back, calls of batch 1, 2, 4: the whole
    batch's logits equal to one process's on every rank, or the same clear error on every rank where the
    grid says one is due (pp above the layer count, fewer rows than dp, another batch through a pipeline)."""
    tables = gloo.run(4, _walk, dims, trace_cache, timeout_s=600)
    compiles = [(layers, batch) for layers in LAYERS for batch in BATCHES]
    fit = sum(_expected_error(dims, layers, batch, None) is None for layers, batch in compiles)
    expected_rows = fit * 2 * (1 + len(CALL_BATCHES)) + len(compiles) - fit
    for rank, table in enumerate(tables):
        assert len(table) == expected_rows, f"rank {rank}: expected {expected_rows} rows, got\n{_show(dims, table)}"
        errors = [row for row in table if row[4] != "ok"]
        assert errors == [row for row in tables[0] if row[4] != "ok"], (
            f"rank {rank} raised other errors than rank 0:\n{_show(dims, errors)}")
        for layers, batch, mode, call, outcome, detail in table:
            setup = f"{'x'.join(map(str, dims))} rank {rank}, {layers} layers, example batch {batch}, {mode}, " + (
                "compile" if call is None else f"call with batch {call}")
            wanted = _expected_error(dims, layers, batch, call)
            if wanted is None:
                assert outcome == "ok", f"{setup}: expected the single process's logits, got {outcome}: {detail}"
                assert detail < 1e-5, f"{setup}: logits differ from one process by {detail}"
            else:
                assert outcome in ("ValueError", "InputShapeError"), (
                    f"{setup}: expected an error with {wanted!r}, got {outcome}: {detail}")
                assert wanted in detail, f"{setup}: expected an error with {wanted!r}, got {detail!r}"
