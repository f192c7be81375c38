"""One zoo model on one rank, the way a user calls autotp: what the zoo test asserts and the zoo benchmark prints.

:func:`run_zoo_model` runs inside a gloo worker (``distributed.run_on_ranks(world_size, run_zoo_model, name)``):
``autotp.compile(model, example_inputs=args, example_kwargs=kwargs)`` with every default, ``tp(*args)``
compared with the single-process model, and for a causal LM ``tp.generate(ids, max_new_tokens=N)`` compared
with ``model.generate(ids, do_sample=False, max_new_tokens=N)`` (or the error a refused family raises). It returns figures, never raises for a
wrong answer (the caller decides), and returns the error text of a compile or call that raises.
"""

from __future__ import annotations

import collections
import math
import time
import traceback
import warnings
from typing import Any

__all__ = ["NEW_TOKENS", "TOLERANCE", "run_zoo_model", "zoo_builders"]

TOLERANCE = 1e-4
"""Max abs difference of float32 outputs accepted as equal."""

NEW_TOKENS = 6


def zoo_builders() -> dict[str, Any]:
    """Name -> (builder, generation expected: ``"equal"``, ``"refused"`` or None) for every model the zoo knows:
    the wide zoo and the project's test families."""
    from models import BUILDERS
    from odd_models import ODD_BUILDERS
    from zoo_models import ZOO

    found: dict[str, Any] = {name: (build, None) for name, build in {**BUILDERS, **ODD_BUILDERS}.items()}
    found.update({name: (entry.build, entry.generation) for name, entry in ZOO.items()})
    return found


def _max_error(expected: Any, got: Any) -> float:
    import torch
    import torch.utils._pytree as pytree

    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if expected_spec != got_spec:
        return math.inf  # another structure than the model returns
    errors = [0.0]
    for e, g in zip(expected_leaves, got_leaves):
        if isinstance(e, torch.Tensor):
            errors.append((e.float() - g.float()).abs().max().item() if e.numel() else 0.0)
        elif e != g:
            return math.inf
    return max(errors)


def _figures(tp_model: Any, model: Any) -> dict[str, Any]:
    """Collectives per layer, fallback ops and the parameter bytes this rank holds (see benchmarks/zoo.py)."""
    from autotp.base.module_paths import block_name
    from autotp.base.placements import placement_from_str, split_of
    from autotp.passes.resharding import is_collective_step

    plan = tp_model.plan
    per_layer: collections.Counter[str] = collections.Counter()
    outside = 0
    for collective in plan.collectives:
        if not any(is_collective_step(step) for step in collective.steps):
            continue
        layer = block_name(collective.module)
        if layer is None:
            outside += 1
        else:
            per_layer[layer] += 1
    layers = {block_name(n.module) for n in plan.nodes if block_name(n.module)}
    read = {p for n in plan.nodes for p in n.input_nodes}  # a tied weight's second name is never read
    read_fqns = {n.target for n in plan.nodes if n.op == "placeholder" and n.name in read}
    full = dict(model.named_parameters(remove_duplicate=False))
    local = tp_model.local_state()
    held = full_bytes = split_full = split_local = 0
    for fqn, placement in plan.parameters.items():
        if fqn not in read_fqns or fqn not in full or fqn not in local:
            continue
        whole = full[fqn].numel() * full[fqn].element_size()
        mine = local[fqn].numel() * local[fqn].element_size()
        full_bytes += whole
        held += mine
        if split_of(placement_from_str(placement)) is not None:
            split_full += whole
            split_local += mine
    return {
        "per_layer_max": max((per_layer.get(layer, 0) for layer in layers), default=0),
        "outside": outside,
        "fallback": list(plan.fallback_ops),
        "bytes": held,
        "full_bytes": full_bytes,
        "split_share": split_local / split_full if split_full else math.nan,
    }


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def run_zoo_model(rank: int, world_size: int, name: str, *, generate: bool = True) -> dict[str, Any]:
    """Compile zoo model ``name`` on this rank and compare with the single-process model; see the module docstring."""
    import torch

    import autotp

    build, generation = zoo_builders()[name]
    model, args, kwargs = build()
    result: dict[str, Any] = {"name": name, "rank": rank, "error": math.nan, "tokens_equal": None,
                              "distinct_tokens": 0, "failure": None, "generation_failure": None}
    with torch.no_grad():
        expected = model(*args, **kwargs)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp_model = autotp.compile(model, example_inputs=args, example_kwargs=kwargs)
            result["compile_s"] = time.perf_counter() - started
            with torch.no_grad():
                result["error"] = _max_error(expected, tp_model(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - reported, as every rank's
        result["failure"] = _error(exc)
        result["traceback"] = traceback.format_exc()[-3000:]
        return result
    result.update(_figures(tp_model, model))
    if generate and generation is not None:
        (ids,) = args
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reference = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
                tokens = tp_model.generate(ids, max_new_tokens=NEW_TOKENS)
            result["tokens_equal"] = bool(torch.equal(tokens, reference))
            result["distinct_tokens"] = int(reference[:, ids.shape[1]:].unique().numel())
        except Exception as exc:  # noqa: BLE001 - reported, as every rank's
            result["generation_failure"] = _error(exc)
            result["traceback"] = traceback.format_exc()[-3000:]
    return result
