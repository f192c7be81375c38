"""Shared fixtures. ``gloo``: the session's pool of real gloo worker processes (see distributed.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import distributed
import pytest


class GlooRunner:
    """What the ``gloo`` fixture returns: ``gloo.run(world_size, fn, *args, **kwargs)``."""

    def run(self, world_size: int, fn: Callable[..., Any], /, *args: Any,
            timeout_s: float = distributed.DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank."""
        return distributed.run_on_ranks(world_size, fn, *args, timeout_s=timeout_s, **kwargs)

    def pids(self, world_size: int) -> list[int]:
        """Process ids of the workers of that world size (spawning them if needed)."""
        return list(distributed.pool_for(world_size).pids)


@pytest.fixture(scope="session")
def gloo() -> Iterator[GlooRunner]:
    """Real multi-process gloo process groups, spawned once per world size and shared by all tests."""
    yield GlooRunner()
    distributed.shutdown_all()
