"""A rank that raises during a call tells the others, so none waits for it in a collective.

The rank-local graphs are the same on every rank, but a call can still fail on one rank alone (its input,
a custom op, memory). The other ranks then wait in the call's next collective for a rank that never comes:
in a gloo collective until the group's own timeout (30 minutes by default), in a shared-memory one until
``agreement_timeout_s``. Here such a failure reaches every rank within about a second:

- **The failing rank** leaves a note in the group's key-value store (:meth:`FailureNotes.post`, from the
  error path of :class:`~autotp.runtime.execution.module.TensorParallelModule` only): its rank, the call, and its
  exception as ``"Type: message"``. The process that hosts the store (world rank 0 under ``env://``),
  whether it failed or read a peer's note, waits at most :data:`ACK_WAIT_S` until every rank has read a
  note of that call before it raises, so that exiting right after its error takes the store from nobody
  (invariant 6).
- **A waiting rank** looks for notes only once a wait has lasted :data:`GRACE_S`, then every
  :data:`POLL_S`: the shared-memory collectives' wait loop (:mod:`autotp.runtime.collectives.shared_memory`), and the
  gloo collectives of an inference graph, which wait through :func:`watched_wait` (``Work.wait`` with a
  short timeout, in a loop) instead of an unbounded ``wait_tensor``. A call that completes pays nothing
  for this: no store round trip, one counter increment.
- On a note from another rank it raises :class:`~autotp.base.errors.PeerFailedError` naming that rank and
  its exception, and says it has read the note. A watched gloo collective that fails outright (``Connection
  closed by peer``: the failed rank exited) reads the notes too, and raises the peer's failure instead.

Notes are numbered per group (``store.add``) and carry the call (every rank counts the calls on the group
alike), so a note of a call on which this rank failed too (every rank raised the same ``TracedValueError``
before any collective) is no news: the next call runs as usual. After a failure inside the graph the
ranks' collectives are out of step: restart every rank.

NCCL would take the same notes; its waits cannot time out on the host, so there a thread would poll
during a call and abort the communicator (``ProcessGroup.abort``) instead of :func:`watched_wait`. Only
gloo groups (and the shared-memory collectives on them) are watched today.
"""

from __future__ import annotations

import contextlib
import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from autotp.base.errors import AgreementError, PeerFailedError
from autotp.runtime.agreement.exchanges import exchanges_with_others, group_store

__all__ = ["ACK_WAIT_S", "GRACE_S", "POLL_S", "FailureNotes", "agreed", "failure_notes", "watched_wait"]

GRACE_S = 0.5
"""Seconds a collective waits before its rank first looks for a failure note (a call that completes never looks)."""

POLL_S = 0.5
"""Seconds between two looks at the notes while a collective still waits."""

ACK_WAIT_S = 30.0
"""At most this long (and at most ``agreement_timeout_s``) the store's host waits, after its own failure, for every
rank to read its note: a rank waiting in a collective reads it within a second; one that never calls again
(its work was done) is not waited for longer."""

_PREFIX = "autotp/failure"


class FailureNotes:
    """The failure notes of one process group, as this rank reads and writes them (module docstring)."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, hosts_store: bool, timeout_s: float) -> None:
        self.store = store  # held: the store outlives the group's last collective (a failed rank 0 hosts it)
        self.rank, self.world_size, self.hosts_store, self.timeout_s = rank, world_size, hosts_store, timeout_s
        self.call = 0  # calls on the group so far: the same count on every rank
        self._read = 0  # notes read so far (by their number)
        self._own_calls: set[int] = set()  # calls on which this rank failed itself
        self.failure: PeerFailedError | None = None  # a peer's failure, once found: every later wait raises it

    def begin_call(self) -> None:
        """Count a call (the happy path's whole cost)."""
        self.call += 1

    def post(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank's current call raised ``exc``; on the store's host, wait (at most
        :data:`ACK_WAIT_S` and ``timeout_s``) until every rank has read the note. Never raises (the caller
        raises ``exc``)."""
        text = f"{type(exc).__name__}: {exc}".strip()
        text = text if len(text) <= 2000 else text[:2000] + " ..."
        self._own_calls.add(self.call)
        try:
            number = self.store.add(f"{_PREFIX}/count", 1)
            self.store.set(f"{_PREFIX}/{number}", pickle.dumps((self.rank, self.call, text)))  # type: ignore[arg-type]
            self._acknowledge(self.call)
            self._wait_for_readers(self.call)
        except (dist.DistError, RuntimeError):
            pass  # the store is gone (its host exited): nothing to tell, this rank's own error stands

    def check(self) -> None:
        """Raise :class:`~autotp.base.errors.PeerFailedError` if another rank posted a note since the last look
        (one store round trip); for a wait that has lasted a while. A store that cannot be read (its host has
        exited) has no news: the wait goes on and ends as the collective does."""
        if self.failure is not None:
            raise self.failure
        try:
            count = self.store.add(f"{_PREFIX}/count", 0)
            notes = []
            while self._read < count:
                notes.append(pickle.loads(self.store.get(f"{_PREFIX}/{self._read + 1}")))
                self._read += 1
        except (dist.DistError, RuntimeError):
            return
        for rank, call, text in notes:
            if rank == self.rank or call in self._own_calls:
                continue  # this rank's own note, or a call it abandoned too
            with contextlib.suppress(dist.DistError, RuntimeError):
                self._acknowledge(call)
                self._wait_for_readers(call)
            self.failure = PeerFailedError(
                f"rank {rank} of {self.world_size} raised during call {call} of the tensor-parallel model, so rank "
                f"{self.rank} cannot complete that call's collectives: {text}. Fix the error on rank {rank}; the "
                "ranks' collectives are out of step now: restart every rank.", rank=rank, error=text)
            raise self.failure

    def failed(self, exc: BaseException) -> None:
        """This rank's current call raised ``exc``: post a note of it, unless every rank raised it alike (an
        exchange's error) or it is a peer's failure this rank learned of. The caller raises ``exc``."""
        if not agreed(exc):
            self.post(exc)

    def check_after(self, exc: BaseException) -> None:
        """:meth:`check` after a collective of this rank failed with ``exc``: a peer's note that explains it is
        raised (from ``exc``); else the caller raises ``exc``."""
        try:
            self.check()
        except PeerFailedError as found:
            raise found from exc

    def _acknowledge(self, call: int) -> None:
        self.store.set(f"{_PREFIX}/read/{call}/{self.rank}", b"")  # type: ignore[arg-type]

    def _wait_for_readers(self, call: int) -> None:
        """On the store's host, before it raises for ``call`` (its own failure or a peer's): wait, at most
        :data:`ACK_WAIT_S` and ``timeout_s``, until every rank has read a note of that call, so that the others
        can still read it if this process exits right after its error."""
        if not self.hosts_store:
            return
        acks = [f"{_PREFIX}/read/{call}/{r}" for r in range(self.world_size)]
        with contextlib.suppress(dist.DistError):  # a rank that never reads it: this rank's error stands
            self.store.wait(acks, timedelta(seconds=min(self.timeout_s, ACK_WAIT_S)))


_NOTES: dict[dist.ProcessGroup, FailureNotes] = {}
"""One :class:`FailureNotes` per process group in this process: the module and its collectives count the same
calls and read the same notes. Keyed by the group itself: a group made again after ``destroy_process_group``
(a new store) gets new notes."""


def failure_notes(group: dist.ProcessGroup | None, *, timeout_s: float) -> FailureNotes | None:
    """The :class:`FailureNotes` of ``group``, or None where no rank can wait for another (one rank, a fake group)."""
    if not exchanges_with_others(group):
        return None
    process_group = group if group is not None else dist.group.WORLD
    notes = _NOTES.get(process_group)
    if notes is None:
        notes = _NOTES[process_group] = FailureNotes(
            group_store(group), rank=dist.get_rank(group), world_size=dist.get_world_size(group),
            hosts_store=dist.get_rank() == 0, timeout_s=timeout_s)
    return notes


def agreed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised on every rank alike by an exchange (nothing to tell the others)."""
    return isinstance(exc, (AgreementError, PeerFailedError))


def watched_wait(work: Any, notes: FailureNotes | None) -> None:
    """``work.wait()``, looking for failure notes every :data:`POLL_S` while it waits (gloo's ``Work.wait``
    times out and may be waited on again); a completed work returns at once."""
    if notes is None:
        work.wait()
        return
    while True:
        try:
            work.wait(timedelta(seconds=POLL_S))
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():  # the collective failed (a peer closed its connection)
                notes.check_after(exc)
                raise
        notes.check()
