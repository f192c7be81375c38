"""Small models that exercise the edges: ops without rules, in-place updates, batch statistics.

Same contract as ``tests/models.py``: ``builder(seed=0, device="cpu") -> (model, args, kwargs)``,
eval mode unless the builder says otherwise, weights and inputs from ``seed`` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from models import ModelAndInputs, _build, tiny_mixtral
from torch import nn

__all__ = ["ODD_BUILDERS"]


class UnruledMLP(nn.Module):
    """An MLP with two ops that have no sharding rule (Bessel J0, digamma) between its projections."""

    def __init__(self, hidden: int = 16, intermediate: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, hidden)
        h = torch.special.bessel_j0(self.up(x))
        return self.down(torch.digamma(h + 2.0))


class InPlaceMLP(nn.Module):
    """Updates its own intermediate tensors in place (``/=``, item assignment, ``relu_``)."""

    def __init__(self, hidden: int = 24, intermediate: int = 48) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, hidden)
        h = self.up(x)
        h.relu_()
        h /= h.sum(dim=-1, keepdim=True) + 1.0
        h[:, 0] = 0.25  # the first token of every sequence
        out = self.down(h)
        out += x
        return out


class BatchStatsCNN(nn.Module):
    """Conv + BatchNorm without running statistics, in training mode: normalised by the batch's own statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 12, 3, padding=1)
        self.norm = nn.BatchNorm2d(12, track_running_stats=False)
        self.conv2 = nn.Conv2d(12, 6, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # images: (batch, 3, height, width)
        return self.conv2(torch.relu(self.norm(self.conv1(images))))


def _tokens(seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(seed + 1))  # (batch, seq, hidden)


def unruled_mlp(seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Plain torch MLP with ops that fall back to replicated execution."""
    return _build(UnruledMLP, seed, device), (_tokens(seed, 16),), {}


def inplace_mlp(seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Plain torch MLP that updates intermediates in place (functionalized at capture)."""
    return _build(InPlaceMLP, seed, device), (_tokens(seed, 24),), {}


def batch_stats_cnn(seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Conv-BatchNorm-conv in training mode with batch statistics (no buffers change)."""
    model = _build(BatchStatsCNN, seed, device).train()
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed + 1))  # (batch, 3, 8, 8)
    return model, (images,), {}


def mixtral_batched_mm(seed: int = 0, device: str | torch.device = "cpu") -> ModelAndInputs:
    """Tiny Mixtral with transformers' batched_mm experts (gathered expert weights and bmm), one layer."""
    return tiny_mixtral(layers=1, experts_implementation="batched_mm", seed=seed, device=device)


ODD_BUILDERS: dict[str, Callable[..., ModelAndInputs]] = {
    "unruled_mlp": unruled_mlp,
    "inplace_mlp": inplace_mlp,
    "batch_stats_cnn": batch_stats_cnn,
    "mixtral_batched_mm": mixtral_batched_mm,
}
