"""How a compiled model takes its inputs: tensors in the traced order go straight to the graph, anything else is
checked against the traced structure with an error that says what was expected.

Tier (b): a fake process group (no gloo), tp=3, rank 1.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autotp


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * scale + shift


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield
    dist.destroy_process_group()


def test_keyword_tensors_in_any_order_and_clear_errors_for_other_structures(fake_group) -> None:
    """Keyword tensors given in another order than traced reach the same graph slots (the fast path keys them by
    name); a missing keyword and a container where a tensor was traced are refused with TypeError, as before."""
    torch.manual_seed(0)
    model = _Shifted()
    x, shift, scale = torch.randn(2, 5, 24), torch.randn(24), torch.randn(24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model, example_inputs=(x,), example_kwargs={"shift": shift, "scale": scale})
    with torch.no_grad():
        traced_order = tp(x, shift=shift, scale=scale)
        other_order = tp(x, scale=scale, shift=shift)
        swapped = tp(x, shift=scale, scale=shift)
    assert torch.equal(traced_order, other_order), "keyword order must not matter"
    assert not torch.equal(traced_order, swapped), "each keyword reaches its own slot"
    with pytest.raises(TypeError, match="keyword arguments"):
        tp(x, shift=shift)
    with pytest.raises(TypeError, match="structure"):
        tp((x,), shift=shift, scale=scale)
