"""A shared pool of real gloo worker processes for multi-process tests.

Spawning a process and importing torch (and transformers) in it takes seconds on a 2-core
machine, so tests do not spawn their own processes. Instead, for each world size, one pool of
``world_size`` worker processes is spawned the first time it is needed and then reused by every
later test of the session:

    from distributed import run_on_ranks

    def _sum_of_ranks(rank: int, world_size: int, offset: float) -> float:
        t = torch.tensor([rank + offset])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce() -> None:
        assert run_on_ranks(2, _sum_of_ranks, 0.0) == [1.0, 1.0]

or through the ``gloo`` fixture of ``tests/conftest.py`` (``gloo.run(2, _sum_of_ranks, 0.0)``).

Each worker has called ``dist.init_process_group("gloo", ...)`` once, so inside ``fn`` the default
process group is ready (do not initialise or destroy it). Rules for ``fn``:

* it is a top-level (picklable) function; it is called as ``fn(rank, world_size, *args,
  **kwargs)`` on every rank, and its arguments and return value travel by ``pickle``;
* it should leave no global state behind (default dtype, grad mode, extra process groups are
  the worker's for the rest of the session);
* every rank must issue the same collectives in the same order, as in any distributed program.

Failures never hang the session:

* an exception on any rank is re-raised in the test as :class:`RankError`, naming the rank and
  carrying the remote traceback text (and the original exception as ``__cause__`` when it can be
  unpickled);
* if some ranks fail while the others do not finish (typically: stuck in a collective that the
  failed rank never reached), or a task runs past its timeout, or a worker process dies, the pool
  is shut down and the next call spawns a fresh one.

At most ``MAX_POOLS`` pools are alive at once (least recently used is shut down first); all
pools are shut down at the end of the pytest session (the ``gloo`` fixture) or at interpreter
exit.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_POOLS",
    "GlooPool",
    "PoolManager",
    "RankError",
    "WorkerDied",
    "run_on_ranks",
    "shutdown_all",
]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a task may run on the pool before :func:`run_on_ranks` raises ``TimeoutError``."""

MAX_POOLS = 2
"""Pools (world sizes) kept alive at once; the test machine has 2 cores."""

_START_TIMEOUT_S = 180.0  # spawning N processes that import torch, on 2 busy cores
_STRAGGLER_GRACE_S = 10.0  # after one rank failed, how long the others get to finish
_POLL_S = 0.2  # how often the parent checks that workers are alive while it waits


_PRELOADED = (
    "torch", "torch.distributed", "torch.export", "transformers", "transformers.modeling_utils",
    *(f"transformers.models.{name}.modeling_{name}" for name in ("llama", "gpt2", "bert", "mistral", "qwen2", "mixtral")),
    "autotp", "autotp.api", "autotp.runtime.generation.compile_for_generation",
)
"""Imported once by the fork server that starts the workers (see :func:`_worker_context`)."""


def _worker_context() -> Any:
    """Workers start from a fork server that has imported torch, transformers' common models and autotp
    once (``multiprocessing``'s forkserver): a worker forks from it instead of importing them anew,
    which costs about 5 CPU-seconds per worker on the 2-core test machine, paid by every pool. The
    server imports nothing else and runs no torch op, so a worker starts as clean as a spawned one
    (it inherits the environment of the moment the server started: the first pool of the session)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOADED))
    return context


class RankError(RuntimeError):
    """``fn`` raised on one or more ranks; ``rank`` is the lowest failing rank."""

    def __init__(self, rank: int, world_size: int, exc_type: str, exc_text: str, remote_traceback: str,
                 other_failures: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.other_failures = dict(other_failures or {})
        message = f"rank {rank} of {world_size} raised {exc_type}: {exc_text}"
        if self.other_failures:
            others = "; ".join(f"rank {r}: {text}" for r, text in sorted(self.other_failures.items()))
            message += f"\n(also failed: {others})"
        message += f"\n\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(message)


class WorkerDied(RuntimeError):
    """A worker process exited while it had a task (e.g. a segfault or ``os._exit``)."""


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", fn))


def _pickle_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"cannot send {_name_of(fn)!r} and its arguments to the workers: {exc}. "
            "Pass a top-level function (not a lambda or a nested function) and picklable arguments."
        ) from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_main(rank: int, world_size: int, init_method: str, pg_timeout_s: float,
                 task_queue: Any, result_queue: Any) -> None:
    """Entry point of one worker: join the process group once, then run tasks until told to stop."""
    # Ctrl-C in the terminal reaches the whole process group; the parent shuts workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # everything is on this machine

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
    except BaseException:  # noqa: BLE001 - reported to the parent, which retries or raises
        result_queue.put(("init_error", rank, traceback.format_exc()))
        return
    result_queue.put(("ready", rank, os.getpid()))

    parent = mp.parent_process()
    while True:
        try:
            message = task_queue.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                break  # orphaned: the test session died without shutting us down
            continue
        if message is None:
            break
        task_id, sys_path, payload = message
        for entry in sys_path:  # test modules imported after the pool was spawned
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(rank, world_size, *args, **kwargs)
            result_queue.put((task_id, rank, True, pickle.dumps(result)))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            try:
                exc_payload: bytes | None = pickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc_payload = None
            failure = (type(exc).__qualname__, str(exc), traceback.format_exc(), exc_payload)
            result_queue.put((task_id, rank, False, failure))
    with contextlib.suppress(Exception):  # exiting anyway
        dist.destroy_process_group()


class GlooPool:
    """``world_size`` worker processes (see :func:`_worker_context`) sharing one gloo process group.

    Use through :func:`run_on_ranks` or the ``gloo`` fixture rather than directly, so that pools
    are shared and bounded.
    """

    def __init__(self, world_size: int, *, start_timeout_s: float = _START_TIMEOUT_S,
                 pg_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.pids: list[int] = []
        self._ctx = _worker_context()
        self._next_task_id = 0
        self._closed = False
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between probing it and binding it
            error = self._start(start_timeout_s, pg_timeout_s)
            if error is None:
                return
            last_error = error
            self._stop_processes()
        self._closed = True
        raise RuntimeError(f"could not start a gloo pool of world size {world_size}:\n{last_error}")

    def _start(self, start_timeout_s: float, pg_timeout_s: float) -> str | None:
        """Spawn the workers and wait until each has joined the process group; return an error text."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._result_queue = self._ctx.Queue()
        self._task_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        self._processes = [
            self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_method, pg_timeout_s,
                      self._task_queues[rank], self._result_queue),
                name=f"gloo-worker-{rank}-of-{self.world_size}",
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        pids: dict[int, int] = {}
        deadline = time.monotonic() + start_timeout_s
        while len(pids) < self.world_size:
            try:
                message = self._result_queue.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
                if dead:
                    codes = {r: self._processes[r].exitcode for r in dead}
                    return f"worker(s) exited during start-up, exit codes by rank: {codes}"
                if time.monotonic() > deadline:
                    return f"only ranks {sorted(pids)} joined the process group in {start_timeout_s:.0f} s"
                continue
            if message[0] == "init_error":
                return f"rank {message[1]} failed in init_process_group:\n{message[2]}"
            if message[0] == "ready":
                pids[message[1]] = message[2]
        self.pids = [pids[rank] for rank in range(self.world_size)]
        return None

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._processes)

    def run(self, fn: Callable[..., Any], /, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
        return self.run_pickled(_pickle_task(fn, args, kwargs), _name_of(fn), timeout_s=timeout_s)

    def run_pickled(self, payload: bytes, name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """:meth:`run` for a task already pickled by ``_pickle_task`` (so errors come before a spawn)."""
        if not self.alive:
            raise RuntimeError(f"the gloo pool of world size {self.world_size} is shut down")
        task_id = self._next_task_id
        self._next_task_id += 1
        for task_queue in self._task_queues:
            task_queue.put((task_id, list(sys.path), payload))

        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str, bytes | None]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < self.world_size:
            try:
                message = self._result_queue.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes)
                        if not p.is_alive() and r not in results and r not in failures]
                if dead:
                    codes = {r: self._processes[r].exitcode for r in dead}
                    self.shutdown()
                    if failures:
                        break
                    raise WorkerDied(
                        f"worker process(es) of world size {self.world_size} died while running "
                        f"{name}; exit codes by rank: {codes}. "
                        "The pool was shut down; the next call spawns a new one."
                    ) from None
                if time.monotonic() > deadline:
                    self.shutdown()
                    if failures:
                        break  # the stragglers are most likely stuck in a collective: report the failure
                    pending = [r for r in range(self.world_size) if r not in results]
                    raise TimeoutError(
                        f"{name} did not finish on ranks {pending} of "
                        f"{self.world_size} within {timeout_s:.0f} s (a hang, or a collective that not "
                        "every rank issues?). The pool was shut down; the next call spawns a new one."
                    ) from None
                continue
            msg_task_id, rank, ok, data = message
            if msg_task_id != task_id:
                continue  # late answer to an earlier task that already failed
            if ok:
                results[rank] = pickle.loads(data)
            else:
                if not failures:  # the others get a short grace period, not the full timeout
                    deadline = min(deadline, time.monotonic() + _STRAGGLER_GRACE_S)
                failures[rank] = data

        if failures:
            raise self._rank_error(failures)
        return [results[rank] for rank in range(self.world_size)]

    def _rank_error(self, failures: dict[int, tuple[str, str, str, bytes | None]]) -> RankError:
        first = min(failures)
        exc_type, exc_text, remote_tb, exc_payload = failures[first]
        others = {r: f"{f[0]}: {f[1]}" for r, f in failures.items() if r != first}
        error = RankError(first, self.world_size, exc_type, exc_text, remote_tb, others)
        if exc_payload is not None:
            with contextlib.suppress(Exception):  # the text above is what matters
                error.__cause__ = pickle.loads(exc_payload)
        return error

    def _stop_processes(self) -> None:
        processes = getattr(self, "_processes", [])
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for q in [*getattr(self, "_task_queues", []), getattr(self, "_result_queue", None)]:
            if q is not None:
                q.close()
                q.cancel_join_thread()

    def shutdown(self) -> None:
        """Stop the workers at once; safe to call twice.

        Workers are idle between tasks and hold nothing worth saving, so they are terminated
        (SIGTERM) rather than asked to tear down torch, which takes seconds per process.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_processes()


class PoolManager:
    """Keeps at most ``max_pools`` :class:`GlooPool` alive, keyed by world size, least recently used out."""

    def __init__(self, max_pools: int = MAX_POOLS, *,
                 pool_factory: Callable[[int], GlooPool] = GlooPool) -> None:
        if max_pools < 1:
            raise ValueError(f"max_pools must be >= 1, got {max_pools}")
        self.max_pools = max_pools
        self._pool_factory = pool_factory
        self._pools: OrderedDict[int, GlooPool] = OrderedDict()
        self._lock = threading.Lock()

    def pool(self, world_size: int) -> GlooPool:
        """The live pool of this world size, spawning it (and evicting the least recently used) if needed."""
        with self._lock:
            pool = self._pools.pop(world_size, None)
            if pool is not None and not pool.alive:
                pool.shutdown()
                pool = None
            if pool is None:
                while len(self._pools) >= self.max_pools:  # free the cores before spawning more
                    _, evicted = self._pools.popitem(last=False)
                    evicted.shutdown()
                pool = self._pool_factory(world_size)
            self._pools[world_size] = pool
            return pool

    def run(self, world_size: int, fn: Callable[..., Any], /, *args: Any,
            timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        payload = _pickle_task(fn, args, kwargs)  # a bad task fails here, before any spawn
        return self.pool(world_size).run_pickled(payload, _name_of(fn), timeout_s=timeout_s)

    def live_world_sizes(self) -> list[int]:
        """World sizes with a live pool, least recently used first."""
        with self._lock:
            return [ws for ws, pool in self._pools.items() if pool.alive]

    def shutdown_all(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.shutdown()


_MANAGER = PoolManager()
atexit.register(_MANAGER.shutdown_all)


def run_on_ranks(world_size: int, fn: Callable[..., Any], /, *args: Any,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of the shared gloo pool of that size.

    Returns the ``world_size`` return values, indexed by rank. Raises :class:`RankError` if ``fn``
    raised on any rank, ``TimeoutError`` after ``timeout_s`` seconds, :class:`WorkerDied` if a
    worker process exited. ``timeout_s`` is keyword-only and not passed to ``fn``.
    """
    return _MANAGER.run(world_size, fn, *args, timeout_s=timeout_s, **kwargs)


def pool_for(world_size: int) -> GlooPool:
    """The shared pool of this world size (spawned if needed); for tests of the harness itself."""
    return _MANAGER.pool(world_size)


def live_world_sizes() -> list[int]:
    """World sizes whose shared pool is alive, least recently used first."""
    return _MANAGER.live_world_sizes()


def shutdown_all() -> None:
    """Shut down every shared pool (the ``gloo`` fixture does this at the end of the session)."""
    _MANAGER.shutdown_all()


def outcomes_of_fresh_groups(launch: Callable[..., Any], cases: Any, folder: str, *, deadline_s: float, what: str) -> Any:
    """Run ``launch(cases, folder)`` in a spawned process (it starts fresh groups of its own, which exit after their
    errors) and return what it pickled to ``folder/outcomes.pickle``; the test fails if it runs past ``deadline_s``."""
    import pytest

    launcher = mp.get_context("spawn").Process(target=launch, args=(cases, folder))
    launcher.start()
    launcher.join(deadline_s)
    if launcher.is_alive():
        launcher.kill()
        launcher.join()
        pytest.fail(f"{what} did not finish within {deadline_s:g} s")
    assert launcher.exitcode == 0, f"the launcher exited with {launcher.exitcode}"
    with open(os.path.join(folder, "outcomes.pickle"), "rb") as file:
        return pickle.load(file)

