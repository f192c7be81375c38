"""A rank that raises inside its rank-local graph reaches every rank within seconds, and every process exits.

Each case of ``tests/failing_ranks.py`` runs fresh gloo ranks (rank 0 hosting the store) that compile a small
MLP, call it once, then call it with a NaN in one rank's input: that rank's graph raises in its first op, before
the collective the other ranks then wait in (the shared-memory all-reduce, or a gloo reduce-scatter), in the
eager and the compiled runtime modes. Before, the others waited there until ``agreement_timeout_s`` (here 120 s)
or gloo's own timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from pathlib import Path

import pytest
from failing_ranks import CASES, launch

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
    launcher = mp.get_context("spawn").Process(target=launch, args=(list(CASES), str(tmp_path)))
    launcher.start()
    launcher.join(DEADLINE_S)
    if launcher.is_alive():
        launcher.kill()
        launcher.join()
        pytest.fail(f"the {len(CASES)} groups did not finish within {DEADLINE_S:g} s")
    assert launcher.exitcode == 0, f"the launcher exited with {launcher.exitcode}"
    outcomes = pickle.loads((tmp_path / "outcomes.pickle").read_bytes())
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
