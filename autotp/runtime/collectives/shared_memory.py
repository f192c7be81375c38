"""A shared-memory all-reduce (and all-gather) for the ranks of a gloo group that run on one host.

On one host, gloo still moves every collective over TCP loopback and wakes each rank through the
kernel: about 0.7 ms per all-reduce of 2 KiB at tp 2 on a busy 2-core machine, most of a decode
step. Ranks on one host can instead share a memory segment: each rank copies its tensor into its
own slot, raises its sequence counter, waits until every counter has reached the same value, and
sums the ``world_size`` slots itself (about 40 us at tp 2 on the same machine). DeepSpeed's CPU
inference does the same for ranks on one host; vLLM's custom all-reduce is the GPU analogue.

Layout of one segment (a file under ``/dev/shm``, mapped by every rank with
``torch.from_file(shared=True)``)::

    [ counter of rank 0 | ... | counter of rank ws-1 ]   one int64 per 64-byte line (no false sharing)
    [ slots of call parity 0: ws x slot_bytes ]
    [ slots of call parity 1: ws x slot_bytes ]

Call ``k`` (counting from 1, per segment, the same on every rank) uses the slots of parity
``k % 2``. Double buffering is enough: a rank writes its parity-``k % 2`` slot again at call
``k + 2`` only after every rank raised its counter to ``k + 1``, which each rank does only after
it has read the slots of call ``k``. A tensor larger than a slot goes through in slot-sized
chunks, one call each.

Ordering: the counter is stored after the slot's data, and a rank reads the slots only after it
saw every counter at ``k``. On x86-64 (total store order) a store is seen by other cores after
the stores before it, so no fence is needed; elsewhere the ranks keep gloo
(the shared-memory row of :data:`autotp.cost_model.collective_forms.FORM_TABLE`, which the runtime and the
cost model read).

TSO does not order non-temporal stores; the copies into the slots use ordinary stores (torch's
vectorised copy), or non-temporal ones that the copy routine fences itself (glibc's ``memcpy`` ends
its non-temporal loop with ``sfence``).

Every rank adds the slots in rank order (rank 0 first), so every rank gets the same bits: tokens
picked from the result agree on every rank. An all-gather (:meth:`SharedMemoryAllReduce.all_gather`,
graph target :class:`SharedMemoryAllGather`) uses the same slots and counter: every rank copies
the ``ws`` slots into its output in rank order.

Waiting spins with ``os.sched_yield()`` (ranks may outnumber cores) up to ``timeout_s``; then
:class:`~autotp.base.errors.RankTimeoutError` names the ranks that did not arrive. A wait that lasts
half a second looks for a failure note of another rank (:mod:`autotp.runtime.agreement.peer_failure`), then twice a
second, and raises :class:`~autotp.base.errors.PeerFailedError` on one. Where the ranks
outnumber the cores, a rank spins only briefly and then sleeps between looks, so that the ranks
still computing get the cores. The segment is unlinked as soon as every rank has mapped it, so a
crash leaves nothing under ``/dev/shm``; its memory goes when the last rank drops its mapping.

:func:`shared_memory_all_reduce_for` builds one :class:`SharedMemoryAllReduce` per graph and
group (a mesh's tensor-parallel sub-groups each get their own segment); the graph calls it as the
target of a ``call_function`` node (:mod:`autotp.passes.small_collectives`);
:func:`autotp.runtime.collectives.inference_collectives.inference_all_reduces` puts it in an inference graph.

A compiler cannot trace a Python callable with its own state, so for ``torch.compile`` (the ``compiled``
and ``cuda_graph`` runtime modes, :mod:`autotp.runtime.execution.runtime_modes`)
:func:`~autotp.passes.small_collectives.compiler_visible_collectives` puts custom ops in their place
(``autotp::shared_memory_all_reduce`` and ``autotp::shared_memory_all_gather``, each stand-in's
:meth:`~autotp.passes.small_collectives.StandInCollective.compiler_form`): each takes the segment as a
tensor it mutates (so the compiler keeps every call, in graph order, and never drops one) and the call's
settings as ints. All
of a rank's state is in the segment (its counter is its number of calls), so eager stand-ins and
compiled ops on one segment stay in step; the mapping tensor carries its :class:`SharedMemoryAllReduce`
as an attribute, so an op does not rebuild its views per call. An op handed a copy of the segment instead of the mapping
raises rather than wait for ranks that cannot see it.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from autotp.base.errors import AutoTPError, RankTimeoutError
from autotp.cost_model.collective_forms import FORM_TABLE, CollectiveForm
from autotp.passes.small_collectives import StandInCollective
from autotp.runtime.agreement.peer_failure import GRACE_S, POLL_S, FailureNotes, failure_notes
from autotp.runtime.collectives.hosts import Host, one_host

__all__ = ["DEFAULT_SLOT_BYTES", "SharedMemoryAllGather", "SharedMemoryAllReduce", "shared_memory_all_reduce_for"]

DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes of one rank's slot: larger tensors go through in chunks of this size (a prefill's
all-reduce of 8 rows x 512 tokens x 512 fp32 is 8 chunks); a segment holds ``2 * ws`` slots."""

_LINE_BYTES = 64  # one counter per cache line
_LINE_INT64 = _LINE_BYTES // 8
_SPINS_PER_CLOCK_READ = 16
_SPIN_S = 100e-6  # how long a rank of an oversubscribed group spins before it sleeps between looks
_SLEEP_S = 50e-6


class SharedMemoryAllReduce(StandInCollective):
    """Sum of a CPU tensor over the ranks of one group through a shared segment (module docstring).

    Called as ``op(x)`` from a graph node, on every rank of the group in the same order; returns a
    new tensor. Holds the mapping and this rank's call counter; build it with
    :func:`shared_memory_all_reduce_for`.
    """

    __module__ = "autotp.runtime.collectives.shared_memory"
    kind = "all_reduce"

    def __init__(self, segment: torch.Tensor, *, rank: int, world_size: int, slot_bytes: int,
                 timeout_s: float, notes: FailureNotes | None = None) -> None:
        header = world_size * _LINE_BYTES
        self.notes = notes  # a peer's failure note ends a wait at once (autotp.runtime.agreement.peer_failure)
        self.segment = segment  # the whole mapping (uint8): what the compiled form takes as a tensor
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self.counters = segment[:header].view(torch.int64)[::_LINE_INT64]  # (ws,) one per line
        # the same memory through numpy: a store or a min() costs ~0.2 us there against ~5-10 us per torch op
        self._counters = self.counters.numpy()
        self.slots = segment[header:header + 2 * world_size * slot_bytes].view(2, world_size, slot_bytes)
        self._views: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.oversubscribed = world_size > cores  # the waiting ranks then sleep after a short spin
        self.__name__ = "autotp_shared_memory_all_reduce"

    def __repr__(self) -> str:
        return f"SharedMemoryAllReduce(rank={self.rank}, world_size={self.world_size})"

    def compiler_form(self) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
        """``autotp::shared_memory_all_reduce`` on the segment (module docstring)."""
        return torch.ops.autotp.shared_memory_all_reduce.default, self.segment, self._op_settings()

    def _op_settings(self) -> tuple[int, ...]:
        """The ints an op of this segment takes after it: its address, rank, size, slot and timeout."""
        setattr(self.segment, "_autotp_collective", self)  # noqa: B010 - read by _on_segment: no views per call
        return (self.segment.data_ptr(), self.rank, self.world_size, self.slot_bytes,
                max(1, round(self.timeout_s * 1000)))

    def __deepcopy__(self, memo: dict) -> SharedMemoryAllReduce:
        return self  # a copy of a graph still talks to the same ranks through the same segment

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        per_slot = self.slot_bytes // x.element_size()
        if flat.numel() <= per_slot:  # one call (every decode step's all-reduce): no output to slice
            rows = self._exchange(flat)[1]
            out = torch.add(rows[0], rows[1])
            for row in rows[2:]:  # rank order: the same bits on every rank
                out.add_(row)
            return out.view(x.shape)
        out = torch.empty_like(flat)
        for start in range(0, flat.numel(), per_slot):
            rows = self._exchange(flat[start:start + per_slot])[1]
            piece = out[start:start + rows[0].numel()]
            torch.add(rows[0], rows[1], out=piece)
            for row in rows[2:]:
                piece.add_(row)
        return out.view(x.shape)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked along dim 0 in rank order (``all_gather_into_tensor``'s result)."""
        flat = x.reshape(-1)
        shape = (self.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (self.world_size,)
        per_slot = self.slot_bytes // x.element_size()
        if flat.numel() <= per_slot:
            return self._exchange(flat)[0].clone().view(shape)
        out = torch.empty((self.world_size, flat.numel()), dtype=x.dtype)
        for start in range(0, flat.numel(), per_slot):
            slots = self._exchange(flat[start:start + per_slot])[0]  # (ws, count)
            out[:, start:start + slots.shape[1]].copy_(slots)
        return out.view(shape)

    def _slot_views(self, parity: int, dtype: torch.dtype, count: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The ``(ws, count)`` view of the slots of ``parity`` and its rows, made once per kind of call:
        a graph makes the same few calls every step, and slicing costs more than the data at decode sizes."""
        key = (parity, dtype, count)
        views = self._views.get(key)
        if views is None:
            slots = self.slots[parity].view(dtype)[:, :count]
            views = self._views[key] = (slots, tuple(slots.unbind(0)))
        return views

    def _exchange(self, piece: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Put ``piece`` (at most one slot) in this rank's slot of the next call and wait for every rank's;
        returns the ``(ws, count)`` view of the slots and its rows, valid until this rank's call after next."""
        call = int(self._counters[self.rank]) + 1  # this rank's counter is its number of calls so far
        views = self._slot_views(call % 2, piece.dtype, piece.numel())
        views[1][self.rank].copy_(piece)
        self._counters[self.rank] = call  # after the data: seen after it on x86-64 (TSO)
        self._wait_for_all(call)
        return views

    def _wait_for_all(self, call: int) -> None:
        """Return once every rank's counter reached ``call``; RankTimeoutError after ``timeout_s``.

        Spins with ``os.sched_yield()``; where the group's ranks outnumber this process's cores, only for
        :data:`_SPIN_S`, then sleeps :data:`_SLEEP_S` between looks, so that the ranks still computing
        get the cores (measured at tp 4 on 2 cores: ~1.5x faster per decode-like step than spinning)."""
        counters = self._counters
        if counters.min() >= call:
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        spin_until = start + (_SPIN_S if self.oversubscribed else self.timeout_s)
        next_look = start + GRACE_S  # a wait this long looks for a peer's failure note, then every POLL_S
        spins = 0
        while counters.min() < call:
            spins += 1
            if spins % _SPINS_PER_CLOCK_READ:
                os.sched_yield()
                continue
            now = time.monotonic()
            if now > deadline:
                missing = [r for r, c in enumerate(counters.tolist()) if c < call]
                raise RankTimeoutError(
                    f"shared-memory collective (call {call}): rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} of the group did not arrive within {self.timeout_s:g} s "
                    f"(rank {self.rank} waited). Those processes crashed, hang, or run other code; if they are "
                    "only slow, pass a larger agreement_timeout_s= to autotp.compile.")
            if self.notes is not None and now >= next_look:
                next_look = now + POLL_S
                self.notes.check()  # raises PeerFailedError naming the rank that failed
            if now > spin_until:
                time.sleep(_SLEEP_S)
                spins = -1  # look again right after the sleep: the next iteration reads the clock


class SharedMemoryAllGather(StandInCollective):
    """``all_gather_into_tensor`` through the segment of a :class:`SharedMemoryAllReduce` (the same
    calls counter, so the two kinds interleave in one graph); called as ``op(x)`` from a graph node."""

    __module__ = "autotp.runtime.collectives.shared_memory"
    kind = "all_gather"

    def __init__(self, segment: SharedMemoryAllReduce) -> None:
        self.segment = segment
        self.world_size = segment.world_size
        self.__name__ = "autotp_shared_memory_all_gather"

    def __repr__(self) -> str:
        return f"SharedMemoryAllGather(rank={self.segment.rank}, world_size={self.world_size})"

    def compiler_form(self) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
        """``autotp::shared_memory_all_gather`` on the segment (module docstring)."""
        return torch.ops.autotp.shared_memory_all_gather.default, self.segment.segment, self.segment._op_settings()

    def __deepcopy__(self, memo: dict) -> SharedMemoryAllGather:
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.segment.all_gather(x)


def shared_memory_all_reduce_for(group: dist.ProcessGroup | None, *, host: Host, timeout_s: float,
                                 slot_bytes: int = DEFAULT_SLOT_BYTES,
                                 device_type: str = "cpu") -> SharedMemoryAllReduce | None:
    """A :class:`SharedMemoryAllReduce` on ``group``, or None where the ranks keep gloo.

    Collective: every rank of ``group`` calls it at the same point, with ``host`` where it runs
    (:class:`~autotp.runtime.collectives.hosts.Host`: the launcher's node where it names one). None (on every rank alike)
    when the shared-memory row of :data:`~autotp.cost_model.collective_forms.FORM_TABLE` says no (another backend,
    ranks on several hosts, not x86-64, or some rank's tensors not in host memory: ``device_type``, the
    device of the tensors this rank would sum), or when the segment cannot be made (a warning names why).
    """
    from autotp.runtime.agreement.exchanges import exchange, exchanges_with_others

    if not exchanges_with_others(group):
        return None
    backend = str(dist.get_backend(group))
    if backend != "gloo":  # decided alike on every rank: no exchange needed
        return None
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    path = f"/dev/shm/autotp-all-reduce-{uuid.uuid4().hex}"
    identities = exchange((host, path, device_type), group=group, timeout_s=timeout_s,
                          what="the shared-memory all-reduce's host check")
    machine = identities[0][0].machine
    devices = {device for _, _, device in identities}
    if not FORM_TABLE[CollectiveForm.SHARED_MEMORY].takes_group(
            backend=backend, one_host=one_host([h for h, _, _ in identities]), machine=machine, device_types=devices):
        return None
    path = identities[0][1]  # rank 0's name
    nbytes = world_size * _LINE_BYTES + 2 * world_size * slot_bytes
    segment, failure = None, ""
    if rank == 0:
        try:
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # created, zero-filled
        except (OSError, RuntimeError) as exc:
            failure = f"rank 0 could not create {path}: {exc}"
    failures = exchange(failure, group=group, timeout_s=timeout_s, what="the shared-memory segment's creation")
    if not failures[0] and rank != 0:
        try:
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            failure = f"rank {rank} could not map {path}: {exc}"
    failures = exchange(failure or failures[0], group=group, timeout_s=timeout_s,
                        what="the shared-memory segment's mapping")
    if rank == 0 and segment is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)  # every rank holds its mapping: nothing is left behind after a crash
    problems = [f for f in failures if f]
    if problems or segment is None:
        warnings.warn(f"autotp keeps gloo's all-reduce on this group: {problems[0] if problems else 'no segment'}",
                      stacklevel=2)
        return None
    return SharedMemoryAllReduce(segment, rank=rank, world_size=world_size, slot_bytes=slot_bytes,
                                 timeout_s=timeout_s, notes=failure_notes(group, timeout_s=timeout_s))


def _on_segment(segment: torch.Tensor, address: int, rank: int, world_size: int, slot_bytes: int,
                timeout_ms: int) -> SharedMemoryAllReduce:
    """The all-reduce over ``segment`` as a compiled graph's op calls it; AutoTPError when ``segment`` is not
    the mapping at ``address`` (the compiler copied it, and no other rank would see this rank's data)."""
    known = getattr(segment, "_autotp_collective", None)  # the mapping itself carries its all-reduce (fast path)
    if isinstance(known, SharedMemoryAllReduce):
        return known
    if segment.data_ptr() != address:
        raise AutoTPError(
            "the compiled graph handed the shared-memory collective a copy of its segment, so the other ranks would "
            "never see this rank's data; run with autotp.RuntimeOptions(runtime_mode='eager') and report the torch "
            f"release ({torch.__version__})")
    return SharedMemoryAllReduce(segment, rank=rank, world_size=world_size, slot_bytes=slot_bytes,
                                 timeout_s=timeout_ms / 1000)


_SCHEMA_ARGS = "Tensor x, Tensor(a!) segment, int address, int rank, int world_size, int slot_bytes, int timeout_ms"
_LIBRARY = torch.library.Library("autotp", "DEF")  # held for the life of the process
"""The two ops, defined on a plain :class:`torch.library.Library` rather than with ``torch.library.custom_op``:
a call of a ``custom_op`` with a mutated argument cost about 16 us more than the function it wraps on this
project's CPU, and one defined here about 3 us, paid by every all-reduce of a compiled decode step (18 per
token at tp 2 on the benchmark's 8-layer Llama)."""
_LIBRARY.define(f"shared_memory_all_reduce({_SCHEMA_ARGS}) -> Tensor")
_LIBRARY.define(f"shared_memory_all_gather({_SCHEMA_ARGS}) -> Tensor")


def _all_reduce_op(x: torch.Tensor, segment: torch.Tensor, address: int, rank: int, world_size: int,
                   slot_bytes: int, timeout_ms: int) -> torch.Tensor:
    """:class:`SharedMemoryAllReduce` as an op a compiler keeps opaque (``segment`` is mutated: the calls stay
    in order)."""
    return _on_segment(segment, address, rank, world_size, slot_bytes, timeout_ms)(x)


def _all_reduce_fake(x: torch.Tensor, segment: torch.Tensor, address: int, rank: int, world_size: int,
                     slot_bytes: int, timeout_ms: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_op(x: torch.Tensor, segment: torch.Tensor, address: int, rank: int, world_size: int,
                   slot_bytes: int, timeout_ms: int) -> torch.Tensor:
    """:meth:`SharedMemoryAllReduce.all_gather` as an op a compiler keeps opaque."""
    return _on_segment(segment, address, rank, world_size, slot_bytes, timeout_ms).all_gather(x)


def _all_gather_fake(x: torch.Tensor, segment: torch.Tensor, address: int, rank: int, world_size: int,
                     slot_bytes: int, timeout_ms: int) -> torch.Tensor:
    shape = (world_size * x.shape[0], *x.shape[1:]) if x.dim() else (world_size,)
    return x.new_empty(shape)


for _name, _op, _fake in (("shared_memory_all_reduce", _all_reduce_op, _all_reduce_fake),
                          ("shared_memory_all_gather", _all_gather_op, _all_gather_fake)):
    _LIBRARY.impl(_name, _op, "CPU")
    torch.library.register_fake(f"autotp::{_name}", _fake, lib=_LIBRARY)
