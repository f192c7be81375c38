"""Trace once per host when the host's ranks outnumber its cores; write each cache entry once.

Every rank of a load needs the traced program of the same model, and with the trace cache
(:mod:`autotp.trace_cache`) that program is one file that every rank of a host can read. Tracing
is most of a cold load's time and is single-threaded CPU work. When a host runs more ranks than it
has cores (four ranks on two), all of them tracing at once makes each export take about
ranks/cores times as long; then one rank per host and cache directory traces and writes the entry
while the others wait, and they read it (a few times cheaper than an export,
:meth:`~autotp.trace_cache.TraceCache.get`), overlapping with the first rank's planning. When the
host has a core per rank, tracing side by side costs no more than one trace, and waiting for the
entry would only add its write and read: every rank traces, and one of them (the last, so that
rank 0 goes on to plan) writes the entry.

The protocol, on every rank of the group, at the same point of :func:`autotp.compile`:

1. **Probe**: look the program up in the cache without tracing. A hit is kept (a warm load
   changes nothing: every rank reads its own copy, nobody waits).
2. **Exchange 1** (:func:`autotp.runtime.agreement.exchange`): each rank says its host, the CPUs
   it may run on, its cache directory, key and whether it hit. The ranks that missed with the same
   host, directory and key form a set; every rank computes the same roles from this table.
3. **Exchange 2** (only when some rank waits): the set's first rank traces (export, then writes
   the entry) and says how it went; the others wait for it (at most ``timeout_s``), then read the
   entry. A tracer's error reaches the ranks that waited for it, which raise the same error, so
   the agreement after capture sees every rank fail alike
   (:func:`autotp.runtime.agreement.ranks_agree`). A waiter that still misses (the tracer could
   not write the entry) traces itself: slower, never wrong.

Nothing here raises out of :func:`capture_once_per_host` before its exchanges are made: every
error is kept in the :class:`SharedCapture` and raised by :meth:`SharedCapture.result` inside the
agreement, so a rank that fails never leaves the others waiting at an exchange.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.errors import CaptureError
from autotp.capture import CapturedGraph, capture
from autotp.runtime.agreement import exchange

__all__ = ["SharedCapture", "capture_once_per_host"]


class _Miss(Exception):
    """The probe found no usable cache entry (never leaves this module)."""


class _Probe:
    """A trace cache that answers hits and turns a miss into :class:`_Miss` (so nothing is traced),
    remembering the key it was asked for."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.key: str | None = None

    def get(self, key: str, model: torch.nn.Module, device: torch.device) -> Any:
        self.key = key
        exported = self.cache.get(key, model, device)
        if exported is None:
            raise _Miss(key)
        return exported

    def put(self, key: str, exported: Any) -> None:  # pragma: no cover - a miss raises before any trace
        raise AssertionError("the probe never traces")


@dataclasses.dataclass(frozen=True)
class _Arrival:
    """What each rank says at exchange 1."""

    host: str
    cpus: frozenset[int]  # the CPUs this process may run on
    directory: str
    key: str | None  # None: the probe failed before it knew the key (an error, raised later)
    hit: bool


class SharedCapture:
    """The outcome of :func:`capture_once_per_host` on this rank: :meth:`result` returns the captured
    graph or raises the error this rank (or the rank that traced for it) met."""

    def __init__(self, captured: CapturedGraph | None, error: BaseException | None) -> None:
        self._captured = captured
        self._error = error

    def result(self) -> CapturedGraph:
        if self._error is not None:
            raise self._error
        assert self._captured is not None, "a SharedCapture holds a graph or an error"
        return self._captured


def _portable(error: BaseException, model: torch.nn.Module, rank: int) -> BaseException:
    """``error`` if it survives pickling (then every rank raises the same text), else a CaptureError saying it."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - any exception that cannot travel is described instead
        pass
    return CaptureError(f"rank {rank} could not trace {type(model).__name__}: {type(error).__name__}: {error}")


def _cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity where the OS says it, else all of them)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def _role(arrivals: list[_Arrival], rank: int) -> tuple[str, int]:
    """What ``rank`` does, and the rank that writes the entry it needs: ``"done"`` (the probe read the
    entry, or failed: its error is kept), ``"wait"`` (for the writer), ``"trace and write"``, or
    ``"trace"`` (without writing).

    The ranks that missed with the same host, directory and key share one trace when their host
    runs more ranks than it has CPUs (the union of their affinities); otherwise each traces and
    the last of them writes the entry."""
    mine = arrivals[rank]
    if mine.hit or mine.key is None:
        return "done", rank
    same = [r for r, a in enumerate(arrivals)
            if not a.hit and (a.host, a.directory, a.key) == (mine.host, mine.directory, mine.key)]
    on_host = [a for a in arrivals if a.host == mine.host]
    cpus = frozenset().union(*(a.cpus for a in on_host))
    if len(same) > 1 and len(on_host) > len(cpus):
        return ("trace and write" if rank == same[0] else "wait"), same[0]
    return ("trace and write" if rank == same[-1] else "trace"), same[-1]


def capture_once_per_host(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                          example_kwargs: dict[str, Any] | None, *, trace_cache: Any,
                          group: dist.ProcessGroup | None, timeout_s: float,
                          **capture_options: Any) -> SharedCapture | None:
    """:func:`autotp.capture.capture` with ``trace_cache``, with one trace per host where the host has fewer
    CPUs than ranks and one cache write per host always (see the module docstring); None where there
    is nothing to share (no cache, no process group, one rank, a
    fake group, or this process outside ``group``): then capture as usual.

    Call it on every rank of ``group`` at the same point; it makes one or two exchanges there,
    each bounded by ``timeout_s`` (the second waits for an export). ``capture_options`` go to
    :func:`~autotp.capture.capture` (``dynamic``, ``dynamic_shapes``, ``training``).
    """
    if trace_cache is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake" or dist.get_rank(group) < 0:
        return None
    rank = dist.get_rank(group)

    def run(cache: Any) -> tuple[CapturedGraph | None, BaseException | None]:
        try:
            return capture(model, example_inputs, example_kwargs, trace_cache=cache, **capture_options), None
        except _Miss:
            raise
        except Exception as exc:  # noqa: BLE001 - kept, raised inside the agreement on every rank
            return None, _portable(exc, model, rank)

    probe = _Probe(trace_cache)
    try:
        captured, error = run(probe)
        hit = error is None
    except _Miss:
        captured, error, hit = None, None, False
    arrival = _Arrival(socket.gethostname(), _cpus(), str(trace_cache.directory),
                       probe.key if error is None else None, hit)
    arrivals: list[_Arrival] = exchange(arrival, group=group, timeout_s=timeout_s,
                                        what="autotp.compile: which rank traces on each host")
    role, tracer = _role(arrivals, rank)
    if role in ("trace", "trace and write"):
        captured, error = run(trace_cache if role == "trace and write" else None)
    if not any(_role(arrivals, r)[0] == "wait" for r in range(len(arrivals))):
        return SharedCapture(captured, error)
    outcomes: list[BaseException | None] = exchange(error if role == "trace and write" else None, group=group,
                                                    timeout_s=timeout_s, what="autotp.compile: the traces made once per host")
    if role != "wait":
        return SharedCapture(captured, error)
    if outcomes[tracer] is not None:
        return SharedCapture(None, outcomes[tracer])
    return SharedCapture(*run(trace_cache))  # reads the tracer's entry (or traces, if it could not write it)
