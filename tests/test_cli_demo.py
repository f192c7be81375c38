"""How the ranks of ``autotp demo`` fail: the failing rank is named, with its error, and the exit code is 2.

(The demo itself, ``autotp demo --world-size 2``, is run by hand before each release: a test of it
cost about 25 CPU-seconds of the suite's 15-minute budget.)"""

from __future__ import annotations

import pytest

from autotp.cli.demo_ranks import spawn_ranks
from tests.cli_factories import failing_rank


@pytest.mark.distributed
def test_spawn_ranks_names_the_failing_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Two spawned processes, rank 1 raises: exit code 2, no result, and the message names rank 1 and its error."""
    code, result = spawn_ranks(failing_rank, ("shard file missing",), 2, "autotp demo --test")
    err = capsys.readouterr().err
    assert (code, result) == (2, None), f"expected (2, None) when a rank raises, got {(code, result)}"
    assert "autotp demo --test failed on rank 1" in err and "shard file missing" in err, err
