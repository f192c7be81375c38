"""Peak resident memory per rank while loading from safetensors.

tp=2, Llama (hidden 768, 2 layers, vocab 16000: 161 MiB of float32 weights in one safetensors
file). Each rank is a *fresh* process (tests/load_memory_worker.py): the shared gloo pool's
workers have run other tests and reuse freed memory, which would hide growth. A rank's resident
set may grow by at most 1/world_size of the checkpoint + 15 % + a fixed allowance for tracing and
planning; a rank that read the whole model would grow by more than the checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from load_memory_worker import SHAPES
from models import tiny_llama

FIXED_OVERHEAD_BYTES = 48 * 2**20  # trace, plan and rewrite of a 2-layer graph (measured growth: 81.5 MiB in all)
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
def test_peak_memory_per_rank_while_loading(tmp_path: Path) -> None:
    """tp=2, Llama 161 MiB on disk: each rank's peak RSS grows by <= 1/2 of it + 15 % + 48 MiB."""
    model, _, _ = tiny_llama(**SHAPES)
    model.save_pretrained(tmp_path)
    size = (tmp_path / "model.safetensors").stat().st_size
    del model
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                                 os.environ.get("PYTHONPATH", "")])}
    worker = Path(__file__).with_name("load_memory_worker.py")
    ranks = [subprocess.Popen([sys.executable, str(worker), str(rank), str(WORLD_SIZE), init_method, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(WORLD_SIZE)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    for rank, (process, (_, err)) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{err[-3000:]}"
    bound = size / WORLD_SIZE * 1.15 + FIXED_OVERHEAD_BYTES
    for rank, (out, _) in enumerate(outputs):
        result = json.loads(out.strip().splitlines()[-1])
        assert result["held"] < 0.6 * size, f"rank {rank} holds {result['held']} bytes of a {size}-byte checkpoint"
        assert result["growth"] <= bound, (
            f"rank {rank}: peak RSS grew by {result['growth'] / 2**20:.1f} MiB while loading; expected at most "
            f"{bound / 2**20:.1f} MiB (checkpoint {size / 2**20:.1f} MiB / {WORLD_SIZE} + 15 % + "
            f"{FIXED_OVERHEAD_BYTES / 2**20:.0f} MiB)")
