"""Factories for ``autotp plan package.module:factory`` in tests/test_cli_plan.py."""

from __future__ import annotations

import torch
from torch import nn


def tiny_mlp(batch: int = 2, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Linear(64, 256) -> GELU -> Linear(256, 64); takes batch/seq_len, so it can be plotted."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return model, (torch.zeros(batch, seq_len, 64),)  # (batch, seq, hidden)


def not_a_model() -> int:
    return 3


def failing_rank(rank: int, message: str, results: object) -> None:
    """A spawn target that raises on rank 1 and reports 0.0 from rank 0 (for ``spawn_ranks``' error path)."""
    if rank == 1:
        raise ValueError(message)
    results.put(0.0)  # type: ignore[attr-defined]
