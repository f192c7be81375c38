"""Tests of the shared gloo process pool itself (tests/distributed.py), tier (c): real processes."""

from __future__ import annotations

import os
import time

import distributed
import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_on_ranks


def _all_reduce_rank(rank: int, world_size: int, scale: float = 1.0) -> float:
    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)  # sum
    return value.item()


def _whoami(rank: int, world_size: int) -> tuple[int, int, int, int]:
    return rank, world_size, dist.get_rank(), os.getpid()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _raise_on_rank_1_before_collective(rank: int, world_size: int) -> float:
    if rank == 1:
        raise KeyError("rank 1 never reaches the all_reduce")
    value = torch.ones(1)
    dist.all_reduce(value)  # rank 0 waits here for rank 1 forever
    return value.item()


def _sleep(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_sums_ranks(gloo, world_size: int) -> None:
    """tp=2 and tp=3: all_reduce(sum) of each rank's id gives 0+1+...+(n-1) on every rank."""
    results = gloo.run(world_size, _all_reduce_rank, scale=2.0)
    expected = [2.0 * sum(range(world_size))] * world_size
    assert results == expected, f"expected {expected}, got {results}"


@pytest.mark.distributed
def test_results_are_ordered_by_rank_and_group_is_initialised() -> None:
    """tp=2, through run_on_ranks: fn gets (rank, world_size) matching the process group, results by rank."""
    results = run_on_ranks(2, _whoami)
    assert [r[:3] for r in results] == [(0, 2, 0), (1, 2, 1)], f"got {results}"


def test_pool_is_reused_across_calls(gloo) -> None:
    """tp=2: two calls run in the same worker processes (no respawn)."""
    first = [pid for *_, pid in gloo.run(2, _whoami)]
    second = [pid for *_, pid in gloo.run(2, _whoami)]
    assert first == second, f"expected the same worker pids, got {first} then {second}"
    assert first == gloo.pids(2), f"pool pids {gloo.pids(2)} differ from the workers' {first}"
    assert os.getpid() not in first, "fn must run in worker processes, not in the test process"


def test_exception_surfaces_with_rank_and_pool_survives(gloo) -> None:
    """tp=2: an exception on rank 1 is raised here naming rank 1, with the remote traceback."""
    pids_before = gloo.pids(2)
    with pytest.raises(RankError) as info:
        gloo.run(2, _raise_on_rank_1)
    error = info.value
    assert error.rank == 1, f"expected the failing rank 1, got {error.rank}"
    assert "rank 1 of 2 raised ValueError: boom on rank 1" in str(error), str(error)
    assert "_raise_on_rank_1" in error.remote_traceback, error.remote_traceback
    assert isinstance(error.__cause__, ValueError), f"cause: {error.__cause__!r}"
    # Rank 0 finished normally, so the pool stays usable as is.
    assert gloo.pids(2) == pids_before, "a failure that left no rank stuck must not respawn the pool"
    assert gloo.run(2, _all_reduce_rank) == [1.0, 1.0]


def test_unpicklable_function_is_rejected_before_dispatch(gloo) -> None:
    """No process group needed: a lambda cannot travel to the workers; the error says what to pass."""
    with pytest.raises(TypeError, match="top-level function"):
        gloo.run(2, lambda rank, world_size: rank)


class _FakePool:
    """Stands in for GlooPool in the LRU test: no processes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.alive = True

    def run_pickled(self, payload: bytes, name: str, *, timeout_s: float) -> list[int]:
        return list(range(self.world_size))

    def shutdown(self) -> None:
        self.alive = False


def test_least_recently_used_pool_is_shut_down() -> None:
    """No processes (fake pools): with max_pools=2, using tp=2, 3, 2, 4 shuts down the tp=3 pool."""
    manager = distributed.PoolManager(max_pools=2, pool_factory=_FakePool)
    pools = {ws: manager.pool(ws) for ws in (2, 3)}
    manager.run(2, _whoami)  # 2 becomes the most recently used
    pools[4] = manager.pool(4)
    assert manager.live_world_sizes() == [2, 4], f"expected [2, 4] alive, got {manager.live_world_sizes()}"
    assert not pools[3].alive, "the least recently used pool (tp=3) must have been shut down"
    assert manager.pool(2) is pools[2], "a live pool must be reused, not respawned"
    manager.shutdown_all()
    assert manager.live_world_sizes() == [] and not any(p.alive for p in pools.values())


# The two tests below break their pool on purpose. They use a private pool manager, so that the
# shared pools (and the tests in other files that use them) are not respawned because of them.

@pytest.fixture(scope="module")
def private_pools():
    manager = distributed.PoolManager(max_pools=1)
    yield manager
    manager.shutdown_all()


def test_stuck_ranks_after_a_failure_do_not_hang(private_pools, monkeypatch) -> None:
    """tp=2: rank 1 raises while rank 0 waits in all_reduce; the error surfaces, the pool is replaced."""
    monkeypatch.setattr(distributed, "_STRAGGLER_GRACE_S", 1.0)
    pids_before = private_pools.pool(2).pids
    with pytest.raises(RankError) as info:
        private_pools.run(2, _raise_on_rank_1_before_collective)
    assert info.value.rank == 1, f"expected rank 1, got {info.value.rank}"
    assert "KeyError" in str(info.value), str(info.value)
    assert private_pools.run(2, _all_reduce_rank) == [1.0, 1.0], "a fresh pool must work after the failure"
    assert private_pools.pool(2).pids != pids_before, "the pool with a stuck rank must have been replaced"


def test_timeout_raises_instead_of_hanging(private_pools) -> None:
    """tp=2: a task running past timeout_s raises TimeoutError promptly."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        private_pools.run(2, _sleep, 30.0, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 20.0, f"expected the timeout to fire after ~1 s, took {elapsed:.1f} s"


def test_unmarked_test_cannot_start_workers() -> None:
    """No processes (this test is not marked distributed): using a worker pool fails with the marker to add,
    so the fast tier (-m "not distributed") never spawns gloo workers by accident."""
    with pytest.raises(RuntimeError, match=r"not marked distributed.*@pytest.mark.distributed"):
        run_on_ranks(2, _whoami)
    with pytest.raises(RuntimeError, match="not marked distributed"):
        distributed.GlooPool(2)
