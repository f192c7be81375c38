"""Shared fixtures and the test tiers.

Tiers (pytest markers, registered in pyproject.toml):

* no marker: unit tests (rules, costs, plans) and planning/rewrite tests on fake tensors or a
  fake process group. ``python -m pytest -m "not distributed and not slow"`` (the fast tier)
  runs them; keep them cheap, or mark a test that takes seconds ``@pytest.mark.slow``.
* ``distributed``: the test starts real gloo worker processes. A test is marked automatically
  when it asks for a fixture in :data:`PROCESS_FIXTURES` (``gloo``: the session's shared pool of
  workers, see distributed.py); a test that calls ``distributed.run_on_ranks`` directly carries
  an explicit ``@pytest.mark.distributed``. An unmarked test that tries to start or use a worker
  pool fails with a message saying which marker to add, so the fast tier never spawns processes.
* ``slow``: a non-distributed test too slow for the fast tier (each carries its reason).
* ``cluster``: hosts on one machine as network namespaces with shaped links (tests/cluster.py); also
  ``distributed``; each test skips, naming why, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import distributed
import pytest

# from_pretrained and load keep traced programs in a cache directory (autotp/capture/trace_cache.py): the
# suite's go to a fresh directory of its own (worker processes inherit it), never to ~/.cache
if "AUTOTP_TEST_CACHE_DIR" not in os.environ:
    os.environ["AUTOTP_TEST_CACHE_DIR"] = os.environ["AUTOTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="autotp-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOTP_TEST_CACHE_DIR"], ignore_errors=True)

# Inductor compiles its kernels in this process, not in a pool of compile workers (on 2 cores it would start
# one pool per process that compiles: 2 more Pythons importing torch, about 13 s of a first compile's 15 s here,
# for kernels it then compiles no faster). The kernels are the same. Set before torch reads it (the gloo workers'
# fork server and the fresh ranks of failing_ranks.py inherit it).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

PROCESS_FIXTURES = frozenset({"gloo", "private_pools"})
"""Fixtures that start real gloo worker processes; a test using any of them is ``distributed``."""


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


@pytest.fixture(scope="session")
def trace_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A trace cache directory (autotp/capture/trace_cache.py) for the tests of this session (of this xdist worker)
    that compile one model at several world sizes or with several plan options: ``torch.export`` makes the same
    program for each (a trace depends on the model and its inputs, not on the world size or the options), so the
    first compile traces it and the others rebuild it (``RuntimeOptions(trace_cache=trace_cache)``), as
    ``autotp.from_pretrained`` does for a user. Tracing is most of a tiny model's compile (a 2-layer Llama:
    about 3 s of one core against 0.3 s to rebuild); what those tests check, the plan at each world size and
    the outputs, is the same. A test that checks the tracing itself (stamping, the shared trace) traces."""
    return str(tmp_path_factory.mktemp("trace-cache"))


LONG_FILES = ("test_mesh_grid.py", "test_releases.py", "test_runtime_modes.py", "test_equivalence.py",
              "test_generate.py", "test_agreement.py", "test_agreement_exit.py", "test_loading_memory.py",
              "test_quantized.py", "test_hf_calls.py", "test_mesh_runtime.py", "test_training.py",
              "test_empty_shards.py", "test_own_state.py", "test_expert_placement.py",
              "test_checkpoint_generation.py", "test_peer_failure.py", "test_quantized_checkpoints.py")
"""The files that take longest (``--durations`` of the whole suite on 2 cores), longest first: they are
collected first, so that ``pytest -n 3 --dist loadfile`` (.ci/run) hands them out before the short
files, which then fill the workers' time instead of one long file starting last and running alone. The last
three hold one test of about a minute each under the suite's load (fresh processes, or checkpoints written and
read at several world sizes); by name they would go out among the short files. The docs' examples and the cluster
run as tiers of their own (.ci/run), not among these."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a process-starting fixture as ``distributed``; put :data:`LONG_FILES` first."""
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)
    rank = {name: position for position, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: files keep their own order


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a test without the ``distributed`` marker, using a gloo worker pool is an error that says the fix."""
    if request.node.get_closest_marker("distributed") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{request.node.nodeid} uses gloo worker processes but is not marked distributed, so it would "
            f"run in the fast tier (pytest -m 'not distributed'); add @pytest.mark.distributed to it, or "
            f"take the 'gloo' fixture, which marks it automatically")

    monkeypatch.setattr(distributed.GlooPool, "__init__", refuse)
    monkeypatch.setattr(distributed.GlooPool, "run_pickled", refuse)
