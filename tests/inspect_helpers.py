"""Plans of tiny models shared by the inspection tests (tests/test_inspect*.py, tests/test_cli*.py).

Planning a tiny Llama takes seconds on a 2-core machine, so each (model, world size, options)
plan is made once per test session and reused; plans are frozen values, so sharing is safe.
"""

from __future__ import annotations

import functools
import warnings

import models

import autotp
from autotp.plan import Plan

__all__ = ["tiny_plan"]


@functools.lru_cache(maxsize=16)
def tiny_plan(name: str = "llama", world_size: int = 4, *, layers: int = 2, memory_budget: object = "auto",
              constraints: tuple[tuple[str, str], ...] = ()) -> Plan:
    """The plan of ``models.BUILDERS[name]`` on the meta device (``constraints`` as sorted pairs)."""
    kwargs = {"layers": layers} if name != "mlp" else {}
    model, args, kw = models.BUILDERS[name](device="meta", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-op warning is tested elsewhere
        return autotp.plan(model, args, kw, world_size=world_size, memory_budget=memory_budget,
                           constraints=dict(constraints) or None)
