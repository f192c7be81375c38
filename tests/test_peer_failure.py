"""A rank that raises inside its rank-local graph reaches every rank within seconds, and every process exits.

The last two tests check the notes' bookkeeping over an in-process store (no processes).

Each case of ``tests/failing_ranks.py`` runs fresh gloo ranks (rank 0 hosting the store) that compile a small
MLP, call it once, then call it with a NaN in one rank's input: that rank's graph raises in its first op, before
the collective the other ranks then wait in (the shared-memory all-reduce, or a gloo reduce-scatter), in the
eager and the compiled runtime modes. Before, the others waited there until ``agreement_timeout_s`` (here 120 s)
or gloo's own timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from distributed import outcomes_of_fresh_groups
from failing_ranks import CASES, launch

from autotp.base.errors import PeerFailedError, TracedValueError
from autotp.runtime.agreement.peer_failure import FailureNotes, watched_wait

BOUND_S = 30.0
"""Every rank must have raised within this many seconds of the failing call (the waiting ranks look for a
failure note after 0.5 s, then twice a second)."""

DEADLINE_S = 600.0  # the whole launch (compiled cases compile on 2 busy cores): a hang fails the test


@pytest.mark.distributed
def test_failure_on_one_rank_reaches_every_rank(tmp_path: Path) -> None:
    """tp=2 and tp=3 in fresh processes; one rank's graph raises mid-forward (rank 1, or rank 0 which hosts the
    store); shared-memory and gloo collectives, eager and compiled: the failing rank raises its own error (the
    ValueError), every other rank a PeerFailedError naming it and its error, all within 30 s, and every process
    exits 0."""
    outcomes = outcomes_of_fresh_groups(launch, list(CASES), str(tmp_path), deadline_s=DEADLINE_S, what=f"the {len(CASES)} groups")
    for name, (mode, _, failing, world_size) in CASES.items():
        ranks = outcomes[name]
        assert len(ranks) == world_size and all(r[0] is not None for r in ranks), f"{name}: missing results {ranks}"
        assert [code for _, code, _ in ranks] == [0] * world_size, f"{name}: exit codes {[r[1] for r in ranks]}"
        first = ranks[0][0]
        kinds = first["counts"]
        watched = "reduce_scatter" if name.startswith("gloo") else "all_reduce"
        assert watched in kinds, f"{name}: expected a {watched} in the graph (the case must wait there), got {kinds}"
        own_kind, own_message = ranks[failing][0]["raised"]
        assert (own_kind, own_message) == ("ValueError", "input holds non-finite values"), \
            f"{name} ({mode}): the failing rank {failing} raised {own_kind}: {own_message[:500]}"
        last_done = max(result["done_at"] for result, _, _ in ranks)
        for rank, (_, _, exited) in enumerate(ranks):  # joined in rank order: each exit seen after the last result
            assert exited - last_done < BOUND_S, \
                f"{name}: rank {rank} exited {exited - last_done:.1f} s after the last rank's result, expected < {BOUND_S:g} s"
        for rank, (result, _, _) in enumerate(ranks):
            assert result["first_diff"] < 1e-4, f"{name} rank {rank}: the good call differs by {result['first_diff']}"
            kind, message = result["raised"]
            if rank != failing:
                assert kind == "PeerFailedError" and f"rank {failing} of {world_size} raised" in message \
                    and f"{own_kind}: {own_message[:60]}" in message, \
                    f"{name} ({mode}): rank {rank} raised {kind}: {message[:500]}"
            assert result["seconds"] < BOUND_S, \
                f"{name} ({mode}): rank {rank} raised after {result['seconds']:.1f} s, expected < {BOUND_S:g} s"


def _notes_of_two_ranks() -> tuple[FailureNotes, FailureNotes]:
    store = dist.HashStore()
    return tuple(FailureNotes(store, rank=rank, world_size=2, hosts_store=False, timeout_s=5.0) for rank in (0, 1))


def test_a_note_names_the_failed_rank_and_a_call_every_rank_failed_is_no_news() -> None:
    """2 ranks' notes over one in-process store: rank 1 fails at call 1, rank 0 learns it; both fail at call 2 (the
    same TracedValueError), and at call 3 neither finds news."""
    first, second = _notes_of_two_ranks()
    for notes in (first, second):
        notes.begin_call()
    second.failed(ValueError("input holds non-finite values"))
    with pytest.raises(PeerFailedError, match="rank 1 of 2 raised during call 1 .*ValueError: input holds non-finite"):
        first.check()
    second.check()  # its own note is no news to it

    first, second = _notes_of_two_ranks()
    for _ in range(2):
        for notes in (first, second):
            notes.begin_call()
    for notes in (first, second):
        notes.failed(TracedValueError("scale was 1.0 when the model was traced; this call passes 3.0"))
    for notes in (first, second):
        notes.begin_call()
        notes.check()  # call 2 failed on every rank: no news, the call after runs


def test_a_watched_wait_looks_at_the_notes_only_while_it_waits() -> None:
    """A work that completes returns without a look at the store; one that keeps timing out ends in the peer's
    PeerFailedError once a note is there."""
    class Work:
        def __init__(self, timeouts: int) -> None:
            self.timeouts, self.waits = timeouts, 0

        def wait(self, timeout: object = None) -> bool:
            self.waits += 1
            if self.waits <= self.timeouts:
                raise RuntimeError("Operation timed out!")
            return True

    first, second = _notes_of_two_ranks()
    first.begin_call()
    second.begin_call()
    watched_wait(Work(timeouts=2), first)  # slow but fine: no note, it waits on
    second.failed(RuntimeError("CUDA out of memory"))
    with pytest.raises(PeerFailedError, match="rank 1 of 2 .*RuntimeError: CUDA out of memory"):
        watched_wait(Work(timeouts=10), first)
