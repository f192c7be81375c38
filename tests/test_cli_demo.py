"""The README's main job, ``autotp demo``, run as a user runs it, and how its ranks fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autotp.cli.demo_ranks import spawn_ranks
from tests.cli_factories import failing_rank


@pytest.mark.distributed
def test_demo_runs_and_checks_the_logits() -> None:
    """tp=2 over two spawned gloo processes, one-layer Llama: exit 0, the logits check passes, the plan is printed."""
    done = subprocess.run([sys.executable, "-m", "autotp.cli.main", "demo", "--world-size", "2", "--layers", "1",
                           "--seq-len", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"autotp demo exited {done.returncode}, expected 0:\n{done.stdout}\n{done.stderr}"
    assert "(tolerance 1e-04): OK" in done.stdout, f"expected the logits check to pass:\n{done.stdout}"
    assert "all_reduce x" in done.stdout, f"expected the collectives of the rank-local graph:\n{done.stdout}"


@pytest.mark.distributed
def test_spawn_ranks_names_the_failing_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Two spawned processes, rank 1 raises: exit code 2, no result, and the message names rank 1 and its error."""
    code, result = spawn_ranks(failing_rank, ("shard file missing",), 2, "autotp demo --test")
    err = capsys.readouterr().err
    assert (code, result) == (2, None), f"expected (2, None) when a rank raises, got {(code, result)}"
    assert "autotp demo --test failed on rank 1" in err and "shard file missing" in err, err
