"""Trace once per host: the ranks that share a machine (and its cores) share one ``torch.export``.

Every rank of a load needs the traced program of the same model, and with the trace cache
(:mod:`autotp.trace_cache`) that program is one file that every rank of a host can read. Tracing
is most of a cold load's time and is pure CPU work, so when all ranks of a host trace at once on
fewer cores than ranks (four ranks on two cores), each export takes about ranks/cores times as
long. Here one rank per host and cache directory traces and writes the cache entry while the
others wait; they then read the entry, which costs about a third of an export
(:meth:`~autotp.trace_cache.TraceCache.get`), and that read overlaps with the first rank's planning.

The protocol, on every rank of the group, at the same point of :func:`autotp.compile`:

1. **Probe**: look the program up in the cache without tracing. A hit is kept (a warm load
   changes nothing: every rank reads its own copy, nobody waits).
2. **Exchange 1** (:func:`autotp.runtime.agreement.exchange`): each rank says its host, cache
   directory, key and whether it hit. Of the ranks that missed with the same host, directory and
   key, the lowest traces; when every such set has one rank, nobody waits and step 3 is skipped
   (every rank computes the same table, so all skip it or none does).
3. **Exchange 2**: the tracers trace (export, then write the entry) and say how it went; the
   others wait for it (at most ``timeout_s``), then read the entry. A tracer's error reaches the
   ranks that waited for it, which raise the same error, so the agreement after capture sees
   every rank fail alike (:func:`autotp.runtime.agreement.ranks_agree`). A waiter that still
   misses (the tracer could not write the entry) traces itself: slower, never wrong.

Nothing here raises out of :func:`capture_once_per_host` before both exchanges are made: every
error is kept in the :class:`SharedCapture` and raised by :meth:`SharedCapture.result` inside the
agreement, so a rank that fails never leaves the others waiting at an exchange.
"""

from __future__ import annotations

import dataclasses
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


def capture_once_per_host(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                          example_kwargs: dict[str, Any] | None, *, trace_cache: Any,
                          group: dist.ProcessGroup | None, timeout_s: float,
                          **capture_options: Any) -> SharedCapture | None:
    """:func:`autotp.capture.capture` with ``trace_cache``, made by one rank per host (see the module
    docstring); None where there is nothing to share (no cache, no process group, one rank, a
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
    arrival = _Arrival(socket.gethostname(), str(trace_cache.directory), probe.key if error is None else None, hit)
    arrivals: list[_Arrival] = exchange(arrival, group=group, timeout_s=timeout_s,
                                        what="autotp.compile: which rank traces on each host")
    tracer_of: dict[int, int] = {}  # rank that missed -> the rank that traces for it
    first: dict[tuple[str, str, str], int] = {}
    for r, a in enumerate(arrivals):
        if not a.hit and a.key is not None:
            tracer_of[r] = first.setdefault((a.host, a.directory, a.key), r)
    waiting = any(r != t for r, t in tracer_of.items())
    tracer = tracer_of.get(rank)
    if tracer == rank:
        captured, error = run(trace_cache)  # torch.export, then the cache entry is written
    if not waiting:
        return SharedCapture(captured, error)
    outcomes: list[BaseException | None] = exchange(error if tracer == rank else None, group=group,
                                                    timeout_s=timeout_s, what="autotp.compile: the traces made once per host")
    if tracer is None or tracer == rank:
        return SharedCapture(captured, error)
    if outcomes[tracer] is not None:
        return SharedCapture(None, outcomes[tracer])
    return SharedCapture(*run(trace_cache))  # reads the tracer's entry (or traces, if it could not write it)
