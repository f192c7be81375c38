"""Plans kept in the trace cache: the plan made for a traced graph is stored beside its program
(:meth:`autotp.capture.trace_cache.TraceCache.plan_path`: the plan's JSON, sealed with a digest of itself and its key)
and reused by the first rank (:func:`autotp.runtime.agreement.group.plan_on_first_rank`).

A plan read back under its seal is the planner's own output for a graph of the same fingerprint, under the same
options and the same code (the key names all of them): it is checked against the graph's nodes and fingerprint
only. A plan whose seal does not match (edited, or written otherwise) passes every check a given ``plan=`` does,
which rebuilds the graph's strategies (about a second for a 16-layer model).

The trace cache stores bytes and knows no plan; reading one back, checking it against the graph and
naming it by the graph and the options is planning's, here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import autotp.cost_model
import autotp.passes
from autotp.capture.trace_cache import FORMAT, TraceCache, file_digest
from autotp.planning.checks import check_plan_applies
from autotp.planning.plan import Plan, graph_fingerprint

if TYPE_CHECKING:
    from autotp.capture.tracing import CapturedGraph
    from autotp.planning.options import PlanOptions

__all__ = ["cached_plan", "plan_key", "store_plan"]


def plan_key(captured: CapturedGraph, options: PlanOptions) -> str | None:
    """The SHA-256 naming the plan of ``captured`` under ``options``: the graph's fingerprint (names, ops,
    shapes), the options (``progress`` aside; a hardware profile file by its contents), torch's
    version and the contents of every autotp source file (the planner's code: :func:`_source_digest`).

    None (nothing to cache under) when the options hold a strategy filter whose code is not autotp's own
    module-level function: a user's function or a closure has no name that stays the same across processes
    and changes with its code, so a plan made under it is never read back."""
    memo: dict[str, str] = {}
    narrow = options.strategy_filter
    filter_name = "" if narrow is None else _autotp_function_name(narrow)
    if filter_name is None:
        return None
    options = dataclasses.replace(options, progress=False, strategy_filter=None)
    hardware = options.hardware
    profile = file_digest(hardware, memo) if isinstance(hardware, (str, os.PathLike)) and os.path.isfile(hardware) else ""
    text = json.dumps([FORMAT, graph_fingerprint(captured.graph_module), repr(options), filter_name, profile,
                       torch.__version__, _source_digest()])
    return hashlib.sha256(text.encode()).hexdigest()


def _source_digest() -> str:
    """SHA-256 of every ``.py`` file of autotp, ``autotp.passes`` (the sharding rules, costing) and ``autotp.cost_model``
    (pricing) included: from a checkout those two are mapped from folders beside ``autotp/`` (``pyproject.toml``),
    installed they lie inside it (hashed once)."""
    roots = [Path(__file__).parents[1], Path(autotp.passes.__file__).parent, Path(autotp.cost_model.__file__).parent]
    sources = hashlib.sha256()
    for root in roots:
        if root != roots[0] and root.is_relative_to(roots[0]):
            continue
        for file in sorted(root.rglob("*.py")):
            sources.update(f"{root.name}/{file.relative_to(root)}".encode())
            sources.update(file.read_bytes())
    return sources.hexdigest()


def _autotp_function_name(function: object) -> str | None:
    """``module.name`` of a module-level function of autotp (its code is in the sources the key hashes), else
    None."""
    module = getattr(function, "__module__", None) or ""
    qualname = getattr(function, "__qualname__", None) or "<"
    if not module.startswith("autotp.") or "<" in qualname or "." in qualname:
        return None
    return f"{module}.{qualname}"


def cached_plan(cache: TraceCache, key: str, captured: CapturedGraph, world_size: int) -> Plan | None:
    """The plan stored under ``key`` if it applies to ``captured`` (under its seal: the graph's nodes and
    fingerprint; else checked as a given ``plan=`` is), else None; a stored plan that does not read or apply is
    ignored with a warning."""
    path = cache.plan_path(key)
    if not path.is_file():
        return None
    try:
        text, sealed = _unseal(key, path.read_text())
        plan = Plan.from_json(text, source=str(path))
        if sealed:
            plan.check_matches(captured.graph_module, world_size)
        else:
            check_plan_applies(plan, captured, world_size)
    except Exception as exc:  # noqa: BLE001 - any failure means: plan again
        warnings.warn(f"autotp: ignoring the cached plan {path} ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); planning again", stacklevel=3)
        return None
    if plan.fallback_ops:  # the warning planning gives
        warnings.warn(f"autotp: ops without a sharding rule run replicated: {', '.join(plan.fallback_ops)} "
                      "(see plan.fallback_ops; strict=True makes this an error)", stacklevel=3)
    return plan


def store_plan(cache: TraceCache, key: str, plan: Plan) -> None:
    """Store ``plan`` under ``key``, sealed (atomically); a failure to write only warns. Only the planner's own
    plans are stored (:func:`autotp.runtime.agreement.group.plan_on_first_rank`)."""
    text = plan.to_json(indent=None)
    cache.write_plan_text(key, json.dumps({"seal": _seal(key, text), "plan": text}))


def _seal(key: str, text: str) -> str:
    """SHA-256 of a plan's JSON ``text`` and the ``key`` it is stored under."""
    return hashlib.sha256(f"{key}\n{text}".encode()).hexdigest()


def _unseal(key: str, stored: str) -> tuple[str, bool]:
    """``(the plan's JSON, whether its seal matches)`` of a stored plan; text that is not a sealed plan is returned
    as it is, unsealed."""
    try:
        data = json.loads(stored)
    except ValueError:
        return stored, False
    if isinstance(data, dict) and set(data) == {"seal", "plan"} and isinstance(data["plan"], str):
        return data["plan"], data["seal"] == _seal(key, data["plan"])
    return stored, False
